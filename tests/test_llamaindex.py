"""The LlamaIndex `Kev` LLM: concurrent calls (coroutines or threads) share packed passes, each
answer equals the call run alone, cancellation loses nothing, and scoped settings reach the
calls a query engine makes on its own."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from conftest import make_adapter, tiny_model
from llama_index.core import SummaryIndex
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.schema import TextNode

import kev_integrations.shared
from kev_engine import Engine, UnknownAdapterError
from kev_integrations.llamaindex import Kev, parse_tool_calls, scoped
from kev_integrations.llamaindex.messages import assistant_message

PROMPTS = [f"Question {i}: tell me about {topic}." for i, topic in enumerate(
    ["lakes", "volcanoes", "owls", "tides", "comets", "deserts", "glaciers", "rivers"])]
LENGTHS = [3, 4, 5, 6, 3, 4, 5, 6]  # calls finish at different decode steps
NODES = ["Lake Baikal is the deepest lake.", "Mount Etna is a volcano in Sicily.",
         "Owls hunt at night.", "The Moon drives the tides."]
TIMEOUT = 60


@pytest.fixture(scope="module")
def engine(tokenizer, tmp_path_factory):
    base = tiny_model("llama", tokenizer)
    folder = make_adapter(base, tmp_path_factory.mktemp("lora") / "terse", seed=1)
    # no clock-based coalescing: tests that need calls to share a pass say so with `one_pass_for`
    engine = Engine(base, tokenizer, name="tiny-llama", coalesce_ms=0)
    engine.load_adapter("terse", str(folder))
    yield engine
    engine.close()


@pytest.fixture
def llm(engine) -> Kev:
    return Kev(engine=engine, temperature=0, max_tokens=6)


def delta(engine: Engine, before: dict[str, int]) -> dict[str, int]:
    after = engine.stats()
    return {key: after[key] - before[key] for key in before if isinstance(before[key], int)}


def solo_answers(llm: Kev) -> list[str]:
    answers = [llm.complete(p, max_tokens=n).text for p, n in zip(PROMPTS, LENGTHS)]
    assert len(set(answers)) > 1  # the prompts really differ: equality below means something
    return answers


@contextmanager
def one_pass_for(engine: Engine, count: int) -> Iterator[None]:
    """Hold the engine until `count` requests are submitted, so they share its next pass, whatever
    the threads' or the event loop's timing (`Engine.hold()`, released by the last submit)."""
    hold = engine.hold()
    hold.__enter__()
    submitted = 0
    lock = threading.Lock()
    submit, patched = engine.submit, "submit" in vars(engine)  # a spy of another fixture stays

    def counting(*args, **kwargs):
        nonlocal submitted
        future = submit(*args, **kwargs)
        with lock:
            submitted += 1
            if submitted == count:
                hold.__exit__(None, None, None)
        return future

    engine.submit = counting
    try:
        yield
    finally:
        if patched:
            engine.submit = submit
        else:
            del engine.submit
        with lock:
            if submitted < count:  # the block failed before every call arrived: let the engine go
                hold.__exit__(None, None, None)


async def until(predicate, timeout: float = TIMEOUT) -> None:
    """Await a condition the engine's thread makes true, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        await asyncio.sleep(0.001)


def wait_idle(engine: Engine) -> None:
    """Wait (bounded) until the engine has dropped every request."""
    deadline = time.monotonic() + TIMEOUT
    while engine.stats()["running"] or engine.stats()["waiting"]:
        assert time.monotonic() < deadline, "the engine never became idle"
        threading.Event().wait(0.01)




# ---- coalescing ---------------------------------------------------------------------------------


def test_gathered_acomplete_calls_share_passes_and_equal_solo(engine, llm) -> None:
    solo = solo_answers(llm)
    before = engine.stats()

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(*(llm.acomplete(p, max_tokens=n) for p, n in zip(PROMPTS, LENGTHS))), TIMEOUT
        )

    with one_pass_for(engine, 8):
        answers = asyncio.run(main())
    used = delta(engine, before)
    assert used["requests"] == 8
    assert used["prefill_passes"] == 1
    assert [a.text for a in answers] == solo
    assert [a.raw["usage"]["completion_tokens"] for a in answers] == LENGTHS


