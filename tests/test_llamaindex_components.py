"""LlamaIndex components on `Kev`: reply constraints as settings (fields, `with_settings`,
`scoped`, call kwargs), structured prediction, the components that read JSON from the LLM's
text (LLMQuestionGenerator, LLMSingleSelector / LLMMultiSelector), and agents that go on after a
tool call cut by max_tokens. All with the real llama-index-core.

The tiny random model checks what holds whatever the model writes: a constrained reply matches
its constraint by construction, so its budgets are sized for the longest reply the constraint
allows. The embedded SmolLM2-135M checks that whole LlamaIndex pipelines complete.

No `from __future__ import annotations`: FunctionTool reads the tools' annotations at runtime."""

import asyncio
import json
import re
from typing import Literal

import pytest
import torch
from conftest import tiny_model
from llama_index.core import SummaryIndex
from llama_index.core.agent.workflow import FunctionAgent, ReActAgent
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.output_parsers import PydanticOutputParser
from llama_index.core.output_parsers.selection import SelectionOutputParser
from llama_index.core.prompts import PromptTemplate
from llama_index.core.query_engine import RouterQueryEngine, SubQuestionQueryEngine
from llama_index.core.question_gen import LLMQuestionGenerator, SubQuestionOutputParser
from llama_index.core.schema import QueryBundle, TextNode
from llama_index.core.selectors import LLMMultiSelector, LLMSingleSelector
from llama_index.core.tools import FunctionTool, QueryEngineTool, ToolMetadata
from llama_index.core.types import BaseOutputParser
from pydantic import BaseModel

import kev_engine.sample.sample as sample_module
from kev_engine import Engine
from kev_integrations.llamaindex import Kev, scoped
from kev_integrations.llamaindex.messages import ReplyParseError
from kev_integrations.llamaindex.parsers import MAX_SUB_QUESTIONS_PER_TOOL, MAX_TEXT_CHARS, parser_constraint
from kev_integrations.tool_format import CUT_BY_MAX_TOKENS

PROMPT = PromptTemplate("{question}")
# a constrained free-text character is at most 4 UTF-8 bytes, so at most 4 tokens
TOKENS_PER_TEXT = 4 * MAX_TEXT_CHARS + 32
TOOLS = [ToolMetadata(name="lakes", description="Facts about lakes."),
         ToolMetadata(name="walls", description="Facts about the Great Wall of China.")]


class Verdict(BaseModel):
    """Bounded fields: even a random model's reply ends within a few tokens."""

    label: Literal["yes", "no", "maybe"]
    sure: bool


class Flag(BaseModel):
    on: bool


def paint(color: Literal["red", "blue"]) -> str:
    """Paint the wall in a color."""
    PAINTED.append(color)
    return f"painted {color}"


PAINTED: list[str] = []


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return {"paris": "sunny, 21 C"}.get(city.lower(), "cloudy, 15 C")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def engine(tokenizer):
    # a long context: the bounded schemas' longest replies fit after LlamaIndex's prompts
    model = tiny_model("llama", tokenizer, max_position_embeddings=8192)
    engine = Engine(model, tokenizer, name="tiny-llama", coalesce_ms=0)
    yield engine
    engine.close()


@pytest.fixture
def llm(engine) -> Kev:
    return Kev(engine=engine, temperature=0, max_tokens=48)


@pytest.fixture
def smol(embedded_engine) -> Kev:
    return Kev(engine=embedded_engine, temperature=0, max_tokens=8)  # answers: a few words are enough here


def constraints(sampling) -> dict:
    """The constraint a recorded request carried, as {kind: value} (empty: none)."""
    kind = sampling.constraint
    if kind is None:
        return {}
    value = getattr(sampling, kind[0])
    return {kind[0]: json.loads(value) if kind[0] in ("json_schema", "structural_tag") else value}


# ---- constraints as settings ----------------------------------------------------------------------


