"""What the front ends must get right over the engine: adapters, token counts, arguments,
prompts, caches, timeouts, shared engines, callbacks.

All on a tiny random-weight Llama (greedy, CPU). Nothing waits on a clock: calls that must share
a pass are submitted while the engine is held (`Engine.hold()`), and every wait is bounded.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from unittest import mock

import langchain_core.language_models.base
import pytest
from conftest import make_adapter, tiny_model
from langchain_core.caches import InMemoryCache
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.globals import set_llm_cache
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    get_buffer_string,
    trim_messages,
)
from langchain_core.runnables import ConfigurableField

import kev_integrations.shared as shared
from kev_engine import AdapterError, Engine, InvalidRequestError, loader
from kev_integrations.langchain import ChatKev, KevLLM
from kev_integrations.llamaindex import Kev

TIMEOUT = 30.0
QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "Name a prime number.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def base(tokenizer: Any) -> Any:
    return tiny_model("llama", tokenizer)


@pytest.fixture(scope="module")
def engine(base: Any, tokenizer: Any) -> Engine:
    engine = Engine(base, tokenizer, name="tiny-llama", coalesce_ms=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def folders(base: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("style")
    return str(make_adapter(base, root / "a", seed=1)), str(make_adapter(base, root / "b", seed=2))


@pytest.fixture
def isolated_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh shared-engine tables, so a test's engines never leak into another's."""
    monkeypatch.setattr(shared, "_engines", {})
    monkeypatch.setattr(shared, "_settings", {})


def delta(engine: Engine, before: dict[str, int]) -> dict[str, int]:
    after = engine.stats()
    return {key: after[key] - before[key] for key in before if isinstance(before[key], int)}


