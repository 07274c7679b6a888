"""ChatKev / KevLLM over a scripted fake engine: assert exactly what reaches the engine.

The fake answers from a script (prompt → text, or text and finish reason) and applies no
setting itself, so what ChatKev sends (the `SamplingParams`, the prompt) and how it reads a
reply (tool calls, structured output, usage, caching) are checked without any model; `test_langchain_batch.py` and
`test_langchain_standard.py` run the real engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any
from unittest import mock

import pytest
from langchain_core.caches import InMemoryCache
from langchain_core.globals import set_llm_cache
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import ConfigurableField
from pydantic import BaseModel

from kev_engine import AdapterError, Completion, EngineLike, InvalidRequestError, SamplingParams
from kev_integrations.langchain import ChatKev, KevLLM
from kev_integrations.langchain.tools import parse_tool_calls

PLAIN_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
TOOLS_TEMPLATE = PLAIN_TEMPLATE + "{% if tools %}{{ tools | tojson }}{% endif %}"


Reply = str | tuple[str, str]
"""A scripted reply: its text (finish_reason "stop"), or (text, finish_reason)."""


class FakeEngine:
    """An `EngineLike` that loads nothing: records every call, answers with `script(prompt, sampling, adapter)`.

    It applies none of the settings (stop strings, max_tokens): the tests assert on the
    `SamplingParams` it received, and a script says what the engine would have answered.
    Like the real engine, everything submitted inside `hold()` shares one pass: each submit
    records the number of the pass it would join (`pack`)."""

    def __init__(self, script: Callable[..., Reply] | None = None, template: str = PLAIN_TEMPLATE) -> None:
        self.script = script or (lambda prompt, sampling, adapter: f"answer[{adapter}]")
        self.tokenizer = mock.Mock(chat_template=template)
        self.name = "fake-model"
        self.max_context = 2048
        self.loaded: dict[str, str] = {}
        self.load_calls = 0
        self.generate_calls: list[dict[str, Any]] = []
        self.submit_calls: list[dict[str, Any]] = []
        self.holds = 0
        self.packs = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if self.holds == 0:
            self.packs += 1
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1

    def pack_sizes(self) -> list[int]:
        """How many submitted requests each pass would hold."""
        sizes: dict[int, int] = {}
        for call in self.submit_calls:
            sizes[call["pack"]] = sizes.get(call["pack"], 0) + 1
        return list(sizes.values())

    def _complete(self, prompt: Any, sampling: SamplingParams, adapter: str | None) -> Completion:
        reply = self.script(prompt, sampling, adapter)
        text, finish = (reply, "stop") if isinstance(reply, str) else reply
        return Completion(text, [1] * len(text.split()), finish, 7, len(text.split()), adapter)  # type: ignore[arg-type]

    def encode(self, prompt: Any) -> list[int]:
        return [1] * 7

    def expect_follow_up(self, future: Future[Any]) -> Any:
        return mock.Mock()  # its end() is a no-op, as a remote engine's

    def generate(self, prompts: Sequence[Any], sampling: Any = None, return_exceptions: bool = False,
                 adapters: Any = None) -> list[Any]:
        self.generate_calls.append({"prompts": list(prompts), "sampling": sampling, "adapters": adapters})
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        names = adapters if isinstance(adapters, list) else [adapters] * len(prompts)
        return [self._complete(p, s, a) for p, s, a in zip(prompts, samplings, names)]

    def submit(self, prompt: Any, sampling: SamplingParams | None = None, adapter: str | None = None,
               on_text: Callable[[str], None] | None = None, follow_up: bool = False) -> Future[Completion]:
        if self.holds == 0:
            self.packs += 1  # not held: a pass of its own
        self.submit_calls.append({"prompt": prompt, "sampling": sampling, "adapter": adapter, "pack": self.packs})
        completion = self._complete(prompt, sampling or SamplingParams(), adapter)
        if on_text is not None:
            for word in completion.text.split(" "):
                on_text(word + " ")
        future: Future[Completion] = Future()
        future.set_result(completion)
        return future

    @property
    def adapters(self) -> list[str]:
        return list(self.loaded)

    def load_adapter(self, name: str, path: str) -> None:  # the real engine's rule, without the files
        self.load_calls += 1
        if name in self.loaded and self.loaded[name] != path:
            raise AdapterError(f"adapter {name!r} is already loaded from {self.loaded[name]!r}")
        self.loaded[name] = path

    def close(self) -> None:
        pass


def test_the_fake_is_engine_like() -> None:
    assert isinstance(FakeEngine(), EngineLike)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


# ---- construction and settings ------------------------------------------------------------

def test_construction_and_copies_load_nothing() -> None:
    with mock.patch("kev_integrations.shared.shared_engine") as shared:
        shared.return_value = FakeEngine()
        llm = ChatKev(model="some/model", device="cpu", adapters={"sql": "/x"}, temperature=0.3)
        llm.bind(adapter="sql").with_config(tags=["t"])
        llm.configurable_fields(adapter=ConfigurableField(id="adapter"))
        KevLLM(max_tokens=3).model_copy()
        assert shared.call_count == 0
        llm.invoke("hi")
        shared.assert_called_once_with("some/model", "cpu", None, {"sql": "/x"})


def test_passed_engine_gets_the_adapters(engine: FakeEngine) -> None:
    ChatKev(engine=engine, adapters={"a": "/path/a"}).invoke("hi")
    assert engine.loaded == {"a": "/path/a"}


def test_chat_invoke_sends_messages_and_merged_settings(engine: FakeEngine) -> None:
    llm = ChatKev(engine=engine, temperature=0.5, max_tokens=20, seed=1, adapter="a")
    llm.bind(top_k=5, adapter="b").invoke([SystemMessage("be brief"), HumanMessage("hi")], top_p=0.9, stop=["x"])
    (call,) = engine.submit_calls
    assert call["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert call["sampling"] == SamplingParams(temperature=0.5, top_p=0.9, top_k=5, max_tokens=20, stop=("x",), seed=1)
    assert call["adapter"] == "b"  # the call beats the constructor


def test_unknown_setting_is_an_error(engine: FakeEngine) -> None:
    with pytest.raises(TypeError, match="unknown Kev setting"):
        ChatKev(engine=engine).invoke("hi", temprature=0.1)
    with pytest.raises(TypeError, match=r"'max_new_tokens'\] \(max_new_tokens: use max_tokens= instead\)"):
        ChatKev(engine=engine).invoke("hi", max_new_tokens=4)  # per call, the hint construction gives
    with pytest.raises(InvalidRequestError, match="top_p"):
        KevLLM(engine=engine).invoke("hi", top_p=2.0)


def test_llm_generate_is_one_pass(engine: FakeEngine) -> None:
    result = KevLLM(engine=engine, max_tokens=9, adapter="a").generate(["p1", "p2", "p3"], stop=["\n"])
    assert engine.pack_sizes() == [3]
    assert [c["prompt"] for c in engine.submit_calls] == [[{"role": "user", "content": p}] for p in ("p1", "p2", "p3")]
    assert {c["sampling"] for c in engine.submit_calls} == {SamplingParams(max_tokens=9, stop=("\n",))}
    assert {c["adapter"] for c in engine.submit_calls} == {"a"}
    assert result.llm_output == {
        "token_usage": {"prompt_tokens": 21, "completion_tokens": 3, "total_tokens": 24}, "model_name": "fake-model"
    }
    assert result.generations[0][0].generation_info["finish_reason"] == "stop"


def test_chat_batch_is_one_pass_and_max_concurrency_splits(engine: FakeEngine) -> None:
    llm = ChatKev(engine=engine, temperature=0.0)
    answers = llm.batch(["a", "b", "c", "d", "e"], adapter="x")
    assert engine.pack_sizes() == [5]
    assert sorted(c["prompt"][0]["content"] for c in engine.submit_calls) == ["a", "b", "c", "d", "e"]
    assert [a.content for a in answers] == ["answer[x]"] * 5
    engine.submit_calls.clear()
    llm.batch(["a", "b", "c", "d", "e"], config={"max_concurrency": 2})
    assert engine.pack_sizes() == [2, 2, 1]


def test_configurable_fields_batch_mixes_settings_in_one_call(engine: FakeEngine) -> None:
    llm = ChatKev(engine=engine, max_tokens=5).configurable_fields(
        adapter=ConfigurableField(id="adapter"), temperature=ConfigurableField(id="temperature")
    )
    configs = [{"configurable": {"adapter": "a", "temperature": 0.7}}, {"configurable": {"adapter": "b"}}, {}]
    answers = llm.batch(["q1", "q2", "q3"], config=configs)
    assert engine.pack_sizes() == [3]
    sent = sorted((c["prompt"][0]["content"], c["adapter"], c["sampling"].temperature) for c in engine.submit_calls)
    assert sent == [("q1", "a", 0.7), ("q2", "b", None), ("q3", None, None)]
    assert [a.content for a in answers] == ["answer[a]", "answer[b]", "answer[None]"]
    assert asyncio.run(llm.abatch(["q1", "q2", "q3"], config=configs))[1].content == "answer[b]"
    assert engine.pack_sizes() == [3, 3]


def test_batch_return_exceptions_keeps_good_answers(engine: FakeEngine) -> None:
    answers = ChatKev(engine=engine).batch(["ok", [HumanMessage([{"type": "image", "url": "x"}])]],
                                           return_exceptions=True)
    assert answers[0].content == "answer[None]"
    assert isinstance(answers[1], ValueError)


# ---- output, streaming, async -------------------------------------------------------------

def test_usage_and_metadata(engine: FakeEngine) -> None:
    message = ChatKev(engine=engine, adapter="a").invoke("hi")
    assert message.usage_metadata == {"input_tokens": 7, "output_tokens": 1, "total_tokens": 8}
    assert message.response_metadata["model_name"] == "fake-model"
    assert message.response_metadata["finish_reason"] == "stop"
    assert message.response_metadata["adapter"] == "a"
    ls = ChatKev(engine=engine, temperature=0.2, max_tokens=4, stop=["s"])._get_ls_params()
    assert ls == {"ls_provider": "kev", "ls_model_name": "fake-model", "ls_model_type": "chat",
                  "ls_temperature": 0.2, "ls_max_tokens": 4, "ls_stop": ["s"]}
    assert KevLLM(engine=engine)._get_ls_params()["ls_provider"] == "kev"


def test_stop_strings_and_max_tokens_reach_the_engine_and_its_finish_reason_comes_back() -> None:
    engine = FakeEngine(lambda p, s, a: ("one two", "length") if s.max_tokens == 2 else "one two three ")
    assert ChatKev(engine=engine).invoke("hi", stop=["END"]).content == "one two three "
    assert engine.submit_calls[-1]["sampling"].stop == ("END",)
    message = ChatKev(engine=engine, max_tokens=2).invoke("hi")
    assert (message.content, message.response_metadata["finish_reason"]) == ("one two", "length")
    assert KevLLM(engine=engine, stop=["\n\n"]).invoke("hi", max_tokens=2) == "one two"
    assert engine.submit_calls[-1]["sampling"] == SamplingParams(max_tokens=2, stop=("\n\n",))


def test_stream_pieces_then_last_chunk_with_usage() -> None:
    engine = FakeEngine(lambda p, s, a: "a b c")
    chunks = list(ChatKev(engine=engine).stream("hi"))
    assert [c.content for c in chunks] == ["a ", "b ", "c ", ""]
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] == 3
    assert list(KevLLM(engine=engine).stream("hi")) == ["a ", "b ", "c ", ""]

    async def collect() -> list[Any]:
        return [c async for c in ChatKev(engine=engine).astream("hi")]

    assert [c.content for c in asyncio.run(collect())] == ["a ", "b ", "c ", ""]


def test_async_invoke_awaits_the_engine_future(engine: FakeEngine) -> None:
    assert asyncio.run(ChatKev(engine=engine).ainvoke("hi", adapter="z")).content == "answer[z]"
    assert asyncio.run(KevLLM(engine=engine).ainvoke("hi")) == "answer[None]"
    assert len(engine.submit_calls) == 2


def test_timeout_cancels_the_request(engine: FakeEngine) -> None:
    pending: Future[Completion] = Future()
    engine.submit = lambda *a, **k: pending  # type: ignore[method-assign]
    with pytest.raises(TimeoutError):
        ChatKev(engine=engine, timeout=0.01).invoke("hi")
    assert pending.cancelled()


# ---- the LLM cache --------------------------------------------------------------------------

@pytest.mark.parametrize("model_class", [KevLLM, ChatKev])
def test_cache_keeps_adapters_and_temperatures_apart(model_class: type, engine: FakeEngine) -> None:
    engine.script = lambda p, s, a: f"{a}-{s.temperature}"
    set_llm_cache(InMemoryCache())
    try:
        llm = model_class(engine=engine)
        def text(out: Any) -> str:
            return out if isinstance(out, str) else out.content

        assert text(llm.bind(adapter="a").invoke("q")) == "a-None"
        assert text(llm.bind(adapter="b").invoke("q")) == "b-None"
        assert text(llm.invoke("q", adapter="a", temperature=0.5)) == "a-0.5"
        assert text(model_class(engine=engine, adapter="b").invoke("q")) == "b-None"  # cached now
        calls = len(engine.generate_calls) + len(engine.submit_calls)
        assert calls == 3
    finally:
        set_llm_cache(None)


# ---- tools and structured output --------------------------------------------------------------

def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


def test_tools_described_in_system_prompt_when_template_ignores_them() -> None:
    reply = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    engine = FakeEngine(lambda p, s, a: reply)
    message = ChatKev(engine=engine).bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
    prompt = engine.submit_calls[0]["prompt"]
    assert prompt[0]["role"] == "system" and '"name": "get_weather"' in prompt[0]["content"]
    assert "<tool_call>" in prompt[0]["content"] and "You must call one of the functions." in prompt[0]["content"]
    assert message.tool_calls[0]["name"] == "get_weather" and message.tool_calls[0]["args"] == {"city": "Paris"}
    assert message.tool_calls[0]["id"] and message.content == ""


def test_tools_go_to_a_template_that_supports_them() -> None:
    engine = FakeEngine(lambda p, s, a: '{"name": "get_weather", "arguments": {"city": "Rome"}}', TOOLS_TEMPLATE)
    message = ChatKev(engine=engine).bind_tools([get_weather]).invoke("Weather in Rome?")
    prompt = engine.submit_calls[0]["prompt"]
    assert prompt["tools"][0]["function"]["name"] == "get_weather"
    assert prompt["messages"] == [{"role": "user", "content": "Weather in Rome?"}]
    assert message.tool_calls[0]["args"] == {"city": "Rome"}  # bare JSON naming a bound tool


def test_tool_history_is_written_for_the_template() -> None:
    history = [
        HumanMessage("Weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}]),
        ToolMessage("sunny", tool_call_id="c1", name="get_weather"),
    ]
    plain, native = FakeEngine(), FakeEngine(template=TOOLS_TEMPLATE)
    ChatKev(engine=plain).bind_tools([get_weather]).invoke(history)
    ChatKev(engine=native).bind_tools([get_weather]).invoke(history)
    written = plain.submit_calls[0]["prompt"]
    assert written[2] == {"role": "assistant",
                          "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'}
    assert written[3]["role"] == "user" and "<tool_response>" in written[3]["content"]
    native_messages = native.submit_calls[0]["prompt"]["messages"]
    assert native_messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert native_messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_tool_results_go_in_a_tool_turn_when_the_template_writes_any_role(tokenizer: Any) -> None:
    engine = FakeEngine()
    engine.tokenizer = tokenizer  # the embedded SmolLM2 one: ``<|im_start|>{{ role }}``, no tools
    history = [
        HumanMessage("Weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}]),
        ToolMessage("sunny", tool_call_id="c1", name="get_weather"),
    ]
    ChatKev(engine=engine).bind_tools([get_weather]).invoke(history)
    assert engine.submit_calls[0]["prompt"][3] == {"role": "tool", "content": "sunny"}


def test_parse_tool_calls_edge_cases() -> None:
    text, calls, invalid = parse_tool_calls('Sure. <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
                                            '<tool_call>{not json}</tool_call>')
    assert text == "Sure." and calls[0]["args"] == {"x": 1} and len(invalid) == 1
    assert parse_tool_calls("plain answer", ["f"]) == ("plain answer", [], [])
    assert parse_tool_calls('{"name": "other", "arguments": {}}', ["f"])[1] == []  # not a bound tool
    whole = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_'  # cut inside the closing tag only
    assert parse_tool_calls(whole, ["f"], "length")[1][0]["args"] == {"x": 1}
    assert parse_tool_calls(whole, ["f"], "stop")[2][0]["error"].startswith("JSONDecodeError")


class Answer(BaseModel):
    """An answer with a confidence."""

    answer: str
    confidence: float


def test_structured_output_by_tool_call_and_by_json() -> None:
    engine = FakeEngine(lambda p, s, a: '<tool_call>{"name": "Answer", "arguments": {"answer": "4", "confidence": 0.9}}'
                                        '</tool_call>' if isinstance(p, list) and "<tools>" in p[0]["content"]
                        else '{"answer": "4", "confidence": 0.5}')
    llm = ChatKev(engine=engine)
    assert llm.with_structured_output(Answer).invoke("2+2?") == Answer(answer="4", confidence=0.5)  # json_schema
    sampling = engine.submit_calls[-1]["sampling"]
    assert sampling.constraint[0] == "json_schema" and '"confidence"' in sampling.json_schema
    assert "keys: \"answer\" (string)" in engine.submit_calls[-1]["prompt"][0]["content"]
    assert llm.with_structured_output(Answer, method="function_calling").invoke("2+2?") == Answer(answer="4",
                                                                                                confidence=0.9)
    assert '"format":{"type":"tag"' in engine.submit_calls[-1]["sampling"].structural_tag  # exactly that call
    raw = llm.with_structured_output(Answer, method="json_mode", include_raw=True).invoke("2+2?")
    assert raw["parsed"] == Answer(answer="4", confidence=0.5) and raw["parsing_error"] is None
    assert engine.submit_calls[-1]["sampling"].json_object is True
    with pytest.raises(ValueError, match="tool_choice"):
        llm.bind_tools([get_weather], tool_choice="nope")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.parametrize(("tool_choice", "format_type", "call_names"), [
    (None, "triggered_tags", ["get_weather", "add"]),           # "auto": text or calls
    ("auto", "triggered_tags", ["get_weather", "add"]),
    ("any", "tags_with_separator", ["get_weather", "add"]),     # one call or more, no text
    ("required", "tags_with_separator", ["get_weather", "add"]),
    (True, "tags_with_separator", ["get_weather", "add"]),
    ("add", "tag", ["add"]),                                     # exactly that call
    ({"type": "function", "function": {"name": "add"}}, "tag", ["add"]),
])
def test_bound_tools_constrain_the_reply(tool_choice: Any, format_type: str, call_names: list[str]) -> None:
    import json

    engine = FakeEngine()
    ChatKev(engine=engine).bind_tools([get_weather, add], tool_choice=tool_choice).invoke("3 + 4?")
    tag = json.loads(engine.submit_calls[0]["sampling"].structural_tag)["format"]
    assert tag["type"] == format_type
    tags = tag.get("tags", [tag])
    assert [json.loads(t["begin"].removeprefix("<tool_call>") + "0}")["name"] for t in tags] == call_names
    if format_type != "tag":
        assert tag["stop_after_first"] is True  # one call per reply unless parallel_tool_calls=True


def test_tool_choice_none_hides_the_tools_and_forbids_calls() -> None:
    engine = FakeEngine(lambda p, s, a: "<tool_call> is just text here")
    message = ChatKev(engine=engine).bind_tools([get_weather], tool_choice="none").invoke("Hi")
    call = engine.submit_calls[0]
    assert "<tools>" not in str(call["prompt"]) and "excludes" in call["sampling"].structural_tag
    assert message.tool_calls == [] and message.content == "<tool_call> is just text here"


def test_parallel_calls_and_newline_layout_of_tool_templates() -> None:
    engine = FakeEngine(template=TOOLS_TEMPLATE + "{{ '<tool_call>\\n' }}")
    ChatKev(engine=engine).bind_tools([get_weather], tool_choice="any", parallel_tool_calls=True).invoke("Hi")
    tag = engine.submit_calls[0]["sampling"].structural_tag
    assert '"stop_after_first":false' in tag and '<tool_call>\\n{' in tag


def test_a_second_constraint_is_an_error_naming_both() -> None:
    llm = ChatKev(engine=FakeEngine(), regex="[a-z]+")
    with pytest.raises(InvalidRequestError, match="bind_tools.*regex"):
        llm.bind_tools([get_weather]).invoke("Hi")
    with pytest.raises(InvalidRequestError, match="response_format.*regex"):
        llm.with_structured_output(Answer).invoke("Hi")


@pytest.mark.parametrize(("response_format", "field"), [
    ({"type": "json_object"}, "json_object"),
    ({"type": "json_schema", "json_schema": {"name": "Answer", "schema": Answer.model_json_schema()}}, "json_schema"),
    (Answer, "json_schema"),
    (Answer.model_json_schema(), "json_schema"),
    ({"type": "text"}, None),
])
def test_response_format_forms(response_format: Any, field: str | None) -> None:
    engine = FakeEngine(lambda p, s, a: "{}")
    ChatKev(engine=engine).bind(response_format=response_format).invoke("Hi")
    constraint = engine.submit_calls[0]["sampling"].constraint
    assert (constraint[0] if constraint else None) == field


def test_constraint_settings_per_call_and_on_kevllm() -> None:
    engine = FakeEngine(lambda p, s, a: "yes")
    assert ChatKev(engine=engine).bind(choice=["yes", "no"]).invoke("Ok?").content == "yes"
    assert engine.submit_calls[-1]["sampling"].choice == ("yes", "no")
    assert KevLLM(engine=engine).invoke("Ok?", regex="yes|no") == "yes"
    assert engine.submit_calls[-1]["sampling"].regex == "yes|no"


def test_repeated_calls_collapse_and_a_cut_call_is_invalid() -> None:
    call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    engine = FakeEngine(lambda p, s, a: call + "\n" + call + "\n" + '<tool_call>{"name": "add", "arguments": {"a": 3,')
    llm = ChatKev(engine=engine, max_tokens=100).bind_tools([add], tool_choice="any", parallel_tool_calls=True)
    message = llm.invoke("3 + 4?")
    assert message.response_metadata["finish_reason"] == "stop"
    assert [c["args"] for c in message.tool_calls] == [{"a": 3, "b": 4}]  # the repeat collapsed
    assert "cut by" not in message.invalid_tool_calls[0]["error"]  # an open call at "stop" is a parse error
    engine.script = lambda p, s, a: (call + " " + '<tool_call>{"name": "add", "arguments": {"a": 3,', "length")
    # the script ends the reply; the budget need only hold the forced call's markup (tool_budget)
    cut = ChatKev(engine=engine, max_tokens=100).bind_tools([add], tool_choice="any", parallel_tool_calls=True)
    for message in (cut.invoke("3 + 4?"), _merged(cut.stream("3 + 4?"))):
        assert message.response_metadata["finish_reason"] == "length"
        assert [c["args"] for c in message.tool_calls] == [{"a": 3, "b": 4}]
        (bad,) = message.invalid_tool_calls
        assert bad["name"] == "add" and "cut by max_tokens" in (bad["error"] or bad["args"])


def _merged(chunks: Iterator[Any]) -> Any:
    full = None
    for chunk in chunks:
        full = chunk if full is None else full + chunk
    return full


def test_structured_output_errors_are_real() -> None:
    from langchain_core.exceptions import OutputParserException

    engine = FakeEngine(lambda p, s, a: ('{"answer": "4", "confid', "length"))
    cut = ChatKev(engine=engine, max_tokens=5).with_structured_output(Answer, include_raw=True).invoke("2+2?")
    assert cut["parsed"] is None and "cut by max_tokens" in str(cut["parsing_error"])
    assert cut["raw"].response_metadata["finish_reason"] == "length"
    with pytest.raises(OutputParserException, match="cut by max_tokens"):
        ChatKev(engine=engine, max_tokens=5).with_structured_output(Answer).invoke("2+2?")
    engine.script = lambda p, s, a: '{"answer": "4", "confidence": "high"}'
    bad = ChatKev(engine=engine).with_structured_output(Answer, include_raw=True).invoke("2+2?")
    assert bad["parsed"] is None and "confidence" in str(bad["parsing_error"])
    engine.script = lambda p, s, a: "no call at all"
    with pytest.raises(OutputParserException, match="no valid tool call"):
        ChatKev(engine=engine).with_structured_output(Answer, method="function_calling").invoke("2+2?")
    with pytest.raises(ValueError, match="method="):
        ChatKev(engine=engine).with_structured_output(Answer, method="xml")  # type: ignore[arg-type]