def test_constraints_are_settings_of_fields_copies_scopes_and_calls(engine, llm, record_submits) -> None:
    digits = Kev(engine=engine, temperature=0, max_tokens=8, regex=r"[0-9]{3}").complete("Digits?").text
    assert re.fullmatch(r"[0-9]{3}", digits)
    picked = llm.with_settings(choice=["alpha", "beta"]).complete("Pick one.").text
    assert picked in ("alpha", "beta")
    with scoped(json_schema=Verdict):
        Verdict.model_validate_json(llm.complete("Verdict?").text)
        Verdict.model_validate_json(llm.chat([ChatMessage(role=MessageRole.USER, content="Verdict?")]).message.content)
    yes_no = llm.complete("Yes?", grammar='root ::= "yes" | "no"').text
    assert yes_no in ("yes", "no")
    llm.complete("JSON?", json_object=True)
    assert [constraints(s) for _, s, _ in record_submits] == [
        {"regex": r"[0-9]{3}"}, {"choice": ("alpha", "beta")},
        {"json_schema": Verdict.model_json_schema()}, {"json_schema": Verdict.model_json_schema()},
        {"grammar": 'root ::= "yes" | "no"'}, {"json_object": True}]
    llm.complete("Free?")
    assert constraints(record_submits[-1][1]) == {}  # the scope ended, the original has none


def test_the_closest_constraint_wins_and_bound_tools_beat_a_scopes(engine, record_submits) -> None:
    llm = Kev(engine=engine, temperature=0, max_tokens=48, regex="[ab]")
    with scoped(choice=["x", "y"]):
        assert llm.complete("?").text in ("x", "y")  # the scope's, not the field's
        llm.complete("?", json_schema=Flag)  # the call's
        llm.structured_predict(Verdict, PROMPT, question="?")  # the output class's
        tools = [FunctionTool.from_defaults(paint)]
        (call,) = llm.get_tool_calls_from_response(llm.chat_with_tools(tools, user_msg="Paint.", tool_required=True))
        assert call.tool_name == "paint"  # the tool-call format, which its parser needs
        with scoped(regex="[0-9]"):
            assert llm.complete("?").text.isdigit()  # an inner scope's replaces the outer one's
    copy = llm.with_settings(json_schema=Flag)  # replaces the original's regex
    Flag.model_validate_json(copy.complete("?").text)
    assert (copy.regex, llm.regex, copy.get_engine()) == (None, "[ab]", llm.get_engine())
    kinds = [s.constraint[0] for _, s, _ in record_submits]
    assert kinds == ["choice", "json_schema", "json_schema", "structural_tag", "regex", "json_schema"]
    assert constraints(record_submits[1][1]) == {"json_schema": Flag.model_json_schema()}
    assert constraints(record_submits[2][1]) == {"json_schema": Verdict.model_json_schema()}


