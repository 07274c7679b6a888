"""One chat format: the same conversation gives the same prompt ids, and the same greedy answer,
through `ChatKev`, LlamaIndex `Kev`, `kev serve` (the `openai` client) and `Engine` — and the
format's own rules on templates that render tools, write any role, or refuse a tool turn."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from server_util import serving

from kev_engine import Engine, SamplingParams
from kev_integrations.chat_format import ToolCall, Turn, build_prompt, role_of
from kev_integrations.langchain import ChatKev
from kev_integrations.llamaindex import Kev
from kev_integrations.server import ServerConfig, build_app

KEY = "format-key"
MAX_TOKENS = 24
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}

# the conversations, in OpenAI's shape (what the server gets); each front end's own below
TUTOR = [
    {"role": "system", "content": "You are a terse geography tutor."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And the capital of Italy?"},
]
TOOL_HISTORY = [
    {"role": "system", "content": "Answer from the tools' results."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def langchain_messages(conversation: list[dict[str, Any]]) -> list[Any]:
    out: list[Any] = []
    for m in conversation:
        if m["role"] == "system":
            out.append(SystemMessage(m["content"]))
        elif m["role"] == "user":
            out.append(HumanMessage(m["content"]))
        elif m["role"] == "assistant":
            calls = [{"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"]), "id": c["id"]}
                     for c in m.get("tool_calls", ())]
            out.append(AIMessage(m["content"], tool_calls=calls))
        else:
            out.append(ToolMessage(m["content"], tool_call_id=m["tool_call_id"]))
    return out


def llamaindex_messages(conversation: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole(m["role"]), content=m["content"],
                        additional_kwargs={k: m[k] for k in ("tool_calls", "tool_call_id") if k in m})
            for m in conversation]


@pytest.fixture
def submitted(embedded_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The prompt ids of every request the embedded engine receives, by whichever public door."""
    seen: list[list[int]] = []
    submit, submit_many = embedded_engine.submit, embedded_engine.submit_many

    def one(prompt: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(embedded_engine.encode(prompt))
        return submit(prompt, *args, **kwargs)

    def many(prompts: Any, *args: Any, **kwargs: Any) -> Any:
        seen.extend(embedded_engine.encode(p) for p in prompts)
        return submit_many(prompts, *args, **kwargs)

    monkeypatch.setattr(embedded_engine, "submit", one)
    monkeypatch.setattr(embedded_engine, "submit_many", many)
    return seen


@pytest.fixture(scope="module")
def client(embedded_engine: Engine) -> Iterator[openai.OpenAI]:
    with serving(build_app(embedded_engine, ServerConfig(api_keys=(KEY,)), model_name="smol")) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def through_every_front_end(engine: Engine, client: openai.OpenAI, submitted: list[list[int]],
                            conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                            ) -> dict[str, tuple[list[int], str, list[tuple[str, dict[str, Any]]]]]:
    """{front end: (prompt ids, reply text, tool calls)} for one conversation, greedy; with `tools`,
    a call required (LangChain's "any", OpenAI's and LlamaIndex's "required") and one at most."""
    results = {}
    chat = ChatKev(engine=engine, temperature=0, max_tokens=MAX_TOKENS)
    bound = chat.bind_tools(tools, tool_choice="any", parallel_tool_calls=False) if tools else chat
    message = bound.invoke(langchain_messages(conversation))
    results["langchain"] = (submitted[-1], message.content, [(c["name"], c["args"]) for c in message.tool_calls])

    llm = Kev(engine=engine, temperature=0, max_tokens=MAX_TOKENS)
    extra = {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False} if tools else {}
    reply = llm.chat(llamaindex_messages(conversation), **extra).message
    calls = [(c["name"], c["arguments"]) for c in reply.additional_kwargs.get("tool_calls", ())]
    results["llamaindex"] = (submitted[-1], reply.content or "", calls)

    extra = {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False} if tools else {}
    answer = client.chat.completions.create(model="smol", messages=conversation, max_tokens=MAX_TOKENS,
                                            temperature=0, **extra).choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in answer.tool_calls or ()]
    results["server"] = (submitted[-1], answer.content or "", calls)
    return results