def spy_submits(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[Future[Any]]:
    """The futures of every request submitted to `engine` from now on."""
    futures: list[Future[Any]] = []
    submit = engine.submit

    def spy(*args: Any, **kwargs: Any) -> Future[Any]:
        futures.append(submit(*args, **kwargs))
        return futures[-1]

    monkeypatch.setattr(engine, "submit", spy)
    return futures


# ---- adapters: one adapter name, two folders -----------------------------------------------------


def test_same_adapter_name_from_another_folder_is_an_error(engine: Engine, folders: tuple[str, str]) -> None:
    a, b = folders
    styled = ChatKev(engine=engine, adapters={"style": a}, max_tokens=2).invoke("hi", adapter="style")
    again = ChatKev(engine=engine, adapters={"style": a}, max_tokens=2).invoke("hi", adapter="style")
    assert again.content == styled.content  # the same folder again is a no-op
    for other in (ChatKev(engine=engine, adapters={"style": b}), KevLLM(engine=engine, adapters={"style": b})):
        with pytest.raises(AdapterError, match=r"'style'.*already loaded from .*/a'.*cannot also name .*/b'"):
            other.invoke("hi", adapter="style")
    with pytest.raises(AdapterError, match="'style'"):
        Kev(engine=engine, adapters={"style": b}).complete("hi", adapter="style")


def test_shared_engine_refuses_a_second_folder_for_a_name(
    engine: Engine, folders: tuple[str, str], isolated_shared: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two objects without `engine=` share the engine of (model, device, dtype), and its adapter names."""
    a, b = folders
    monkeypatch.setattr(shared.Engine, "from_pretrained", mock.Mock(return_value=engine))
    ChatKev(adapters={"style2": a}, max_tokens=2).invoke("hi", adapter="style2")
    with pytest.raises(AdapterError, match="'style2'"):
        ChatKev(adapters={"style2": b}).invoke("hi", adapter="style2")


# ---- token counts: from the model, offline -------------------------------------------------------


def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


CONVERSATION: list[BaseMessage] = [
    SystemMessage("Be brief."), HumanMessage("Hi"), AIMessage("Hello! How can I help?"),
    HumanMessage("What is the capital of France?"),
]


def test_token_counts_use_the_engines_tokenizer_and_template(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gpt2(text: str) -> list[int]:
        raise AssertionError("LangChain's GPT-2 tokenizer was asked for (a download)")

    monkeypatch.setattr(langchain_core.language_models.base, "_get_token_ids_default_method", no_gpt2)
    llm, text = ChatKev(engine=engine, max_tokens=1), "The quick brown fox jumps."
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert llm.get_token_ids(text) == ids and llm.get_num_tokens(text) == len(ids) > 0

    # a conversation counts exactly what invoke feeds: template, system prompt, tools included
    counted = llm.get_num_tokens_from_messages(CONVERSATION)
    assert counted == llm.invoke(CONVERSATION).usage_metadata["input_tokens"]
    with_tools = llm.get_num_tokens_from_messages(CONVERSATION, tools=[get_weather])
    assert with_tools > counted
    assert with_tools == llm.bind_tools([get_weather]).invoke(CONVERSATION).usage_metadata["input_tokens"]

    trimmed = trim_messages(CONVERSATION, max_tokens=counted - 1, token_counter=llm, strategy="last")
    assert 0 < len(trimmed) < len(CONVERSATION) and trimmed[-1] == CONVERSATION[-1]
    too_long = [HumanMessage("word " * 2000)]  # beyond the 1024-token context: counted, not refused
    assert llm.get_num_tokens_from_messages(too_long) > engine.max_context
    assert llm.get_num_tokens_from_messages([]) == 0

    completion = KevLLM(engine=engine, max_tokens=1)
    assert completion.get_num_tokens(text) == len(ids)
    fed = completion.generate([get_buffer_string(CONVERSATION)]).llm_output["token_usage"]["prompt_tokens"]
    assert completion.get_num_tokens_from_messages(CONVERSATION) == fed
    assert Kev(engine=engine).tokenizer(text) == ids  # for LlamaIndex's Settings.tokenizer


# ---- constructors: unknown or bad arguments ------------------------------------------------------


@pytest.mark.parametrize(("model_class", "kwargs", "message"), [
    (ChatKev, {"num_predict": 8}, r"'num_predict': use max_tokens="),
    (ChatKev, {"max_new_tokens": 8}, r"'max_new_tokens': use max_tokens="),
    (KevLLM, {"max_length": 8}, r"'max_length': use max_tokens="),
    (ChatKev, {"temprature": 0.5}, r"did you mean temperature="),
    (Kev, {"context_window": 2048}, r"'context_window': the context window is not a setting.*metadata"),
    (Kev, {"max_new_tokens": 8}, r"use max_tokens="),
])
def test_unknown_constructor_arguments_are_refused(model_class: type, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        model_class(**kwargs)


@pytest.mark.parametrize("model_class", [ChatKev, KevLLM, Kev])
@pytest.mark.parametrize(("field", "value"), [("temperature", -1), ("top_p", 2.0), ("top_k", -1), ("max_tokens", 0),
                                              ("temperature", float("nan"))])
def test_bad_sampling_values_fail_at_construction(model_class: type, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        model_class(**{field: value})  # no engine needed: nothing loads


# ---- prompts: one rule for a plain string --------------------------------------------------------


def test_a_plain_string_is_a_user_message_in_every_front_end(engine: Engine) -> None:
    question = QUESTIONS[0]
    as_user = engine.generate([[{"role": "user", "content": question}]], {"max_tokens": 4})[0]
    as_raw = engine.generate([question], {"max_tokens": 4})[0]
    assert as_user.prompt_tokens != as_raw.prompt_tokens

    info = KevLLM(engine=engine, max_tokens=4).generate([question]).generations[0][0]
    assert (info.text, info.generation_info["prompt_tokens"]) == (as_user.text, as_user.prompt_tokens)
    assert ChatKev(engine=engine, max_tokens=4).invoke(question).content == as_user.text
    assert Kev(engine=engine, max_tokens=4).complete(question).text == as_user.text

    raw = KevLLM(engine=engine, max_tokens=4, chat_template=False).generate([question]).generations[0][0]
    assert (raw.text, raw.generation_info["prompt_tokens"]) == (as_raw.text, as_raw.prompt_tokens)
    assert Kev(engine=engine, max_tokens=4).complete(question, formatted=True).text == as_raw.text


def test_chat_template_true_needs_a_template(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    with pytest.raises(InvalidRequestError, match="chat_template=True but the model 'tiny-llama' has no chat template"):
        KevLLM(engine=engine, chat_template=True).invoke("hi")


def test_chat_template_is_part_of_the_cache_key(engine: Engine) -> None:
    set_llm_cache(InMemoryCache())
    try:
        user = KevLLM(engine=engine, max_tokens=4).invoke(QUESTIONS[1])
        raw = KevLLM(engine=engine, max_tokens=4, chat_template=False).invoke(QUESTIONS[1])
        assert raw == engine.generate([QUESTIONS[1]], {"max_tokens": 4})[0].text != user
    finally:
        set_llm_cache(None)


# ---- LangChain: a chat batch respects the LLM cache ----------------------------------------------


def test_chat_batch_skips_cached_inputs_and_packs_the_rest(engine: Engine) -> None:
    set_llm_cache(InMemoryCache())
    try:
        llm = ChatKev(engine=engine, max_tokens=3)
        first = llm.invoke(QUESTIONS[0])
        before = engine.stats()
        answers = llm.batch(QUESTIONS)
        used = delta(engine, before)
        assert used["requests"] == len(QUESTIONS) - 1  # the cached one is not recomputed
        assert used["prefill_passes"] == 1  # the others still share one pass
        assert answers[0].content == first.content

        before = engine.stats()
        again = asyncio.run(asyncio.wait_for(llm.abatch([*QUESTIONS, "One more question?"]), TIMEOUT))
        used = delta(engine, before)
        assert (used["requests"], used["prefill_passes"]) == (1, 1)
        assert [a.content for a in again[:-1]] == [a.content for a in answers]

        flexible = llm.configurable_fields(max_tokens=ConfigurableField(id="max_tokens"))
        before = engine.stats()
        flexible.batch(QUESTIONS[:2] + ["And another?"], config=[{}, {}, {"configurable": {"max_tokens": 2}}])
        assert delta(engine, before)["requests"] == 1
    finally:
        set_llm_cache(None)


# ---- LangChain: KevLLM's timeout -----------------------------------------------------------------


@pytest.mark.parametrize("model_class", [KevLLM, ChatKev])
def test_timeout_bounds_a_sync_call_and_cancels_it(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, model_class: type
) -> None:
    futures = spy_submits(engine, monkeypatch)
    llm = model_class(engine=engine, timeout=0.05, max_tokens=2)
    with ThreadPoolExecutor(1) as pool, engine.hold():  # held: no answer can come (released first)
        call = pool.submit(llm.invoke, "hi")
        with pytest.raises(TimeoutError, match=r"timeout=0.05 s; the request was cancelled"):
            call.result(timeout=TIMEOUT)  # without the fix: a bare TimeoutError after TIMEOUT s
    assert len(futures) == 1 and futures[0].cancelled()

    with engine.hold():
        with pytest.raises(TimeoutError, match="timeout=0.05"):
            asyncio.run(asyncio.wait_for(llm.ainvoke("hi"), TIMEOUT))
    assert len(futures) == 2 and futures[1].cancelled()
    assert llm.model_copy(update={"timeout": TIMEOUT}).invoke("hi")  # the engine still serves


def test_timeout_cancels_every_prompt_of_a_generate(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    futures = spy_submits(engine, monkeypatch)
    with ThreadPoolExecutor(1) as pool, engine.hold():
        call = pool.submit(KevLLM(engine=engine, timeout=0.05).generate, QUESTIONS)
        with pytest.raises(TimeoutError, match="timeout=0.05"):
            call.result(timeout=TIMEOUT)
    assert len(futures) == len(QUESTIONS) and all(f.cancelled() for f in futures)


# ---- shared engines: spellings of one engine share it --------------------------------------------


def test_spellings_of_one_engine_share_it(isolated_shared: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key logic only: a counting stand-in for `Engine.from_pretrained`, so no model loads."""
    loads: list[tuple[Any, ...]] = []

    def from_pretrained(model: Any, *, device: Any, dtype: Any) -> Any:
        loads.append((model, device, dtype))
        return mock.Mock(name=f"engine{len(loads)}")

    monkeypatch.setattr(shared.Engine, "from_pretrained", from_pretrained)
    device = loader.resolve_device(None)
    dtype = str(loader.resolve_dtype(None, device)).removeprefix("torch.")
    alias = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    spellings = [ChatKev(), ChatKev(dtype=dtype), ChatKev(dtype=alias, device=device.type), KevLLM(dtype=dtype),
                 Kev(device=device.type)]
    assert len({id(llm.get_engine()) for llm in spellings}) == 1
    assert len(loads) == 1 and loads[0][1].startswith(device.type) and loads[0][2] == dtype

    other = "bfloat16" if dtype == "float32" else "float32"
    assert ChatKev(dtype=other).get_engine() is not spellings[0].get_engine()
    assert len(loads) == 2


def test_a_local_folder_is_one_engine_whatever_its_spelling(
    isolated_shared: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setattr(shared.Engine, "from_pretrained", mock.Mock(side_effect=lambda *a, **k: mock.Mock()))
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert ChatKev(model="model").get_engine() is ChatKev(model=str(tmp_path / "model")).get_engine()
    assert shared.Engine.from_pretrained.call_count == 1


# ---- LangChain: callbacks start before the pass --------------------------------------------------


class EventLog(BaseCallbackHandler):
    """Appends "start" / "end" to a log the engine's passes also write to."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.log.append("start")

    def on_llm_start(self, serialized: Any, prompts: Any, **kwargs: Any) -> None:
        self.log.append("start")

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.log.append("end")


BATCHES = {
    "ChatKev.batch": lambda llm, configs: llm.batch(QUESTIONS, config=configs),
    "ChatKev.abatch": lambda llm, configs: asyncio.run(asyncio.wait_for(llm.abatch(QUESTIONS, config=configs),
                                                                        TIMEOUT)),
    "configurable ChatKev.batch": lambda llm, configs: llm.configurable_fields(
        seed=ConfigurableField(id="seed")).batch(QUESTIONS, config=configs),
    "configurable KevLLM.batch": lambda llm, configs: KevLLM(engine=llm.engine, max_tokens=3).configurable_fields(
        seed=ConfigurableField(id="seed")).batch(QUESTIONS, config=configs),
    "KevLLM.batch": lambda llm, configs: KevLLM(engine=llm.engine, max_tokens=3).batch(QUESTIONS, config=configs),
}


@pytest.mark.parametrize("path", list(BATCHES))
def test_batch_callbacks_start_before_the_pass_and_end_after_it(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    log: list[str] = []
    step = engine._stepper.step  # what the worker runs each pass

    def logged_step() -> int:
        log.append("pass")
        return step()

    monkeypatch.setattr(engine._stepper, "step", logged_step)
    before = engine.stats()
    BATCHES[path](ChatKev(engine=engine, max_tokens=3), [{"callbacks": [EventLog(log)]}] * len(QUESTIONS))
    assert delta(engine, before)["prefill_passes"] == 1
    first_pass = log.index("pass")
    assert log[:first_pass] == ["start"] * len(QUESTIONS)  # every run started before the pass...
    assert log.count("end") == len(QUESTIONS)  # ...and each ends after its answer
    assert all(i > first_pass for i, event in enumerate(log) if event == "end")


def test_cache_salt_reaches_the_engine_from_both_integrations(tokenizer) -> None:
    """Tenants' calls with different salts never share a document's KV; the same tenant does."""
    from kev_integrations.langchain import ChatKev
    from kev_integrations.llamaindex import Kev

    engine = Engine(tiny_model("llama", tokenizer), tokenizer, coalesce_ms=0)
    doc = "The Harbor Museum opened in 1901 and holds 3,000 paintings of the sea. " * 6
    ChatKev(engine=engine, max_tokens=2, cache_salt="tenant-a").invoke(f"{doc}\nWhen did it open?")
    before = engine.stats()["prefix_hit_tokens"]
    ChatKev(engine=engine, max_tokens=2, cache_salt="tenant-b").invoke(f"{doc}\nHow many paintings?")
    assert engine.stats()["prefix_hit_tokens"] == before  # another tenant: nothing reused
    Kev(engine=engine, max_tokens=2, cache_salt="tenant-a").complete(f"{doc}\nWho runs it?")
    assert engine.stats()["prefix_hit_tokens"] > before  # the same tenant: its document reused
    engine.close()


def test_every_front_end_gets_the_tool_call_layout_of_the_models_template() -> None:
    """One decision, in tool_call_constraint: a template that renders tools and writes
    "<tool_call>\\n" gets that layout; any other gets Kev's one-line prompt layout."""
    from types import SimpleNamespace

    from kev_integrations.tool_format import tool_call_constraint

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    qwen = SimpleNamespace(chat_template="{% for tool in tools %}...{% endfor %}<tool_call>\\n{...}\\n</tool_call>")
    plain = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    mentions_tools = SimpleNamespace(chat_template="{% if tools %}<|python_tag|>{% endif %}")
    begin = {name: tool_call_constraint(tools, "add", tok)["format"]["begin"]
             for name, tok in (("qwen", qwen), ("plain", plain), ("mentions_tools", mentions_tools))}
    assert begin["qwen"].startswith("<tool_call>\n{")
    assert begin["plain"].startswith("<tool_call>{") and begin["mentions_tools"].startswith("<tool_call>{")