def test_sync_calls_from_8_threads_coalesce(engine, llm) -> None:
    solo = solo_answers(llm)
    barrier = threading.Barrier(8)

    def ask(i: int) -> str:
        barrier.wait(TIMEOUT)
        return llm.complete(PROMPTS[i], max_tokens=LENGTHS[i]).text

    before = engine.stats()
    with one_pass_for(engine, 8), ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8), timeout=TIMEOUT))
    used = delta(engine, before)
    assert used["requests"] == 8
    assert used["prefill_passes"] == 1
    assert answers == solo


@pytest.mark.parametrize("when", ["waiting", "running"])
def test_cancelling_one_call_leaves_the_others_answered(engine, llm, when) -> None:
    solo = solo_answers(llm)[:7]
    before = engine.stats()

    async def main():
        with engine.hold():  # nothing runs until every task has submitted
            victim = asyncio.create_task(llm.acomplete(PROMPTS[7], max_tokens=500))
            others = [asyncio.create_task(llm.acomplete(p, max_tokens=n)) for p, n in zip(PROMPTS, LENGTHS[:7])]
            await until(lambda: engine.stats()["requests"] - before["requests"] == 8)
            if when == "waiting":
                victim.cancel()
        if when == "running":
            await until(lambda: engine.stats()["generated_tokens"] > before["generated_tokens"])
            victim.cancel()
        answers = await asyncio.wait_for(asyncio.gather(*others), TIMEOUT)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(victim, TIMEOUT)
        return answers

    answers = asyncio.run(main())
    assert [a.text for a in answers] == solo
    wait_idle(engine)  # the engine drops the cancelled request at its next pass
    used = delta(engine, before)
    assert used["cancelled"] == 1
    assert used["generated_tokens"] < sum(LENGTHS[:7]) + 500
    assert llm.complete(PROMPTS[0], max_tokens=LENGTHS[0]).text == solo[0]  # the engine still serves


def test_breaking_out_of_an_async_stream_stops_its_request(engine, llm) -> None:
    before = engine.stats()

    async def main():
        stream = await llm.astream_complete(PROMPTS[0], max_tokens=500)
        async for chunk in stream:
            assert chunk.delta
            break
        await stream.aclose()

    asyncio.run(main())
    wait_idle(engine)
    used = delta(engine, before)
    assert used["cancelled"] == 1
    assert used["generated_tokens"] < 500


# ---- per-call settings ----------------------------------------------------------------------------


def query_engine(llm: Kev):
    index = SummaryIndex([TextNode(text=t) for t in NODES])
    return index.as_query_engine(llm=llm, response_mode="accumulate", use_async=True)


def _query_inside_running_loop(qe):
    async def main():  # LlamaIndex then runs its own loop on a helper thread
        return qe.query("What is deep?")

    return asyncio.run(main())


QUERY_PATHS = {
    "aquery": lambda qe: asyncio.run(qe.aquery("What is deep?")),
    "query(use_async)": lambda qe: qe.query("What is deep?"),  # a fresh event loop in LlamaIndex
    "query inside a running loop": _query_inside_running_loop,
}


@pytest.mark.parametrize("path", list(QUERY_PATHS))
def test_scoped_override_reaches_a_query_engines_calls(engine, llm, record_submits, path) -> None:
    qe = query_engine(llm)
    before = engine.stats()
    with scoped(adapter="terse", max_tokens=3, temperature=0.5, seed=7), one_pass_for(engine, len(NODES)):
        response = QUERY_PATHS[path](qe)
    used = delta(engine, before)
    assert str(response)
    assert len(record_submits) == len(NODES)  # accumulate: one call per node, fanned out
    for _, sampling, adapter in record_submits:
        assert adapter == "terse"
        assert (sampling.max_tokens, sampling.temperature, sampling.seed) == (3, 0.5, 7)
    assert used["prefill_passes"] == 1  # the fan-out arrived together and shared one pass
    record_submits.clear()
    QUERY_PATHS[path](qe)  # outside the scope: the LLM's own settings again
    assert {(s.max_tokens, a) for _, s, a in record_submits} == {(6, None)}


