"""A max_tokens too small for the tool call tool_choice forces (issue 57, item 8): refused up front
with the numbers, on every front end; a call cut later raises in structured output, never None.

The tiny random-weight model shows the constraint, not the model, at work; the embedded
tokenizer gives the real token counts of the call's markup (21 tokens for `add`'s).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import tiny_model
from langchain_core.exceptions import OutputParserException
from langchain_core.tools import tool
from pydantic import BaseModel
from server_util import serving

from kev_engine import Engine, InvalidRequestError
from kev_integrations.langchain import ChatKev
from kev_integrations.server import ServerConfig, build_app
from kev_integrations.shared import clear_shared_engines
from kev_integrations.tool_budget import check_forced_call_budget, shortest_call

MODEL = "tiny"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
PING = {"type": "function", "function": {"name": "ping", "description": "Ping.", "parameters": {
    "type": "object", "properties": {}}}}
CHAT = [{"role": "user", "content": "3 + 4?"}]


class Verdict(BaseModel):
    """Whether it is fine."""

    ok: bool


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str
    age: int


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def count(tokenizer: Any) -> Any:
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def markup_tokens(tokenizer: Any, tool_schema: dict[str, Any]) -> int:
    return count(tokenizer)(shortest_call(tool_schema, newline=False))


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name=MODEL, coalesce_ms=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with serving(build_app(engine, ServerConfig(), model_name=MODEL)) as base:
        yield base
    clear_shared_engines()


# ---- the check -----------------------------------------------------------------------------------

def test_the_minimum_is_the_forced_calls_markup_in_the_models_tokens(tokenizer: Any) -> None:
    minimum = markup_tokens(tokenizer, ADD)
    assert minimum == 21  # <tool_call>{"name": "add", "arguments": {}}</tool_call> in SmolLM2's tokens
    with pytest.raises(InvalidRequestError) as refused:
        check_forced_call_budget(minimum - 1, [ADD], "add", tokenizer, count(tokenizer))
    message = str(refused.value)
    assert refused.value.param == "max_tokens"
    assert f"max_tokens={minimum - 1}" in message and f"takes {minimum} tokens" in message
    assert f"use max_tokens >= {minimum}" in message and '<tool_call>{"name": "add"' in message
    check_forced_call_budget(minimum, [ADD], "add", tokenizer, count(tokenizer))


def test_only_a_forced_call_is_checked_and_any_call_counts_its_shortest_tool(tokenizer: Any) -> None:
    for choice in ("auto", "none", None, False):
        check_forced_call_budget(1, [ADD], choice, tokenizer, count(tokenizer))
    shortest = min(markup_tokens(tokenizer, ADD), markup_tokens(tokenizer, PING))
    for choice in ("any", "required", True, {"type": "function", "function": {"name": "ping"}}):
        with pytest.raises(InvalidRequestError, match=f"takes {shortest} tokens"):
            check_forced_call_budget(shortest - 1, [ADD, PING], choice, tokenizer, count(tokenizer))
        check_forced_call_budget(shortest, [ADD, PING], choice, tokenizer, count(tokenizer))


def test_a_budget_surely_large_enough_tokenizes_nothing(tokenizer: Any) -> None:
    def refuse(text: str) -> int:
        raise AssertionError(f"tokenized {text!r}")

    text = shortest_call(ADD, newline=False)
    check_forced_call_budget(len(text.encode()) + 1, [ADD], "add", tokenizer, refuse)
    with pytest.raises(AssertionError, match="tokenized"):  # the control: one token less is counted
        check_forced_call_budget(len(text.encode()), [ADD], "add", tokenizer, refuse)


# ---- ChatKev -------------------------------------------------------------------------------------

def test_chatkev_refuses_a_budget_below_the_markup_before_generating(engine: Engine, tokenizer: Any) -> None:
    minimum = markup_tokens(tokenizer, ADD)
    before = engine.stats()["requests"]
    llm = ChatKev(engine=engine, max_tokens=16)
    with pytest.raises(InvalidRequestError, match=f"max_tokens=16 .* takes {minimum} tokens"):
        llm.bind_tools([add], tool_choice="add").invoke("3 + 4?")
    with pytest.raises(InvalidRequestError, match="max_tokens=16"):
        llm.with_structured_output(Verdict, method="function_calling").invoke("Is it fine?")
    with pytest.raises(InvalidRequestError, match="max_tokens=16"):
        list(llm.bind_tools([add], tool_choice="any").stream("3 + 4?"))
    assert engine.stats()["requests"] == before  # nothing was generated
    assert llm.bind_tools([add], tool_choice="auto").invoke("3 + 4?") is not None  # the model may write text


def test_chatkev_structured_output_cut_inside_the_arguments_raises_not_none(engine: Engine, tokenizer: Any) -> None:
    """At the markup's own length the arguments' required keys can never fit: the call is cut."""
    minimum = markup_tokens(tokenizer, {"type": "function", "function": {"name": "Person", "parameters": {}}})
    llm = ChatKev(engine=engine, max_tokens=minimum)
    with pytest.raises(OutputParserException, match="cut"):
        llm.with_structured_output(Person, method="function_calling").invoke("Alice is 30.")
    message = llm.bind_tools([Person], tool_choice="Person").invoke("Alice is 30.")  # what the parser got
    assert message.response_metadata["finish_reason"] == "length" and message.tool_calls == []


def test_chatkev_with_an_ample_budget_still_calls(engine: Engine) -> None:
    verdict = ChatKev(engine=engine, max_tokens=200).with_structured_output(Verdict, method="function_calling")
    assert isinstance(verdict.invoke("Is it fine?"), Verdict)


# ---- the server ----------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_the_server_answers_400_naming_the_budget_and_the_minimum(url: str, tokenizer: Any, field: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    minimum = markup_tokens(tokenizer, ADD)
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=CHAT, tools=[ADD], tool_choice=choice,
                                           **{field: minimum - 1})
        error = refused.value.body
        assert error["param"] == field and f"takes {minimum} tokens" in error["message"]
        assert f"max_tokens={minimum - 1}" in error["message"]
    free = client.chat.completions.create(model=MODEL, messages=CHAT, tools=[ADD], tool_choice="auto", max_tokens=4)
    assert free.choices[0].finish_reason == "length"  # the model may answer in text: nothing to refuse


def test_chat_openai_structured_output_gets_the_400_not_none(url: str) -> None:
    from langchain_openai import ChatOpenAI

    def llm(max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(base_url=url + "/v1", api_key="x", model=MODEL, temperature=0, max_retries=0,
                          max_tokens=max_tokens)

    with pytest.raises(openai.BadRequestError, match="max_tokens=16"):
        llm(16).with_structured_output(Person, method="function_calling").invoke("Alice is 30.")
    ample = llm(200).with_structured_output(Verdict, method="function_calling")
    assert isinstance(ample.invoke("Is it fine?"), Verdict)


def test_a_named_call_cut_inside_its_arguments_is_a_400_on_the_server_not_none(url: str, tokenizer: Any) -> None:
    """Past the up-front check, at the markup's own length: the arguments' required keys never fit.
    langchain-openai's parsers read only well-formed calls, so a cut one would come back as None."""
    from langchain_openai import ChatOpenAI

    minimum = markup_tokens(tokenizer, {"type": "function", "function": {"name": "Person", "parameters": {}}})
    llm = ChatOpenAI(base_url=url + "/v1", api_key="x", model=MODEL, temperature=0, max_retries=0,
                     max_tokens=minimum)
    structured = llm.with_structured_output(Person, method="function_calling")
    with pytest.raises(openai.BadRequestError, match=f"max_tokens={minimum} cut the call of 'Person'"):
        structured.invoke("Alice is 30.")
    with pytest.raises(openai.APIError, match=f"max_tokens={minimum} cut the call of 'Person'"):
        list(structured.stream("Alice is 30."))  # the error event closing the stream
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=[ADD], max_tokens=21,
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    assert refused.value.body["param"] == "max_tokens" and "finish_reason 'length'" in refused.value.body["message"]
    # "required" keeps OpenAI's shape: the cut call comes back, for an agent to see and call again
    required = client.chat.completions.create(model=MODEL, messages=CHAT, tools=[ADD], max_tokens=21,
                                              tool_choice="required")
    assert required.choices[0].finish_reason == "length"