def test_unknown_or_conflicting_settings_keep_their_clear_errors(llm) -> None:
    with pytest.raises(ValueError, match=r"unknown Kev setting\(s\) \['jsonschema'\]; allowed: .*'json_schema'"):
        llm.with_settings(jsonschema={})
    with pytest.raises(ValueError, match=r"unknown Kev setting\(s\) \['regexp'\]"):
        with scoped(regexp="a"):
            pass
    with pytest.raises(ValueError, match=r"unknown Kev call argument\(s\) \['choices'\]"):
        llm.complete("hi", choices=["a"])
    with pytest.raises(TypeError, match="'jsonschema': did you mean json_schema="):
        Kev(jsonschema={})
    with pytest.raises(ValueError, match="give at most one of"):
        Kev(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice\n  Input should be a valid list"):
        llm.with_settings(choice="ab")


def test_a_pydantic_class_setting_is_kept_as_its_schema(engine) -> None:
    llm = Kev(engine=engine, json_schema=Verdict)
    assert llm.json_schema == Verdict.model_json_schema()
    assert json.loads(llm.to_json())["json_schema"] == Verdict.model_json_schema()  # serializable
    assert llm.with_settings(temperature=0.5).json_schema == Verdict.model_json_schema()


# ---- structured prediction ------------------------------------------------------------------------


def test_structured_predict_sends_the_output_class_schema_to_the_engine(llm, record_submits) -> None:
    chat = [ChatMessage(role=MessageRole.USER, content="Verdict?")]
    results = [
        llm.structured_predict(Verdict, PROMPT, question="Verdict?"),
        asyncio.run(llm.astructured_predict(Verdict, PROMPT, question="Verdict?")),
        Verdict.model_validate_json(llm.as_structured_llm(Verdict).chat(chat).message.content),
        Verdict.model_validate_json(asyncio.run(llm.as_structured_llm(Verdict).achat(chat)).message.content),
    ]
    assert all(isinstance(r, Verdict) for r in results) and len(set(map(repr, results))) == 1  # greedy: one answer
    assert [constraints(s) for _, s, _ in record_submits] == [{"json_schema": Verdict.model_json_schema()}] * 4


# ---- components that parse the reply's text themselves --------------------------------------------


def test_known_output_parsers_give_their_schema_and_others_none() -> None:
    tools_str = json.dumps({t.name: t.description for t in TOOLS})  # as LLMQuestionGenerator writes them
    (sub_questions,) = parser_constraint(SubQuestionOutputParser(), {"tools_str": tools_str}).values()
    item = sub_questions["properties"]["items"]
    assert item["items"]["properties"]["tool_name"] == {"enum": ["lakes", "walls"]}
    assert item["maxItems"] == MAX_SUB_QUESTIONS_PER_TOOL * 2
    single = SelectionOutputParser()
    (selection,) = parser_constraint(single, {"num_choices": 3}).values()
    assert selection["items"]["properties"]["choice"] == {"enum": [1, 2, 3]} and selection["maxItems"] == 1
    (multi,) = parser_constraint(single, {"num_choices": 3, "max_outputs": 2}).values()
    assert multi["maxItems"] == 2
    assert parser_constraint(PydanticOutputParser(Verdict), {}) == {"json_schema": Verdict.model_json_schema()}
    assert parser_constraint(single, {}) == {}  # no choices to number
    assert parser_constraint(None, {}) == {} and parser_constraint(Echo(), {}) == {}


class Echo(BaseOutputParser):
    """A parser Kev does not know: its calls are left unconstrained."""

    def parse(self, output: str) -> str:
        return output


def test_question_generator_and_selectors_parse_whatever_the_model_writes(llm, record_submits) -> None:
    question_gen = LLMQuestionGenerator.from_defaults(llm=llm.with_settings(
        max_tokens=MAX_SUB_QUESTIONS_PER_TOOL * len(TOOLS) * TOKENS_PER_TEXT))
    sub_questions = question_gen.generate(TOOLS, QueryBundle("How deep is Baikal and how old is the wall?"))
    assert 1 <= len(sub_questions) <= MAX_SUB_QUESTIONS_PER_TOOL * len(TOOLS)
    assert {q.tool_name for q in sub_questions} <= {"lakes", "walls"}

    selector_llm = llm.with_settings(max_tokens=2 * TOKENS_PER_TEXT)  # at most two selections
    query = QueryBundle("Which one is about lakes?")
    single = LLMSingleSelector.from_defaults(llm=selector_llm)
    (selection,) = single.select(TOOLS, query).selections
    (again,) = asyncio.run(single.aselect(TOOLS, query)).selections  # apredict: the same constraint
    assert selection.index in (0, 1) and again == selection
    multi = LLMMultiSelector.from_defaults(llm=selector_llm, max_outputs=2)
    assert 1 <= len(multi.select([*TOOLS, ToolMetadata(name="x", description="Other.")], query).selections) <= 2
    kinds = [list(constraints(s)) for _, s, _ in record_submits]
    assert kinds == [["json_schema"]] * 4

    unknown = PromptTemplate("{question}", output_parser=Echo())
    record_submits.clear()
    llm.predict(unknown, question="?")
    with scoped(regex="[ab]"):  # a parser Kev does not know: a scope gives its calls a constraint
        assert llm.predict(unknown, question="?") in ("a", "b")
    assert [s.constraint for _, s, _ in record_submits] == [None, ("regex", "[ab]")]


# ---- a tool call cut by max_tokens, in an agent ---------------------------------------------------


class Script:
    """The engine's sampler, spelling the given replies' tokens whatever the logits, one after the
    other (one request at a time): the replies of an agent's consecutive LLM calls."""

    def __init__(self, *replies: list[int]) -> None:
        self._next = iter([token for reply in replies for token in reply])

    def __call__(self, logits: torch.Tensor, **_) -> torch.Tensor:
        return torch.tensor([next(self._next) for _ in range(logits.shape[0])])


CALL = '<tool_call>{"name": "paint", "arguments": {"color": "red"}}</tool_call>'


def cut_call(tokenizer) -> list[int]:
    """`CALL`'s first tokens, cut inside its arguments (its name written whole)."""
    ids = tokenizer.encode(CALL, add_special_tokens=False)
    inside = CALL.index('"red"')
    return ids[: next(n for n in range(len(ids)) if len(tokenizer.decode(ids[:n])) > inside)]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_tool_call_cut_by_max_tokens_reaches_the_agent_as_a_failed_call(
    engine, tokenizer, record_submits, monkeypatch, streaming
) -> None:
    call = cut_call(tokenizer)
    answer = [*tokenizer.encode("Sorry.", add_special_tokens=False), tokenizer.eos_token_id]
    assert len(answer) <= len(call)  # both replies within one max_tokens
    monkeypatch.setattr(sample_module, "sample", Script(call, answer))
    cut = len(call)
    llm = Kev(engine=engine, temperature=0, max_tokens=cut)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(paint)], llm=llm, initial_tool_choice="required",
                          streaming=streaming)
    PAINTED.clear()

    async def main():
        return await agent.run("Paint it red.")

    result = asyncio.run(main())
    (failed,) = result.tool_calls
    assert failed.tool_name == f"paint (not run: {CUT_BY_MAX_TOKENS})" and failed.tool_output.is_error
    assert str(result) == "Sorry." and PAINTED == []  # the agent went on; the cut call never ran
    (_, first, _), (second_prompt, second, _) = record_submits
    assert json.loads(first.structural_tag)["format"]["at_least_one"]  # the call was required...
    assert second_prompt[-1] == {"role": "tool", "content": failed.tool_output.content}  # ...its error shown
    assert CUT_BY_MAX_TOKENS in second_prompt[-1]["content"]


