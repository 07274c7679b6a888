"""LlamaIndex `Kev` as a function-calling LLM and a structured-output LLM: tool calls and
structured replies are constrained per request, so they parse by construction and still share
packed passes. The tiny random model checks what holds whatever the model's quality; the
embedded SmolLM2-135M checks that agents really pick and run the right tool.

No `from __future__ import annotations`: FunctionTool reads the tools' annotations at runtime."""

import asyncio
import json
from typing import Literal

import pytest
from conftest import tiny_model
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock
from llama_index.core.output_parsers.base import OutputParserException
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field
from test_llamaindex import TIMEOUT, delta, one_pass_for

from kev_engine import ConstraintError, Engine
from kev_integrations.chat_format import ToolCall, Turn
from kev_integrations.llamaindex import Kev
from kev_integrations.llamaindex.messages import ReplyParseError, to_turns

PROMPT = PromptTemplate("{question}")


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return {"paris": "sunny, 21 C", "oslo": "snow, -3 C"}.get(city.lower(), "cloudy, 15 C")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def paint(color: Literal["red", "blue"]) -> str:
    """Paint the wall in a color."""
    return f"painted {color}"


def switch(on: bool) -> str:
    """Turn the light on or off."""
    return "on" if on else "off"


class Verdict(BaseModel):
    """Bounded fields: even a random model's reply ends within a few tokens."""

    label: Literal["yes", "no", "maybe"]
    sure: bool


class Score(BaseModel):
    score: int = Field(ge=0, le=99)
    name: str = Field(max_length=6)


class Tags(BaseModel):
    tags: list[Literal["x", "y", "z"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name="tiny-llama", coalesce_ms=0)
    yield engine
    engine.close()


@pytest.fixture
def llm(engine) -> Kev:
    return Kev(engine=engine, temperature=0, max_tokens=48)


@pytest.fixture
def smol(embedded_engine) -> Kev:
    return Kev(engine=embedded_engine, temperature=0, max_tokens=40)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT))


# ---- structured output ----------------------------------------------------------------------------


def test_concurrent_structured_predicts_with_different_schemas_validate_in_one_pass(engine, llm) -> None:
    classes = [Verdict, Score, Tags, Verdict]
    before = engine.stats()

    async def main():
        return await asyncio.gather(*(llm.astructured_predict(cls, PROMPT, question=f"Question {i}?")
                                      for i, cls in enumerate(classes)))

    with one_pass_for(engine, len(classes)):
        results = run(main())
    used = delta(engine, before)
    assert [type(r) for r in results] == classes
    assert (used["requests"], used["prefill_passes"]) == (4, 1)  # constrained questions pack like free ones
    assert used["grammar_compiles"] + used["grammar_cache_hits"] == 4


def test_structured_predict_stream_and_structured_llm_agree(llm) -> None:
    solo = llm.structured_predict(Score, PROMPT, question="Rate this.")
    streamed = list(llm.stream_structured_predict(Score, PROMPT, question="Rate this."))
    assert streamed[-1] == solo and len(streamed) > 1  # partial objects first, the validated one last

    async def astream():
        return [p async for p in await llm.astream_structured_predict(Score, PROMPT, question="Rate this.")]

    assert run(astream())[-1] == solo
    structured_llm = llm.as_structured_llm(Score)
    reply = structured_llm.chat([ChatMessage(role=MessageRole.USER, content="Rate this.")])
    assert Score.model_validate_json(reply.message.content) == solo


