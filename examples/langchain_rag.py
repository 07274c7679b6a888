"""A LangChain RAG chain on Kev: `chain.batch()` answers every question in one packed pass.

The corpus is the 16 passages of `data/rag.jsonl`; a real BM25 retriever (rank-bm25) picks the
passage for each question. The same chain then answers the questions one at a time, to show
what packing saves. Runs offline on the embedded SmolLM2-135M-Instruct.

    pip install "kev-llm[langchain]" rank-bm25
    python examples/langchain_rag.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from rank_bm25 import BM25Okapi

from kev_integrations.langchain import ChatKev

DATA = Path(__file__).parent / "data" / "rag.jsonl"


class BM25Retriever(BaseRetriever):
    """Okapi BM25 over an in-memory list of documents (lower-cased whitespace tokens)."""

    documents: list[Document]
    k: int = 1
    index: BM25Okapi | None = None

    model_config = {"arbitrary_types_allowed": True}

    def model_post_init(self, __context: object) -> None:
        self.index = BM25Okapi([_tokens(d.page_content) for d in self.documents])

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        assert self.index is not None
        return self.index.get_top_n(_tokens(query), self.documents, n=self.k)


def _tokens(text: str) -> list[str]:
    return [w.strip(".,;:?!()\"'").lower() for w in text.split()]


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def main() -> None:
    items = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    retriever = BM25Retriever(documents=[Document(page_content=i["context"], metadata={"id": i["id"]}) for i in items])
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only the context. Be brief."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ])
    llm = ChatKev(temperature=0, max_tokens=48)  # nothing loads until the first call
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
    questions = [i["question"] for i in items]

    llm.invoke("Hi", max_tokens=1)  # load the model now so neither timing below includes it
    engine = llm.get_engine()

    before, start = engine.stats(), time.perf_counter()
    answers = chain.batch(questions)
    batch_s, after = time.perf_counter() - start, engine.stats()
    for question, answer in zip(questions, answers):
        print(f"Q: {question}\n   -> {answer.strip()}")

    start = time.perf_counter()
    solo = [chain.invoke(q) for q in questions]
    solo_s, end = time.perf_counter() - start, engine.stats()

    hits = sum(r.invoke(i["question"])[0].metadata["id"] == i["id"] for r in [retriever] for i in items)
    print(f"\nBM25 retrieved the right passage for {hits}/{len(items)} questions")
    print(f"chain.batch():      {len(questions)} questions, {after['prefill_passes'] - before['prefill_passes']} "
          f"prefill pass(es), {after['forward_passes'] - before['forward_passes']} forward passes, {batch_s:.1f} s")
    print(f"one at a time:      {len(questions)} questions, {end['prefill_passes'] - after['prefill_passes']} "
          f"prefill pass(es), {end['forward_passes'] - after['forward_passes']} forward passes, {solo_s:.1f} s")
    print(f"same answers both ways: {sum(a == b for a, b in zip(answers, solo))}/{len(questions)}")


if __name__ == "__main__":
    main()