def test_a_required_call_cut_short_still_raises(engine, tokenizer, monkeypatch) -> None:
    call = cut_call(tokenizer)
    monkeypatch.setattr(sample_module, "sample", Script(call))
    llm = Kev(engine=engine, temperature=0, max_tokens=len(call))
    with pytest.raises(ReplyParseError, match="tool call 'paint'.*finish_reason='length'"):
        llm.predict_and_call([FunctionTool.from_defaults(paint)], "Paint it red.")  # no agent to go on


# ---- the embedded model: whole pipelines complete -------------------------------------------------


def query_engine_tools(llm: Kev) -> list[QueryEngineTool]:
    facts = {"lakes": "Lake Baikal is the deepest lake in the world, 1642 m deep.",
             "walls": "The Great Wall of China was begun in the 7th century BC."}
    return [QueryEngineTool.from_defaults(SummaryIndex([TextNode(text=facts[t.name])]).as_query_engine(llm=llm),
                                          name=t.name, description=t.description) for t in TOOLS]


def test_sub_question_query_engine_completes_on_the_embedded_model(smol) -> None:
    # the sub-question list gets its own budget (a copy sharing the engine); answers stay short
    question_gen = LLMQuestionGenerator.from_defaults(llm=smol.with_settings(max_tokens=192))
    engine = SubQuestionQueryEngine.from_defaults(query_engine_tools(smol), llm=smol, question_gen=question_gen,
                                                  use_async=True, verbose=False)
    response = engine.query("How deep is Lake Baikal, and how old is the Great Wall?")
    assert str(response).strip()
    answered = [n for n in response.source_nodes if n.node.get_content().startswith("Sub question:")]
    assert answered  # sub-questions were parsed, and their tool answered them


def test_router_query_engine_with_an_llm_selector_completes_on_the_embedded_model(smol) -> None:
    selector = LLMSingleSelector.from_defaults(llm=smol.with_settings(max_tokens=96))
    router = RouterQueryEngine.from_defaults(query_engine_tools(smol), llm=smol, selector=selector)

    async def main():
        return await router.aquery("How deep is Lake Baikal?")

    response = asyncio.run(main())
    assert str(response).strip()
    (selection,) = response.metadata["selector_result"].selections
    assert selection.index in (0, 1)


@pytest.mark.parametrize("kind", [FunctionAgent, ReActAgent])
def test_agents_complete_on_the_embedded_model(smol, kind) -> None:
    tools = [FunctionTool.from_defaults(get_weather), FunctionTool.from_defaults(add)]
    agent = kind(tools=tools, llm=smol.with_settings(max_tokens=32))

    async def main():
        # a 135M model may call again and again: after two steps the agent answers in text
        return await agent.run("What is the weather in Paris?", max_iterations=2, early_stopping_method="generate")

    result = asyncio.run(main())
    assert str(result).strip()