def test_a_reply_cut_by_max_tokens_is_a_parse_error_naming_length(llm) -> None:
    with pytest.raises(ReplyParseError, match="finish_reason='length'") as caught:
        llm.structured_predict(Score, PROMPT, llm_kwargs={"max_tokens": 3}, question="Rate this.")
    assert caught.value.finish_reason == "length"
    assert isinstance(caught.value, OutputParserException) and isinstance(caught.value, ValueError)

    tools = [FunctionTool.from_defaults(paint)]
    cut = llm.chat_with_tools(tools, user_msg="Paint it.", tool_required=True, max_tokens=4)
    assert cut.raw["finish_reason"] == "length"
    with pytest.raises(ReplyParseError, match="does not parse.*cut inside.*finish_reason='length'"):
        llm.get_tool_calls_from_response(cut)  # a call was required: never a silent "no call"
    (failed,) = llm.get_tool_calls_from_response(cut, error_on_no_tool_call=False)  # an agent's way
    assert failed.tool_name.startswith("tool call (not run: cut inside the <tool_call> tag")
    cut = llm.chat_with_tools(tools, user_msg="Paint it.", tool_required=True, max_tokens=12)  # inside the JSON
    with pytest.raises(ReplyParseError, match="cut by max_tokens.*finish_reason='length'"):
        llm.get_tool_calls_from_response(cut)


def test_constraints_are_call_arguments_and_a_bad_one_fails_alone(llm) -> None:
    assert llm.complete("Pick one.", choice=["alpha", "beta"]).text in ("alpha", "beta")
    reply = llm.chat([ChatMessage(role=MessageRole.USER, content="Digits?")], regex=r"[0-9]{3}")
    assert len(reply.message.content) == 3 and reply.message.content.isdigit()
    with pytest.raises(ConstraintError, match="regex"):
        llm.complete("hi", regex="(")
    with pytest.raises(ValueError, match="unknown Kev call argument.*'jsonschema'"):
        llm.complete("hi", jsonschema={})


# ---- tool calls -----------------------------------------------------------------------------------


def structural_tag(record) -> dict:
    return json.loads(record[-1][1].structural_tag)["format"]


def test_tool_choice_becomes_the_replys_constraint(engine, llm, record_submits) -> None:
    tools = [FunctionTool.from_defaults(paint), FunctionTool.from_defaults(switch)]
    required = llm.chat_with_tools(tools, user_msg="Do something.", tool_required=True)
    (call,) = llm.get_tool_calls_from_response(required)  # one call: parallel calls were not allowed
    assert call.tool_name in ("paint", "switch")
    tool = {t.metadata.name: t for t in tools}[call.tool_name]
    tool.metadata.fn_schema.model_validate(call.tool_kwargs)  # arguments match that tool's schema
    assert structural_tag(record_submits)["at_least_one"] and structural_tag(record_submits)["stop_after_first"]

    llm.chat_with_tools(tools, user_msg="Do something.", allow_parallel_tool_calls=True)
    assert structural_tag(record_submits)["type"] == "triggered_tags"  # "auto": text or valid calls
    assert not structural_tag(record_submits)["stop_after_first"]

    forced = llm.chat_with_tools(tools, user_msg="Do something.", tool_choice="switch")  # FunctionAgent's way
    assert [c.tool_name for c in llm.get_tool_calls_from_response(forced)] == ["switch"]
    none = llm.chat_with_tools(tools, user_msg="Do something.", tool_choice="none")
    assert llm.get_tool_calls_from_response(none, error_on_no_tool_call=False) == []


def test_predict_and_call_requires_a_call_and_runs_it(llm) -> None:
    tools = [FunctionTool.from_defaults(paint), FunctionTool.from_defaults(switch)]
    answer = llm.predict_and_call(tools, "Do something.")  # error_on_no_tool_call: a call is required
    (source,) = answer.sources
    assert answer.response == source.content in ("painted red", "painted blue", "on", "off")
    assert not source.is_error


def test_history_replays_calls_and_results_from_any_llms_memory() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [
        ChatMessage(role=MessageRole.USER, content="1 + 2?"),
        ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={"tool_calls": [call]}),  # OpenAI's shape
        ChatMessage(role=MessageRole.ASSISTANT, blocks=[ToolCallBlock(tool_call_id="c2", tool_name="add",
                                                                      tool_kwargs={"a": 2, "b": 2})]),
        ChatMessage(role=MessageRole.TOOL, content="3", additional_kwargs={"tool_call_id": "c1"}),
        ChatMessage(role=MessageRole.CHATBOT, content="It is 3."),
    ]
    assert to_turns(history) == [
        Turn("user", "1 + 2?"),
        Turn("assistant", "", (ToolCall("add", {"a": 1, "b": 2}, "c1"),)),
        Turn("assistant", "", (ToolCall("add", {"a": 2, "b": 2}, "c2"),)),
        Turn("tool", "3", tool_call_id="c1"),
        Turn("assistant", "It is 3."),
    ]


