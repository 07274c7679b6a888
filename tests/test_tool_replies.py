"""Tool-call replies cut by max_tokens (issue 23, item 9), on every front end: no call markup in
the content, a complete call never also in the text, an invalid call's arguments text only.

The replies are scripted: the engine's sampler is swapped for one that spells a fixed reply
token by token (the tool constraint still checks each token), so every test knows where the
cut falls. `REPLY` is a complete call, then a second one cut inside its arguments.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from conftest import tiny_model
from server_util import serving

import kev_engine.sample.sample as sample_module
from kev_engine import Engine
from kev_integrations.server import ServerConfig, build_app
from kev_integrations.shared import clear_shared_engines
from kev_integrations.tool_format import CUT_BY_MAX_TOKENS, split_tool_calls, visible_text

CALL = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
REPLY = CALL + '\n<tool_call>{"name": "add", "arguments": {"a": 3,'
CUT_ARGUMENTS = '{"a": 3,'
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
MODEL = "tiny"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def no_markup(content: Any) -> bool:
    text = content or ""
    return "<tool" not in text and "tool_call" not in text and not text.endswith("<")


# ---- the shared parser ---------------------------------------------------------------------------


TAG_CUT = "cut inside the <tool_call> tag"


@pytest.mark.parametrize(("text", "finish", "rest", "invalid"), [
    (REPLY, "length", "", [("add", CUT_ARGUMENTS, CUT_BY_MAX_TOKENS)]),
    ("Let me add. " + REPLY, "length", "Let me add.", [("add", CUT_ARGUMENTS, CUT_BY_MAX_TOKENS)]),
    (CALL + "\n<tool_ca", "length", "", [(None, "", TAG_CUT)]),
    ('<tool_call>{"name": "ad', "length", "", [(None, "", CUT_BY_MAX_TOKENS)]),
    ('<tool_call>{"name": "add", "argum', "length", "", [("add", "", CUT_BY_MAX_TOKENS)]),
    ('<tool_call>{"name": "add", "arguments": {"a": 3,}}</tool_call>', "stop", "", [("add", '{"a": 3,}', "JSON")]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 3"}</tool_call>', "stop", "", [("add", '{"a": 3', "JSON")]),
    ("<tool_call>{not json}</tool_call>", "stop", "", [(None, "{not json}", "JSONDecodeError")]),
    ("Three < four <", "length", "Three < four", [(None, "", TAG_CUT)]),
])
def test_the_parser_leaves_no_markup_and_keeps_only_the_arguments_text(
    text: str, finish: str, rest: str, invalid: list[tuple[str | None, str, str]]
) -> None:
    remaining, calls, bad = split_tool_calls(text, ["add"], finish_reason=finish)
    assert remaining == rest and no_markup(remaining)
    assert calls == ([{"name": "add", "arguments": {"a": 3, "b": 4}}] if CALL in text else [])
    assert [(b.name, b.arguments) for b in bad] == [(name, arguments) for name, arguments, _ in invalid]
    assert all(b.error.startswith(error) for b, (_, _, error) in zip(bad, invalid)), bad


def test_without_tools_or_a_cut_text_is_left_as_written() -> None:
    assert split_tool_calls("Three < four <", [], finish_reason="length") == ("Three < four <", [], [])
    assert split_tool_calls("Three < four <", ["add"], finish_reason="stop") == ("Three < four <", [], [])
    assert visible_text("Sure. <tool_call>{") == "Sure. " and visible_text("Sure. <tool") == "Sure. "
    assert visible_text("Three < four") == "Three < four"


# ---- every front end, on a scripted reply --------------------------------------------------------


class Script:
    """The engine's sampler, spelling `REPLY`'s tokens whatever the logits (one request at a time)."""

    def __init__(self, tokenizer: Any) -> None:
        self.ids: list[int] = tokenizer.encode(REPLY, add_special_tokens=False)
        self.tokenizer = tokenizer
        self._next: Iterator[int] = iter(())

    def restart(self) -> Script:
        self._next = iter(self.ids)
        return self

    def __call__(self, logits: torch.Tensor, **_: Any) -> torch.Tensor:
        return torch.tensor([next(self._next) for _ in range(logits.shape[0])])

    def text_of(self, count: int) -> str:
        return self.tokenizer.decode(self.ids[:count])

    def cuts(self) -> list[int]:
        """Token counts that end the reply inside its first opening tag, the name, the arguments,
        the closing tag and the second opening tag."""
        first = REPLY.index("</tool_call>")
        places = [5, REPLY.index('"add"') + 2, REPLY.index('"b"'), first + 4, first + len("</tool_call>\n<tool")]
        return [next(n for n in range(1, len(self.ids)) if len(self.text_of(n)) > place) for place in places]


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name=MODEL, coalesce_ms=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with serving(build_app(engine, ServerConfig(), model_name=MODEL)) as base:
        yield base
    clear_shared_engines()  # the integrations' shared RemoteEngine for this server


@pytest.fixture
def script(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> Script:
    scripted = Script(tokenizer)
    monkeypatch.setattr(sample_module, "sample", scripted)
    return scripted


def test_the_server_sends_a_cut_call_as_openai_does(url: str, script: Script) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    settings: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "3 + 4?"}], tools=[ADD],
                                    tool_choice="required", parallel_tool_calls=True, max_tokens=len(script.ids))
    script.restart()
    choice = client.chat.completions.create(**settings).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None  # no markup, no duplicate call
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert calls == [("add", json.dumps({"a": 3, "b": 4})), ("add", CUT_ARGUMENTS)]  # cut: what was written
    script.restart()
    chunks = [c.choices[0] for c in client.chat.completions.create(**settings, stream=True) if c.choices]
    assert all(no_markup(c.delta.content) for c in chunks)
    assert [(t.function.name, t.function.arguments) for c in chunks for t in c.delta.tool_calls or []] == calls
    for count in script.cuts():  # "auto": a forced call's budget below its markup is refused (test_tool_budget)
        script.restart()
        message = client.chat.completions.create(**{**settings, "max_tokens": count, "tool_choice": "auto"}
                                                 ).choices[0].message
        assert no_markup(message.content), (script.text_of(count), message.content)
        assert all(c.function.name == "add" for c in message.tool_calls or [])


@pytest.mark.parametrize("where", ["engine", "base_url"])
def test_langchain_reports_the_cut_call_with_its_arguments_text(
    engine: Engine, url: str, script: Script, where: str
) -> None:
    from kev_integrations.langchain import ChatKev

    source: dict[str, Any] = {"engine": engine} if where == "engine" else {"base_url": url}
    llm = ChatKev(**source, max_tokens=len(script.ids)).bind_tools([add], tool_choice="any", parallel_tool_calls=True)
    script.restart()
    message = llm.invoke("3 + 4?")
    assert message.content == ""
    assert [c["args"] for c in message.tool_calls] == [{"a": 3, "b": 4}]
    (bad,) = message.invalid_tool_calls
    assert (bad["name"], bad["args"], bad["error"]) == ("add", CUT_ARGUMENTS, CUT_BY_MAX_TOKENS)
    script.restart()
    merged = None
    for chunk in llm.stream("3 + 4?"):
        assert no_markup(chunk.content)
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and [c["args"] for c in merged.tool_calls] == [{"a": 3, "b": 4}]
    (streamed,) = merged.invalid_tool_calls  # a chunk's args keep the error first: see tool_call_chunks
    assert streamed["args"] == f"[{CUT_BY_MAX_TOKENS}] {CUT_ARGUMENTS}"


def test_llamaindex_reports_the_cut_call_with_its_arguments_text(engine: Engine, script: Script) -> None:
    from llama_index.core.tools import FunctionTool

    from kev_integrations.llamaindex import Kev
    from kev_integrations.llamaindex.messages import ReplyParseError

    llm = Kev(engine=engine, max_tokens=len(script.ids))
    tools = [FunctionTool.from_defaults(add)]
    script.restart()
    reply = llm.chat_with_tools(tools, user_msg="3 + 4?", tool_required=True, allow_parallel_tool_calls=True)
    assert reply.message.content == ""
    assert [c["arguments"] for c in reply.message.additional_kwargs["tool_calls"]] == [{"a": 3, "b": 4}]
    assert reply.message.additional_kwargs["invalid_tool_calls"] == [
        {"name": "add", "arguments": CUT_ARGUMENTS, "error": CUT_BY_MAX_TOKENS}]
    with pytest.raises(ReplyParseError, match=r"tool call 'add' with arguments '\{\"a\": 3,' does not parse"):
        llm.get_tool_calls_from_response(reply)
    selections = llm.get_tool_calls_from_response(reply, error_on_no_tool_call=False)  # an agent's way
    assert [s.tool_name for s in selections] == ["add", f"add (not run: {CUT_BY_MAX_TOKENS})"]
    script.restart()
    chunks = list(llm.stream_chat_with_tools(tools, user_msg="3 + 4?", tool_required=True,
                                             allow_parallel_tool_calls=True))
    assert all(no_markup(c.message.content) and no_markup(c.delta) for c in chunks)
    assert chunks[-1].message.additional_kwargs["invalid_tool_calls"][0]["arguments"] == CUT_ARGUMENTS
