"""The LangChain promise: `chain.batch()` of a RAG chain reaches the engine as ONE prefill pass,
even when every input has its own adapter and temperature — and each answer equals that
question run alone (seeded sampling makes the nonzero temperatures comparable)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import make_adapter, reference_copy, tiny_model
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import ConfigurableField, RunnableLambda, RunnablePassthrough
from rank_bm25 import BM25Okapi

from kev_engine import Engine
from kev_integrations.langchain import ChatKev, KevLLM

RAG = Path(__file__).parents[1] / "examples" / "data" / "rag.jsonl"
ITEMS = [json.loads(line) for line in RAG.read_text(encoding="utf-8").splitlines() if line.strip()][:8]
# mixed per-input settings: base / two adapters, greedy / seeded sampling
SETTINGS = [
    {"adapter": None, "temperature": 0.0, "seed": None},
    {"adapter": "a", "temperature": 0.0, "seed": None},
    {"adapter": "b", "temperature": 0.9, "seed": 11},
    {"adapter": "a", "temperature": 0.7, "seed": 12},
    {"adapter": None, "temperature": 1.0, "seed": 13},
    {"adapter": "b", "temperature": 0.0, "seed": None},
    {"adapter": "a", "temperature": 1.2, "seed": 14},
    {"adapter": None, "temperature": 0.5, "seed": 15},
]


@pytest.fixture(scope="module")
def lora_engine(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    base = tiny_model("llama", tokenizer)
    folder = tmp_path_factory.mktemp("adapters")
    # coalesce_ms=0: the engine never waits for arrivals, so one pass means the batch held it (coalesce.py)
    engine = Engine(reference_copy(base), tokenizer, name="tiny-llama", coalesce_ms=0)
    for seed, name in enumerate(("a", "b")):
        engine.load_adapter(name, str(make_adapter(base, folder / name, seed, scale=0.2)))
    yield engine
    engine.close()


def bm25_retriever(docs: list[Document]) -> RunnableLambda:
    """A real BM25 retriever (rank-bm25) returning the best passage."""
    index = BM25Okapi([d.page_content.lower().split() for d in docs])
    return RunnableLambda(lambda q: index.get_top_n(q.lower().split(), docs, n=1))


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def rag_chain(llm: Any, chat: bool) -> Any:
    retriever = bm25_retriever([Document(page_content=item["context"]) for item in ITEMS])
    if chat:
        prompt: Any = ChatPromptTemplate.from_messages(
            [("system", "Answer using only the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")]
        )
    else:
        prompt = PromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}\nAnswer:")
    flexible = llm.configurable_fields(
        adapter=ConfigurableField(id="adapter"),
        temperature=ConfigurableField(id="temperature"),
        seed=ConfigurableField(id="seed"),
    )
    inputs = {"context": retriever | format_docs, "question": RunnablePassthrough()}
    return inputs | prompt | flexible | StrOutputParser()


@pytest.mark.parametrize("model_class", [ChatKev, KevLLM])
def test_rag_batch_is_one_prefill_pass_and_equals_solo(lora_engine: Engine, model_class: type) -> None:
    chain = rag_chain(model_class(engine=lora_engine, max_tokens=10), chat=model_class is ChatKev)
    questions = [item["question"] for item in ITEMS]
    configs = [{"configurable": s} for s in SETTINGS]

    before = lora_engine.stats()
    answers = chain.batch(questions, config=configs)
    after = lora_engine.stats()
    assert after["requests"] - before["requests"] == 8
    assert after["prefill_passes"] - before["prefill_passes"] == 1  # all 8, mixed settings, one pass

    for question, config, answer in zip(questions, configs, answers):
        assert chain.invoke(question, config=config) == answer  # alone == packed
    assert lora_engine.stats()["prefill_passes"] - after["prefill_passes"] == 8


def test_adapters_and_temperatures_really_differ(lora_engine: Engine) -> None:
    """The same question under each setting gives different answers: the settings reach the engine."""
    chain = rag_chain(ChatKev(engine=lora_engine, max_tokens=10), chat=True)
    question = ITEMS[0]["question"]
    variants = [
        {"adapter": None, "temperature": 0.0}, {"adapter": "a", "temperature": 0.0},
        {"adapter": "b", "temperature": 0.0}, {"adapter": None, "temperature": 1.5, "seed": 3},
    ]
    before = lora_engine.stats()["prefill_passes"]
    answers = chain.batch([question] * 4, config=[{"configurable": v} for v in variants])
    assert lora_engine.stats()["prefill_passes"] - before == 1
    assert len(set(answers)) == 4


def test_max_concurrency_bounds_the_pack(lora_engine: Engine) -> None:
    chain = rag_chain(ChatKev(engine=lora_engine, max_tokens=4), chat=True)
    questions = [item["question"] for item in ITEMS]
    before = lora_engine.stats()
    chain.batch(questions, config={"max_concurrency": 3})
    assert lora_engine.stats()["prefill_passes"] - before["prefill_passes"] == 3  # packs of 3 + 3 + 2


def test_batch_as_completed_is_one_pack_and_answers_as_batch(lora_engine: Engine) -> None:
    """The engine here never coalesces by clock (coalesce_ms=0): one pass means the inputs were
    packed. Every index comes once, with the answer `batch` gives it."""
    llm = ChatKev(engine=lora_engine, max_tokens=6, temperature=0)
    questions = [item["question"] for item in ITEMS[:5]]
    expected = [m.content for m in llm.batch(questions)]
    before = lora_engine.stats()["prefill_passes"]
    done = dict(llm.batch_as_completed(questions))
    assert lora_engine.stats()["prefill_passes"] - before == 1
    assert sorted(done) == list(range(5)) and [done[i].content for i in range(5)] == expected
    before = lora_engine.stats()["prefill_passes"]
    chunks = dict(llm.batch_as_completed(questions, config={"max_concurrency": 2}))
    assert lora_engine.stats()["prefill_passes"] - before == 3 and len(chunks) == 5  # packs of 2 + 2 + 1