def test_concurrent_scopes_stay_apart(llm, record_submits) -> None:
    qe = query_engine(llm)

    async def ask(adapter, max_tokens):
        with scoped(adapter=adapter, max_tokens=max_tokens):
            return await qe.aquery("What is deep?")

    async def main():
        return await asyncio.gather(ask("terse", 3), ask(None, 4))

    asyncio.run(main())
    seen = [(a, s.max_tokens) for _, s, a in record_submits]
    assert sorted(seen, key=str) == sorted([("terse", 3)] * 4 + [(None, 4)] * 4, key=str)


def test_settings_precedence_fields_then_scope_then_kwargs(llm, record_submits) -> None:
    copy = llm.with_settings(top_k=5, adapter="terse")
    assert copy.get_engine() is llm.get_engine() and llm.top_k == 0 and llm.adapter is None
    copy.complete("hi")
    with scoped(top_k=7):
        copy.complete("hi")
        copy.complete("hi", top_k=9, adapter=None)
    assert [(s.top_k, a) for _, s, a in record_submits] == [(5, "terse"), (7, "terse"), (9, None)]


def test_unknown_settings_are_refused(llm) -> None:
    with pytest.raises(ValueError, match="unknown Kev call argument.*'tempreature'"):
        llm.complete("hi", tempreature=0.5)
    with pytest.raises(ValueError, match="unknown Kev setting.*'lora'"):
        with scoped(lora="x"):
            pass
    with pytest.raises(ValueError, match="top_p"):
        llm.complete("hi", top_p=2.0)
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'nope'"):
        llm.complete("hi", adapter="nope")


# ---- LlamaIndex surface ---------------------------------------------------------------------------


