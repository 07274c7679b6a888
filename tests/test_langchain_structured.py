"""Constrained replies through LangChain on real engines: structured output and tool calls parse
by construction, batches of them stay ONE packed pass, and what still goes wrong (a reply cut
by max_tokens, a value a validator refuses) is reported, never returned as None.

The embedded SmolLM2-135M checks what a user sees; the tiny random-weight model checks that
the constraint, not the model, makes replies valid (its schemas keep replies short: booleans
and enums, so a random model's reply ends). `test_langchain_unit.py` covers the same plumbing
with scripted replies.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import ConfigurableField
from langchain_core.tools import tool
from pydantic import BaseModel, field_validator

from kev_engine import Engine
from kev_integrations.langchain import ChatKev, KevLLM

AGENT_EXAMPLE = Path(__file__).parents[1] / "examples" / "langchain_agent.py"


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str
    age: int


class Verdict(BaseModel):
    ok: bool


class Color(BaseModel):
    color: Literal["red", "green", "blue"]


class Level(BaseModel):
    level: Literal["low", "high"]
    urgent: bool


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return "sunny"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


PEOPLE = ["Alice is 30 years old.", "Bob turned 41 last week.", "Carol, 25, lives in Oslo."]
TOOL_QUESTIONS = ["What is the weather in Paris?", "What is 17 plus 25?"]


def passes_of(engine: Engine, run: Any) -> tuple[Any, dict[str, int]]:
    """`run()`'s result and the engine counters it moved."""
    before = engine.stats()
    result = run()
    after = engine.stats()
    return result, {key: after[key] - before[key] for key in ("requests", "prefill_passes", "forward_passes",
                                                              "grammar_compiles", "grammar_cache_hits")}


# ---- structured output --------------------------------------------------------------------

def test_a_batch_with_a_different_schema_per_input_is_one_pass(tiny_engine: Engine) -> None:
    """Three schemas and one free question in one `batch()`: one packed pass, every constrained
    reply validates against its own schema, the free one equals its solo run."""
    chain = ChatKev(engine=tiny_engine, max_tokens=24).configurable_fields(
        json_schema=ConfigurableField(id="schema")
    ) | StrOutputParser()
    schemas: list[type[BaseModel] | None] = [Verdict, Color, Level, None]
    configs: list[Any] = [{"configurable": {"schema": schema}} for schema in schemas]
    questions = ["Is it fine?", "Pick a color.", "How bad is it?", "Say something."]

    replies, moved = passes_of(tiny_engine, lambda: chain.batch(questions, config=configs))

    assert moved["requests"] == 4 and moved["prefill_passes"] == 1
    for schema, reply in zip(schemas[:3], replies):
        assert schema is not None
        schema.model_validate_json(reply)  # raises if the reply does not match its schema
    assert chain.invoke(questions[3], config=configs[3]) == replies[3]


def test_with_structured_output_batch_is_one_pass_and_every_reply_validates(embedded_engine: Engine) -> None:
    structured = ChatKev(engine=embedded_engine, max_tokens=40).with_structured_output(Person)
    people, moved = passes_of(embedded_engine, lambda: structured.batch(PEOPLE))
    assert moved["requests"] == 3 and moved["prefill_passes"] == 1
    assert all(isinstance(person, Person) for person in people)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_pydantic_and_dict_schemas_by_each_method(embedded_engine: Engine, method: str) -> None:
    llm = ChatKev(engine=embedded_engine, max_tokens=40)
    person = llm.with_structured_output(Person, method=method).invoke(PEOPLE[0])  # type: ignore[arg-type]
    as_dict = llm.with_structured_output(Person.model_json_schema(), method=method).invoke(PEOPLE[0])  # type: ignore[arg-type]
    assert isinstance(person, Person) and Person.model_validate(as_dict) == person  # same reply, two parsers