def test_a_multi_turn_conversation_is_one_prompt_and_one_answer_everywhere(
        embedded_engine: Engine, client: openai.OpenAI, submitted: list[list[int]]) -> None:
    results = through_every_front_end(embedded_engine, client, submitted, TUTOR, None)
    direct = embedded_engine.generate([TUTOR], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    results["engine"] = (submitted[-1], direct.text, [])
    assert len({json.dumps(r) for r in results.values()}) == 1, results
    assert direct.text.strip()


def test_a_tool_call_and_its_result_are_one_prompt_and_one_answer_everywhere(
        embedded_engine: Engine, client: openai.OpenAI, submitted: list[list[int]]) -> None:
    results = through_every_front_end(embedded_engine, client, submitted, TOOL_HISTORY, None)
    # what the format writes for a template without tools that writes any role (SmolLM2's)
    written = [*TOOL_HISTORY[:2], {"role": "assistant", "content": "<tool_call>" + json.dumps(CALL) + "</tool_call>"},
               {"role": "tool", "content": "sunny, 21 C"}]
    direct = embedded_engine.generate([written], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    results["engine"] = (submitted[-1], direct.text, [])
    assert len({json.dumps(r) for r in results.values()}) == 1, results


def test_with_tools_bound_the_prompt_and_the_call_are_the_same_everywhere(
        embedded_engine: Engine, client: openai.OpenAI, submitted: list[list[int]]) -> None:
    ask = TOOL_HISTORY[:2]
    results = through_every_front_end(embedded_engine, client, submitted, ask, [WEATHER])
    assert len({json.dumps(r) for r in results.values()}) == 1, results
    ids, _, calls = results["server"]
    assert calls == [("get_weather", {"city": "Paris"})]
    assert "get_weather" in embedded_engine.tokenizer.decode(ids)  # the tools are described


def test_the_comparison_sees_a_different_prompt(
        embedded_engine: Engine, client: openai.OpenAI, submitted: list[list[int]]) -> None:
    """Control: one changed word in one front end's copy shows in the ids."""
    changed = [*TUTOR[:-1], {"role": "user", "content": "And the capital of Spain?"}]
    ChatKev(engine=embedded_engine, temperature=0, max_tokens=2).invoke(langchain_messages(changed))
    Kev(engine=embedded_engine, temperature=0, max_tokens=2).chat(llamaindex_messages(TUTOR))
    assert submitted[-2] != submitted[-1]


# ---- the format's rules, per kind of template ----------------------------------------------------

TOOLS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                  "{% if tools %}<tools>{{ tools | length }}</tools>{% endif %}")
NO_TOOL_TURN = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}"
                "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
HISTORY = [Turn("system", "Be brief."), Turn("user", "Weather in Paris?"),
           Turn("assistant", "", (ToolCall("get_weather", {"city": "Paris"}, "c1"),)),
           Turn("tool", "sunny", tool_call_id="c1")]


def with_template(tokenizer: Any, template: str) -> Any:
    other = copy.copy(tokenizer)
    other.chat_template = template
    return other


def test_a_template_that_writes_any_role_gets_a_tool_turn_and_described_tools(tokenizer: Any) -> None:
    prompt = build_prompt(HISTORY, [WEATHER], "auto", tokenizer)
    assert prompt[0]["content"].startswith("Be brief.\n\n") and "get_weather" in prompt[0]["content"]
    assert prompt[2] == {"role": "assistant", "content": "<tool_call>" + json.dumps(CALL) + "</tool_call>"}
    assert prompt[3] == {"role": "tool", "content": "sunny"}


def test_a_template_without_a_tool_turn_gets_a_tool_response_naming_the_call(tokenizer: Any) -> None:
    prompt = build_prompt(HISTORY, None, None, with_template(tokenizer, NO_TOOL_TURN))
    assert prompt[0] == {"role": "system", "content": "Be brief."}  # no tools: nothing added
    assert prompt[3] == {"role": "user",
                         "content": '<tool_response>{"name": "get_weather", "content": "sunny"}</tool_response>'}


def test_a_template_that_renders_tools_gets_them_and_the_calls_natively(tokenizer: Any) -> None:
    prompt = build_prompt(HISTORY, [WEATHER], "get_weather", with_template(tokenizer, TOOLS_TEMPLATE))
    assert prompt["tools"] == [WEATHER]
    assert prompt["messages"][0]["content"] == "Be brief.\n\nYou must call the function get_weather."
    assert prompt["messages"][2]["tool_calls"][0] == {
        "type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert prompt["messages"][3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_tool_choice_none_shows_no_tools(tokenizer: Any) -> None:
    assert build_prompt(HISTORY[:2], [WEATHER], "none", tokenizer) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def test_roles_map_to_four_and_others_are_refused() -> None:
    assert [role_of(r) for r in ("developer", "human", "ai", "chatbot", "function", "user")] == [
        "system", "user", "assistant", "assistant", "tool", "user"]
    with pytest.raises(ValueError, match="role='alien' is not allowed; allowed roles: \\['system'"):
        role_of("alien")
    with pytest.raises(ValueError, match="Turn role='developer' is not allowed"):
        Turn("developer", "x")