def test_construction_is_lazy_and_serialization_drops_the_engine(engine, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("constructing Kev must not load a model")

    monkeypatch.setattr(kev_integrations.shared, "shared_engine", refuse)
    lazy = Kev(model="some/folder", adapters={"a": "/x"}, temperature=0.2)
    assert lazy.to_dict()["model"] == "some/folder"
    assert "engine" not in Kev(engine=engine).to_dict()


def test_metadata_reports_the_real_context_window(engine, llm) -> None:
    meta = llm.metadata
    assert meta.context_window == engine.max_context == 1024
    assert meta.is_chat_model and meta.is_function_calling_model  # tool calls are constrained, any template
    assert meta.num_output == 6 and meta.model_name == "tiny-llama"


def test_chat_and_streams_agree_and_report_usage(engine, llm) -> None:
    messages = [ChatMessage(role=MessageRole.USER, content=PROMPTS[1])]
    reply = llm.chat(messages)
    assert reply.message.content == llm.complete(PROMPTS[1]).text  # complete() = one user message
    chunks = list(llm.stream_chat(messages))
    assert "".join(c.delta for c in chunks) == reply.message.content
    assert chunks[-1].raw["usage"] == reply.raw["usage"]
    assert chunks[-1].raw["usage"]["completion_tokens"] == 6

    async def astream():
        return [c async for c in await llm.astream_chat(messages)]

    assert "".join(c.delta for c in asyncio.run(astream())) == reply.message.content
    assert "".join(c.delta for c in llm.stream_complete(PROMPTS[1])) == reply.message.content
    formatted = llm.complete(PROMPTS[1], formatted=True)  # raw text, no chat template
    assert formatted.raw["usage"]["prompt_tokens"] == len(engine.encode(PROMPTS[1]))


def test_token_counting_handler_reads_usage(engine) -> None:
    counter = TokenCountingHandler(tokenizer=engine.tokenizer.encode)
    llm = Kev(engine=engine, temperature=0, max_tokens=5, callback_manager=CallbackManager([counter]))
    answer = llm.complete(PROMPTS[2])
    asyncio.run(llm.achat([ChatMessage(role=MessageRole.USER, content=PROMPTS[3])]))
    assert len(counter.llm_token_counts) == 2
    first = counter.llm_token_counts[0]
    assert first.prompt_token_count == answer.raw["usage"]["prompt_tokens"] == len(engine.encode(
        [{"role": "user", "content": PROMPTS[2]}]))
    assert first.completion_token_count == 5
    assert counter.completion_llm_token_count == 10


def test_tools_reach_the_chat_template_and_tool_calls_parse(llm, record_submits) -> None:
    from llama_index.core.tools import FunctionTool

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    tool = FunctionTool.from_defaults(add)
    llm.chat_with_tools([tool], user_msg="What is 2 + 3?")  # SmolLM2's template ignores tools...
    system, user = record_submits[0][0]
    assert system["role"] == "system" and '"name": "add"' in system["content"] and "<tool_call>" in system["content"]
    assert user == {"role": "user", "content": "What is 2 + 3?"}

    tokenizer = llm.get_engine().tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = original + "{# tools #}"  # ...a template that renders tools gets them natively
    try:
        llm.chat_with_tools([tool], user_msg="What is 2 + 3?")
    finally:
        tokenizer.chat_template = original
    prompt = record_submits[1][0]
    assert prompt["tools"][0]["function"]["name"] == "add"
    assert prompt["messages"] == [{"role": "user", "content": "What is 2 + 3?"}]

    text = 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert parse_tool_calls(text) == [{"name": "add", "arguments": {"a": 2, "b": 3}}]
    bare = '{"name": "add", "arguments": "{\\"a\\": 1}"}'
    assert parse_tool_calls(bare, ["add"]) == [{"name": "add", "arguments": {"a": 1}}]
    assert parse_tool_calls(bare) == []  # a bare JSON object is a call only when it names a known tool
    assert parse_tool_calls("The answer is 5.") == []
    response = ChatResponse(message=assistant_message(text))
    (selection,) = llm.get_tool_calls_from_response(response)
    assert (selection.tool_name, selection.tool_kwargs) == ("add", {"a": 2, "b": 3})
    with pytest.raises(ValueError, match="expected a tool call"):
        llm.get_tool_calls_from_response(ChatResponse(message=assistant_message("no tools here")))


def test_a_query_engine_gathering_four_queries_is_one_pass_without_holding(tokenizer, monkeypatch) -> None:
    """LlamaIndex's own fan-out, no `hold()`: four queries gathered on a RetrieverQueryEngine reach
    the engine from one event loop, and the engine's first pass waits for that loop's turn
    (`kev_engine.core.arrivals`). The window is a microsecond, so only that decides; the control
    (submits not waiting for the turn) takes several passes."""
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore

    import kev_engine.engine as engine_module
    from kev_engine.core import arrivals

    monkeypatch.setattr(arrivals, "ANNOUNCED_MAX_S", TIMEOUT)  # only the announcements decide

    class Nodes(BaseRetriever):  # a real retriever of LlamaIndex's, its nodes fixed
        def _retrieve(self, query_bundle):
            time.sleep(0.02)  # busy on the event loop before the LLM call, as a real index is
            return [NodeWithScore(node=TextNode(text=NODES[len(query_bundle.query_str) % 4]), score=1.0)]

    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name="tiny-llama", coalesce_ms=0.001)
    try:
        llm = Kev(engine=engine, temperature=0, max_tokens=4)
        query_engine = RetrieverQueryEngine.from_args(Nodes(), llm=llm, response_mode="compact", use_async=True)

        async def gathered():
            return await asyncio.wait_for(asyncio.gather(*(query_engine.aquery(q) for q in PROMPTS[:4])), TIMEOUT)

        llm.complete("warm up")
        before = engine.stats()
        asyncio.run(gathered())
        assert delta(engine, before)["requests"] == 4 and delta(engine, before)["prefill_passes"] == 1
        monkeypatch.setattr(engine_module, "running_loop", lambda: None)  # the control
        before = engine.stats()
        asyncio.run(gathered())
        assert delta(engine, before)["requests"] == 4 and delta(engine, before)["prefill_passes"] >= 2
    finally:
        engine.close()