def test_json_mode_reply_is_one_json_object(embedded_engine: Engine) -> None:
    """json_mode constrains to any object (as OpenAI's): the reply parses; its keys are the model's."""
    out = ChatKev(engine=embedded_engine, max_tokens=40).with_structured_output(
        None, method="json_mode", include_raw=True
    ).invoke("Give Alice's age as JSON with the key 'age'.")
    assert isinstance(json.loads(out["raw"].content), dict) and isinstance(out["parsed"], dict)
    assert out["parsing_error"] is None


def test_repeating_a_schema_hits_the_grammar_cache(embedded_engine: Engine) -> None:
    structured = ChatKev(engine=embedded_engine, max_tokens=40).with_structured_output(Person)
    structured.invoke(PEOPLE[1])  # compiled now, or already cached by an earlier test
    _, moved = passes_of(embedded_engine, lambda: structured.invoke(PEOPLE[2]))
    assert moved["grammar_cache_hits"] == 1 and moved["grammar_compiles"] == 0


def test_streamed_structured_output_ends_with_the_invoked_object(embedded_engine: Engine) -> None:
    structured = ChatKev(engine=embedded_engine, max_tokens=40).with_structured_output(Person)
    chunks = list(structured.stream(PEOPLE[0]))
    assert chunks and all(isinstance(chunk, Person) for chunk in chunks)
    assert chunks[-1] == structured.invoke(PEOPLE[0])


def test_kevllm_classifies_a_batch_in_one_pass(tiny_engine: Engine) -> None:
    """KevLLM takes the engine's constraints as settings: a choice per batch, a regex per call."""
    labels = ["positive", "negative", "neutral"]
    classifier = KevLLM(engine=tiny_engine, choice=labels, max_tokens=8)
    replies, moved = passes_of(tiny_engine, lambda: classifier.batch(["Great!", "Awful.", "Fine.", "Meh."]))
    assert moved["prefill_passes"] == 1 and all(reply in labels for reply in replies)
    year = KevLLM(engine=tiny_engine, max_tokens=8).invoke("Which year?", regex="(19|20)[0-9]{2}")
    assert len(year) == 4 and year[:2] in ("19", "20")
    assert "".join(KevLLM(engine=tiny_engine, max_tokens=8).stream("Which year?", regex="(19|20)[0-9]{2}")) == year


# ---- what still goes wrong is reported ------------------------------------------------------

class StrictPerson(Person):
    @field_validator("name")
    @classmethod
    def refuse(cls, name: str) -> str:
        raise ValueError(f"no name is accepted here, not even {name!r}")


def test_include_raw_reports_a_cut_reply_and_a_refused_value(embedded_engine: Engine) -> None:
    llm = ChatKev(engine=embedded_engine, max_tokens=40)
    cut = ChatKev(engine=embedded_engine, max_tokens=5).with_structured_output(Person, include_raw=True)
    out = cut.invoke(PEOPLE[0])
    assert out["parsed"] is None and out["raw"].response_metadata["finish_reason"] == "length"
    assert "cut by max_tokens (finish_reason='length')" in str(out["parsing_error"])

    out = llm.with_structured_output(StrictPerson, include_raw=True).invoke(PEOPLE[0])
    assert out["parsed"] is None and "no name is accepted here" in str(out["parsing_error"])
    assert isinstance(json.loads(out["raw"].content), dict)  # the reply itself parsed: the validator refused

    # 24 tokens hold the call's markup (21) but not its arguments: the call is cut inside them
    calls = ChatKev(engine=embedded_engine, max_tokens=24).with_structured_output(
        Person, method="function_calling", include_raw=True
    ).invoke(PEOPLE[0])
    assert calls["parsed"] is None and "cut by max_tokens" in str(calls["parsing_error"])
    with pytest.raises(ValueError, match=r"max_tokens=8 .* use max_tokens >= 2\d"):  # below it: refused up front
        ChatKev(engine=embedded_engine, max_tokens=8).with_structured_output(
            Person, method="function_calling", include_raw=True).invoke(PEOPLE[0])


