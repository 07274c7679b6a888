"""Stock OpenAI clients against `kev serve` on the embedded model: LangChain's `ChatOpenAI`
(its `batch()` coalesces into one pack on the server), LlamaIndex's `OpenAILike`, and tool
calls through the OpenAI `tools` field."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import openai
import pytest
from server_util import serving, wait_for

from kev_engine import Engine, SamplingParams
from kev_integrations.server import ServerConfig, build_app

KEY = "k"
MODEL = "smollm2"
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]


@pytest.fixture(scope="module")
def url(embedded_engine: Engine) -> Iterator[str]:
    with serving(build_app(embedded_engine, ServerConfig(api_keys=(KEY,)), model_name=MODEL)) as base:
        yield base


def test_chat_openai_batch_is_one_pack_on_the_server(url: str, embedded_engine: Engine) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url + "/v1", api_key=KEY, model=MODEL, max_tokens=12, temperature=0, max_retries=0)
    before = embedded_engine.stats()["prefill_passes"]
    replies: list = []
    with embedded_engine.hold():  # the batch's concurrent requests all arrive before a pass starts
        worker = threading.Thread(target=lambda: replies.extend(llm.batch(QUESTIONS)))
        worker.start()
        wait_for(lambda: embedded_engine.stats()["waiting"] == len(QUESTIONS), 60, "the batch to arrive")
    worker.join(120)
    assert embedded_engine.stats()["prefill_passes"] == before + 1
    direct = embedded_engine.generate([[{"role": "user", "content": q}] for q in QUESTIONS],
                                      SamplingParams(max_tokens=12, temperature=0))
    assert [r.content for r in replies] == [d.text for d in direct]
    assert replies[0].usage_metadata["output_tokens"] == direct[0].completion_tokens


def test_llamaindex_openai_like(url: str, embedded_engine: Engine) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=MODEL, api_base=url + "/v1", api_key=KEY, is_chat_model=True, max_tokens=12,
                     temperature=0, max_retries=0, context_window=8192)
    reply = llm.chat([ChatMessage(role="user", content=QUESTIONS[0])])
    direct = embedded_engine.generate([[{"role": "user", "content": QUESTIONS[0]}]], SamplingParams(max_tokens=12))
    assert reply.message.content == direct[0].text
    streamed = "".join(r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", content=QUESTIONS[0])]))
    assert streamed == direct[0].text


def test_tool_calls_through_the_tools_field(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "add", "description": "Add two numbers",
         "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                        "required": ["a", "b"]}}},
    ]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=64,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    # the call's result goes back in the history, and the next turn may answer in text
    history = [*messages, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    after = client.chat.completions.create(model=MODEL, messages=history, tools=tools, tool_choice="none",
                                           max_tokens=24)
    assert after.choices[0].message.tool_calls is None and after.choices[0].message.content
    required = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                              max_tokens=64, parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "add")
    json.loads(calls[0].function.arguments)
    # OpenAI's tool loop with the server's defaults: one call a turn (parallel_tool_calls is opt-in, as
    # in ChatKev: a small model repeats its call until max_tokens), and the history it sends back is taken
    looped = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                            max_tokens=64)
    reply = looped.choices[0].message
    assert looped.choices[0].finish_reason == "tool_calls" and len(reply.tool_calls) == 1
    history = [*messages, reply.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "Sunny, 24 C"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=24)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_the_openai_tool_loop_runs_five_turns_and_takes_back_its_own_cut_call(url: str) -> None:
    """Five turns of OpenAI's tool loop, one of them cut by max_tokens inside its call: the reply
    carries the cut call as OpenAI does (its arguments the text written, finish_reason "length"),
    and the history holding it is accepted on the next turn — never a 4xx for the server's own output."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    # a city whose call outgrows its markup: "Paris" fits whole in the smallest budget allowed (22)
    messages: list[dict] = [{"role": "user", "content": "What's the weather like in Buenos Aires today?"}]
    cut = None
    for turn in range(5):
        budget = 24 if turn == 1 else 48  # turn 1 is cut inside its arguments (its markup alone takes 22)
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=budget,
                                               tool_choice="required" if turn < 3 else "auto")
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls or []:
            if turn == 1:
                cut = (choice.finish_reason, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"})
        if not choice.message.tool_calls:
            messages.append({"role": "user", "content": "And tomorrow?"})
    assert cut is not None and cut[0] == "length"
    with pytest.raises(ValueError):
        json.loads(cut[1])  # the control: this turn's call really was cut


def test_chat_openai_bind_tools_loop_sends_back_a_cut_call(url: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url + "/v1", api_key=KEY, model=MODEL, temperature=0, max_retries=0)
    messages: list = [HumanMessage("What's the weather like in Buenos Aires today?")]  # a call longer than 24 tokens
    cut = llm.bind_tools([WEATHER], tool_choice="any").bind(max_tokens=24).invoke(messages)
    assert cut.invalid_tool_calls and not cut.tool_calls  # langchain-openai could not parse the cut call
    messages += [cut, ToolMessage("error: the call was cut; call again", tool_call_id=cut.invalid_tool_calls[0]["id"])]
    again = llm.bind_tools([WEATHER], tool_choice="any").bind(max_tokens=48).invoke(messages)
    assert again.tool_calls and again.tool_calls[0]["name"] == "get_weather"


def test_chat_openai_structured_output_with_a_small_budget_raises_never_none(url: str) -> None:
    """Issue 57, item 8: ChatOpenAI's function-calling structured output on 16-26 tokens. Below
    the call's markup (21 tokens) the request is refused up front; above it, a call cut inside its
    arguments is a 400 too (langchain-openai returned None for it); 48 tokens hold the call."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Person(BaseModel):
        """A person mentioned in the text."""

        name: str
        age: int

    def structured(max_tokens: int):
        llm = ChatOpenAI(base_url=url + "/v1", api_key=KEY, model=MODEL, temperature=0, max_retries=0,
                         max_tokens=max_tokens)
        return llm.with_structured_output(Person, method="function_calling")

    with pytest.raises(openai.BadRequestError, match=r"max_tokens=16 is too small .* use max_tokens >= 2\d"):
        structured(16).invoke("Alice is 30 years old.")
    with pytest.raises(openai.BadRequestError, match="max_tokens=24 cut the call of 'Person'"):
        structured(24).invoke("Alice is 30 years old.")
    assert structured(48).invoke("Alice is 30 years old.") == Person(name="Alice", age=30)
