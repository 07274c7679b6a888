"""The sampling settings through LangChain and LlamaIndex on a real engine: logprobs in
ChatOpenAI's shape on ChatKev, OpenAI completions' shape on KevLLM, `CompletionResponse.logprobs`
on LlamaIndex; n generations per prompt; penalties per call; ChatKev's profile picks the
provider strategy of `create_agent`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import tiny_model
from langchain_core.messages import HumanMessage
from pydantic import BaseModel

from kev_engine import Engine, SamplingParams
from kev_integrations.langchain import ChatKev, KevLLM

QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name="tiny")
    yield engine
    engine.close()


def test_chat_kev_logprobs_in_chat_openai_shape(engine: Engine) -> None:
    llm = ChatKev(engine=engine, temperature=0, max_tokens=6)
    message = llm.bind(logprobs=True, top_logprobs=2).invoke(QUESTION)
    direct = engine.generate([MESSAGES], SamplingParams(temperature=0, max_tokens=6, logprobs=True,
                                                        top_logprobs=2))[0]
    content = message.response_metadata["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [(e.token, e.logprob) for e in direct.logprobs]
    assert [len(c["top_logprobs"]) for c in content] == [2] * len(content)
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert "logprobs" not in llm.invoke(QUESTION).response_metadata  # only when asked for
    chunks = list(llm.stream(QUESTION, logprobs=True))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    streamed = merged.response_metadata["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in streamed] == [(e.token, e.logprob) for e in direct.logprobs]


def test_chat_kev_n_generations_and_penalties_per_call(engine: Engine) -> None:
    llm = ChatKev(engine=engine, temperature=1.0, seed=3, max_tokens=6)
    result = llm.generate([[HumanMessage(QUESTION)]], n=3, presence_penalty=1.0)
    direct = engine.generate([MESSAGES], SamplingParams(temperature=1.0, seed=3, max_tokens=6, n=3,
                                                        presence_penalty=1.0))[0]
    assert [g.message.content for g in result.generations[0]] == [s.text for s in direct.samples]
    # the field's bound is the engine's (kev_engine.SETTINGS)
    with pytest.raises(ValueError, match=r"presence_penalty\n  Input should be less than or equal to 2 .*=5"):
        ChatKev(engine=engine, presence_penalty=5)


def test_kev_llm_n_generations_per_prompt_with_logprobs(engine: Engine) -> None:
    llm = KevLLM(engine=engine, temperature=0.9, seed=8, max_tokens=5, chat_template=False)
    prompts = ["Once upon a time", "The weather today"]
    result = llm.generate(prompts, n=2, logprobs=True, min_p=0.05)
    direct = engine.generate(prompts, SamplingParams(temperature=0.9, seed=8, max_tokens=5, n=2, logprobs=True,
                                                     min_p=0.05))
    assert [[g.text for g in gens] for gens in result.generations] == [[s.text for s in d.samples] for d in direct]
    info = result.generations[1][1].generation_info
    assert info["logprobs"]["token_logprobs"] == [e.logprob for e in direct[1].samples[1].logprobs]
    assert result.llm_output["token_usage"]["completion_tokens"] == 2 * 2 * 5


def test_llamaindex_completion_response_logprobs(engine: Engine) -> None:
    from llama_index.core.llms import ChatMessage

    from kev_integrations.llamaindex import Kev

    llm = Kev(engine=engine, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    response = llm.complete(QUESTION)
    direct = engine.generate([MESSAGES], SamplingParams(temperature=0, max_tokens=5, logprobs=True,
                                                        top_logprobs=3))[0]
    assert [row[0].token for row in response.logprobs] == [e.token for e in direct.logprobs]
    assert [row[0].logprob for row in response.logprobs] == [e.logprob for e in direct.logprobs]
    assert all(len(row) == 3 for row in response.logprobs)  # greedy: the chosen one is the top one
    chat = llm.chat([ChatMessage(role="user", content=QUESTION)], frequency_penalty=1.0)
    assert chat.logprobs is not None and len(chat.logprobs) == len(direct.token_ids)
    assert Kev(engine=engine, max_tokens=3).complete(QUESTION).logprobs is None


def test_chat_kev_profile_picks_the_provider_strategy(embedded_engine: Engine) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import ToolMessage

    class City(BaseModel):
        city: str

    question = {"messages": [HumanMessage("Which city is the capital of France? Answer in JSON.")]}
    llm = ChatKev(engine=embedded_engine, temperature=0, max_tokens=24)
    assert llm.profile["structured_output"] and llm.profile["tool_calling"]
    state = create_agent(llm, tools=[], response_format=City).invoke(question)
    assert isinstance(state["structured_response"], City)
    # the reply itself is the JSON (provider strategy): no tool call, no tool message
    assert City.model_validate_json(state["messages"][-1].content) == state["structured_response"]
    assert not any(isinstance(m, ToolMessage) for m in state["messages"])
    # a control: without the profile's structured_output the agent falls back to a tool call
    plain = ChatKev(engine=embedded_engine, temperature=0, max_tokens=24, profile={"tool_calling": True})
    fallback = create_agent(plain, tools=[], response_format=City).invoke(question)
    assert any(isinstance(m, ToolMessage) for m in fallback["messages"])


def test_logprob_alternatives_are_sorted_and_bounded(engine: Engine) -> None:
    message = ChatKev(engine=engine, temperature=0.8, seed=1, max_tokens=8, logprobs=True,
                      top_logprobs=20).invoke(QUESTION)
    for entry in message.response_metadata["logprobs"]["content"]:
        values = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True) and len(values) == 20
        assert all(v <= 0 and math.isfinite(v) for v in values)