def test_a_tool_call_cut_by_max_tokens_is_an_invalid_call_saying_so(embedded_engine: Engine) -> None:
    # 24 tokens end inside the arguments, after the name (the markup takes 21, the full call about 33)
    llm = ChatKev(engine=embedded_engine, max_tokens=24).bind_tools([get_weather, add], tool_choice="add")
    message = llm.invoke(TOOL_QUESTIONS[1])
    assert message.tool_calls == [] and message.response_metadata["finish_reason"] == "length"
    (bad,) = message.invalid_tool_calls
    assert bad["name"] == "add" and "cut by max_tokens" in (bad["error"] or "")
    streamed = _merged(llm.stream(TOOL_QUESTIONS[1]))
    assert streamed.tool_calls == [] and "cut by max_tokens" in streamed.invalid_tool_calls[0]["args"]


# ---- tool_choice ------------------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice", ["any", "required", "add", "auto", "none"])
def test_tool_choice_shapes_every_reply_of_a_packed_batch(embedded_engine: Engine, tool_choice: str) -> None:
    llm = ChatKev(engine=embedded_engine, max_tokens=48).bind_tools([get_weather, add], tool_choice=tool_choice)
    replies, moved = passes_of(embedded_engine, lambda: llm.batch(TOOL_QUESTIONS))
    assert moved["prefill_passes"] == 1
    for reply in replies:
        assert reply.invalid_tool_calls == []  # whatever the choice, a call that is written is valid
        if tool_choice in ("any", "required"):
            assert len(reply.tool_calls) == 1 and reply.content == ""  # one call per reply by default
        elif tool_choice == "add":
            assert [call["name"] for call in reply.tool_calls] == ["add"] and reply.content == ""
        elif tool_choice == "none":
            assert reply.tool_calls == [] and "<tool_call>" not in reply.content and reply.content
        else:
            assert reply.tool_calls or reply.content


def test_forced_calls_pick_arguments_of_the_right_type_from_the_question(embedded_engine: Engine) -> None:
    """The 135M model, forced to call `add`, takes the numbers from the question (measured)."""
    llm = ChatKev(engine=embedded_engine, max_tokens=48).bind_tools([get_weather, add], tool_choice="add")
    (call,) = llm.invoke(TOOL_QUESTIONS[1]).tool_calls
    assert call["args"] == {"a": 17, "b": 25}


def test_streamed_tool_calls_equal_the_invoked_ones(embedded_engine: Engine) -> None:
    llm = ChatKev(engine=embedded_engine, max_tokens=48).bind_tools([get_weather, add], tool_choice="any")
    invoked = llm.invoke(TOOL_QUESTIONS[0]).tool_calls
    streamed = _merged(llm.stream(TOOL_QUESTIONS[0])).tool_calls
    assert [(c["name"], c["args"]) for c in streamed] == [(c["name"], c["args"]) for c in invoked]


def _merged(chunks: Any) -> AIMessage:
    full = None
    for chunk in chunks:
        full = chunk if full is None else full + chunk
    assert full is not None
    return full


# ---- an agent, end to end -----------------------------------------------------------------------

def _agent_example() -> Any:
    spec = importlib.util.spec_from_file_location("langchain_agent_example", AGENT_EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # LangGraph resolves the state's annotations in its module
    spec.loader.exec_module(module)
    return module


def test_langgraph_agent_answers_questions_in_shared_passes(embedded_engine: Engine) -> None:
    """examples/langchain_agent.py on three questions: each gets a valid call and a final
    answer, in two LLM calls, and the six calls share the engine's passes (fewer passes than
    tokens generated: with no sharing every token would be a pass of its own)."""
    example = _agent_example()
    questions = example.QUESTIONS[:3]
    report = example.run(ChatKev(engine=embedded_engine, max_tokens=48), questions)
    assert report["valid"] == 3 and report["llm_calls"] == 6
    assert report["passes"] < report["generated_tokens"]
    for result in report["results"]:
        final = result["messages"][-1]
        assert isinstance(final, AIMessage) and not final.tool_calls and final.content