# ---- the embedded model: the right tool, end to end, packed ---------------------------------------


def test_gathered_predict_and_call_pick_the_right_tool_in_one_pass(embedded_engine, smol) -> None:
    tools = [FunctionTool.from_defaults(get_weather), FunctionTool.from_defaults(add)]
    before = embedded_engine.stats()

    async def main():
        return await asyncio.gather(smol.apredict_and_call(tools, "What is 17 plus 25?"),
                                    smol.apredict_and_call(tools, "What is the weather in Paris?"))

    with one_pass_for(embedded_engine, 2):
        total, weather = run(main())
    assert (total.sources[0].tool_name, total.sources[0].raw_input["kwargs"], total.response) == (
        "add", {"a": 17, "b": 25}, "42")
    assert (weather.sources[0].tool_name, weather.response) == ("get_weather", "sunny, 21 C")
    assert delta(embedded_engine, before)["prefill_passes"] == 1


def test_function_agent_answers_questions_concurrently_with_packed_llm_calls(embedded_engine, smol) -> None:
    # return_direct: the tool's output is the answer, so each agent makes one LLM call and the
    # test stays short (the full loop, result fed back to the model, is the test below it)
    tools = [FunctionTool.from_defaults(get_weather, return_direct=True),
             FunctionTool.from_defaults(add, return_direct=True)]
    # the first step must call a tool (the model picks which); one call per step for a 135M model
    agent = FunctionAgent(tools=tools, llm=smol, initial_tool_choice="required", allow_parallel_tool_calls=False)
    questions = {"What is the weather in Paris?": ("get_weather", {"city": "Paris"}, "sunny, 21 C"),
                 "What is 17 plus 25?": ("add", {"a": 17, "b": 25}, "42"),
                 "Is it snowing in Oslo right now?": ("get_weather", {"city": "Oslo"}, "snow, -3 C")}
    before = embedded_engine.stats()

    async def main():
        return await asyncio.gather(*(agent.run(q) for q in questions))

    with one_pass_for(embedded_engine, len(questions)):  # the agents' LLM calls arrive together
        results = run(main())
    used = delta(embedded_engine, before)
    for result, (name, kwargs, output) in zip(results, questions.values()):
        assert [(c.tool_name, c.tool_kwargs) for c in result.tool_calls] == [(name, kwargs)]
        assert str(result) == output  # the tool ran on those arguments
    assert (used["requests"], used["prefill_passes"]) == (3, 1)
    assert used["forward_passes"] < used["generated_tokens"] / 2  # their decode steps were shared


def test_function_agent_feeds_the_tool_result_back_and_finishes(engine, llm, record_submits) -> None:
    tools = [FunctionTool.from_defaults(paint), FunctionTool.from_defaults(switch)]
    agent = FunctionAgent(tools=tools, llm=llm, initial_tool_choice="required", allow_parallel_tool_calls=False)

    async def main():
        return await agent.run("Do something.")

    result = run(main())
    (call,) = result.tool_calls
    (first, first_sampling, _), (second, second_sampling, _) = record_submits  # a call, then an answer
    assert json.loads(first_sampling.structural_tag)["format"]["at_least_one"]  # "required" on the first step
    assert json.loads(second_sampling.structural_tag)["format"]["type"] == "triggered_tags"  # then "auto"
    assert second[1:-2] == first[1:]  # the same conversation, then the call and its result in the model's format
    assert second[0]["content"] == first[0]["content"].removesuffix("\nYou must call one of the functions.")
    assert second[-2] == {"role": "assistant", "content": "<tool_call>" + json.dumps(
        {"name": call.tool_name, "arguments": call.tool_kwargs}) + "</tool_call>"}
    assert second[-1] == {"role": "tool", "content": str(call.tool_output)}  # SmolLM2's template writes any role
    assert str(result)  # the agent ended on the second step's reply
