"""`RemoteEngine` against a real `kev serve` app on loopback: the same answers as the engine,
`hold()` = one request and one pack on the server, streaming, cancellation, typed errors."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from conftest import QUESTIONS, tiny_model
from server_util import serving, wait_for

from kev_engine import ConstraintError, Engine, InvalidRequestError, KevError, SamplingParams
from kev_integrations.remote import RemoteEngine
from kev_integrations.server import ServerConfig, build_app
from kev_integrations.shared import clear_shared_engines
from kev_integrations.tokens import prompt_token_count, text_token_ids

KEY = "remote-key"


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("qwen2", tokenizer), tokenizer, name="tiny-qwen2")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with serving(build_app(engine, ServerConfig(api_keys=(KEY,)), model_name="tiny-qwen2")) as base:
        yield base
    clear_shared_engines()  # the integrations' shared RemoteEngine for this server


@pytest.fixture(scope="module")
def remote(url: str) -> Iterator[RemoteEngine]:
    client = RemoteEngine(url, api_key=KEY, timeout=120)
    yield client
    client.close()


def test_generate_equals_the_engine_in_one_pack(remote: RemoteEngine, engine: Engine) -> None:
    settings = [SamplingParams(max_tokens=6), SamplingParams(temperature=1.0, seed=4, max_tokens=6),
                SamplingParams(choice=["alpha", "beta"]), SamplingParams(max_tokens=3, stop=["e"])]
    prompts = QUESTIONS[:4]
    before = engine.stats()["prefill_passes"]
    remote_replies = remote.generate(prompts, settings)
    assert engine.stats()["prefill_passes"] == before + 1  # hold() → one request → one pack
    local = engine.generate(prompts, settings)
    assert [r.token_ids for r in remote_replies] == [r.token_ids for r in local]
    # every Completion field survives the trip (the local rerun reuses the prefix the first one cached)
    assert [replace(r, cached_tokens=0) for r in remote_replies] == [replace(r, cached_tokens=0) for r in local]


def test_bad_requests_fail_alone_with_the_engines_error_types(remote: RemoteEngine) -> None:
    replies = remote.generate(QUESTIONS[:3], [SamplingParams(json_schema={"type": "bogus"}), None,
                                              SamplingParams(max_tokens=10_000)], return_exceptions=True)
    assert isinstance(replies[0], ConstraintError) and "bogus" in str(replies[0])
    assert replies[1].completion_tokens > 0
    assert isinstance(replies[2], InvalidRequestError) and "max_tokens=10000" in str(replies[2])
    assert isinstance(remote.submit([], None).exception(timeout=60), InvalidRequestError)


def test_streaming_and_token_counts(remote: RemoteEngine, engine: Engine) -> None:
    pieces: list[str] = []
    reply = remote.submit(QUESTIONS[0], SamplingParams(max_tokens=8), on_text=pieces.append).result(timeout=60)
    assert "".join(pieces) == reply.text
    assert remote.encode(QUESTIONS[0]) == engine.encode(QUESTIONS[0])
    assert prompt_token_count(remote, QUESTIONS[0]) == len(engine.encode(QUESTIONS[0]))
    assert text_token_ids(remote, "hello world") == text_token_ids(engine, "hello world")
    assert remote.tokenizer.chat_template == engine.tokenizer.chat_template and remote.max_context == engine.max_context


def test_a_cancelled_future_stops_the_work_on_the_server(remote: RemoteEngine, engine: Engine) -> None:
    before = engine.stats()
    pieces: list[str] = []
    future = remote.submit(QUESTIONS[1], SamplingParams(max_tokens=200), on_text=pieces.append)
    wait_for(lambda: pieces, 60, "the first streamed piece")
    future.cancel()
    wait_for(lambda: engine.stats()["cancelled"] > before["cancelled"], 60, "the server to cancel the request")
    assert engine.stats()["generated_tokens"] - before["generated_tokens"] < 200


def test_adapters_live_on_the_server(remote: RemoteEngine) -> None:
    assert remote.adapters == []
    with pytest.raises(KeyError, match="--adapter sql=/x"):
        remote.load_adapter("sql", "/x")


def test_chatkev_on_a_server_batches_in_one_request_and_keeps_constraints(url: str, engine: Engine) -> None:
    from langchain_core.messages import AIMessage
    from pydantic import BaseModel, Field

    from kev_integrations.langchain import ChatKev

    class Pick(BaseModel):
        colour: str = Field(max_length=8)

    remote_llm = ChatKev(base_url=url + "/v1", api_key=KEY, max_tokens=6)
    local_llm = ChatKev(engine=engine, max_tokens=6)
    questions = ["Name a colour.", "Name a fruit.", "Name a city."]
    before = engine.stats()["prefill_passes"]
    remote_replies = remote_llm.batch(questions)
    assert engine.stats()["prefill_passes"] == before + 1  # the batch travelled as one request
    assert [r.content for r in remote_replies] == [r.content for r in local_llm.batch(questions)]
    assert all(isinstance(r, AIMessage) and r.usage_metadata["output_tokens"] > 0 for r in remote_replies)
    structured = ChatKev(base_url=url, api_key=KEY, max_tokens=24).with_structured_output(Pick, include_raw=True)
    result = structured.invoke("Pick a colour.")
    assert isinstance(result["parsed"], Pick) or "max_tokens" in str(result["parsing_error"])
    assert result["raw"].content.startswith('{"colour": "')  # the schema constrained the reply on the server
    with pytest.raises(ValueError, match="chosen by the server"):
        ChatKev(base_url=url, api_key=KEY, model="/some/folder").invoke("x")


def test_llamaindex_kev_on_a_server(url: str, engine: Engine) -> None:
    from kev_integrations.llamaindex import Kev

    remote_llm = Kev(base_url=url, api_key=KEY, max_tokens=6)
    local_llm = Kev(engine=engine, max_tokens=6)
    assert remote_llm.complete("Name a colour.").text == local_llm.complete("Name a colour.").text
    assert remote_llm.metadata.context_window == engine.max_context
    wrong_key = Kev(base_url=url, api_key="wrong", max_tokens=6)
    with pytest.raises(KevError, match="401"):
        wrong_key.complete("x")


def test_kevllm_on_a_server_batches_in_one_request(url: str, engine: Engine) -> None:
    from kev_integrations.langchain import KevLLM

    prompts = ["Once upon a time", "The capital of France is"]
    before = engine.stats()["prefill_passes"]
    remote_texts = KevLLM(base_url=url, api_key=KEY, max_tokens=5, chat_template=False).batch(prompts)
    assert engine.stats()["prefill_passes"] == before + 1
    assert remote_texts == KevLLM(engine=engine, max_tokens=5, chat_template=False).batch(prompts)


def test_a_cancelled_non_streamed_request_hangs_up(remote: RemoteEngine, engine: Engine) -> None:
    before = engine.stats()
    future = remote.submit(QUESTIONS[2], SamplingParams(max_tokens=300))  # no on_text: no event until it ends
    wait_for(lambda: engine.stats()["running"] == 1, 60, "the server to start the request")
    future.cancel()
    wait_for(lambda: engine.stats()["cancelled"] > before["cancelled"], 60, "the server to cancel the request")
    assert engine.stats()["generated_tokens"] - before["generated_tokens"] < 300


def test_a_held_batch_larger_than_the_server_takes_is_split(engine: Engine) -> None:
    with serving(build_app(engine, ServerConfig(max_prompts=2), model_name="tiny-qwen2")) as base:
        client = RemoteEngine(base, timeout=120)
        try:
            replies = client.generate(QUESTIONS[:5], SamplingParams(max_tokens=3))
        finally:
            client.close()
    assert [r.token_ids for r in replies] == [r.token_ids for r in engine.generate(QUESTIONS[:5],
                                                                                   SamplingParams(max_tokens=3))]


def test_samples_and_logprobs_travel_whole(remote: RemoteEngine, engine: Engine) -> None:
    """n samples, logprobs and a logit_bias reach the server and come back as the engine's own
    `Completion`, and streamed pieces keep their sample index and logprobs."""
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=6, n=3, logprobs=True, top_logprobs=2,
                            logit_bias={13: -100}, frequency_penalty=0.5)
    assert remote.generate([QUESTIONS[0]], params)[0] == engine.generate([QUESTIONS[0]], params)[0]
    pieces: list = []
    result = remote.submit(QUESTIONS[1], params, on_text=pieces.append).result(timeout=120)
    for i, sample in enumerate(result.samples):
        assert "".join(p for p in pieces if p.sample_index == i) == sample.text
        streamed = [lp for p in pieces if p.sample_index == i for lp in p.logprobs]
        assert streamed == sample.logprobs[: len(streamed)]
