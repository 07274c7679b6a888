"""LlamaIndex on Kev: a BM25 query engine whose fanned-out LLM calls share packed passes.

LlamaIndex has no batch API: its synthesizers fan out with `asyncio.gather`. With the `Kev`
LLM those concurrent calls reach the engine together and run as one packed pass. This script
answers the same questions twice on the embedded SmolLM2-135M-Instruct — gathered, then one
LLM call at a time — and prints the engine's passes and the wall time of each.

    pip install "kev-llm[llamaindex]" llama-index-retrievers-bm25
    python examples/llamaindex_query.py                      # the embedded model
    python examples/llamaindex_query.py --sub-questions      # also a SubQuestionQueryEngine

Everything runs offline: llama-index-core ships its NLTK and tiktoken files, and token
counting uses the model's own tokenizer (`Settings.tokenizer`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from llama_index.core import Settings
from llama_index.core.query_engine import RetrieverQueryEngine, SubQuestionQueryEngine
from llama_index.core.question_gen import LLMQuestionGenerator
from llama_index.core.schema import TextNode
from llama_index.core.tools import QueryEngineTool
from llama_index.retrievers.bm25 import BM25Retriever
from pass_counts import passes  # examples/ is on sys.path when a script in it runs

from kev_integrations.llamaindex import Kev

DATA = Path(__file__).parent / "data" / "rag.jsonl"
NUM_QUESTIONS = 4
TOP_K = 3  # accumulate: one LLM call per retrieved passage → 4 questions × 3 = 12 calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder or hub id (default: embedded SmolLM2-135M)")
    parser.add_argument("--sub-questions", action="store_true", help="also run a SubQuestionQueryEngine")
    args = parser.parse_args()
    items = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    nodes = [TextNode(text=item["context"], id_=item["id"]) for item in items]
    questions = [item["question"] for item in items[:NUM_QUESTIONS]]

    llm = Kev(model=args.model, temperature=0, max_tokens=24)  # loads on first use
    engine = llm.get_engine()
    Settings.llm = llm
    Settings.tokenizer = engine.tokenizer  # count tokens like the model does (no tiktoken download)

    retriever = BM25Retriever.from_defaults(nodes=nodes, similarity_top_k=TOP_K)

    def query_engine(use_async: bool) -> RetrieverQueryEngine:
        return RetrieverQueryEngine.from_args(retriever, llm=llm, response_mode="accumulate", use_async=use_async)

    # 1. one at a time: each question's calls run in turn, each call alone in its passes
    before, start = engine.stats(), time.perf_counter()
    serial = [query_engine(use_async=False).query(q) for q in questions]
    serial_s = time.perf_counter() - start
    print(f"one at a time: {passes(engine, before)}, {serial_s:.1f} s")

    # 2. gathered: all questions at once; each synthesizer gathers its own calls too
    async def gathered():
        qe = query_engine(use_async=True)
        return await asyncio.gather(*(qe.aquery(q) for q in questions))

    before, start = engine.stats(), time.perf_counter()
    packed = asyncio.run(gathered())
    packed_s = time.perf_counter() - start
    print(f"gathered:      {passes(engine, before)}, {packed_s:.1f} s  ({serial_s / packed_s:.1f}x faster)")
    same = sum(str(a) == str(b) for a, b in zip(serial, packed))
    print(f"same answers (greedy): {same}/{len(questions)}\n")
    for question, answer in zip(questions, packed):
        first = str(answer).strip().split("\n---------------------\n")[0]
        print(f"Q: {question}\nA: {first[:200]}\n")

    # 3. SubQuestionQueryEngine: the LLM first writes its sub-questions as JSON, then they run
    #    gathered. Kev constrains that reply to the JSON the question generator parses (each
    #    tool_name one of the tools), so it parses even from SmolLM2-135M.
    if not args.sub_questions:
        return
    tool = QueryEngineTool.from_defaults(
        query_engine(use_async=True), name="encyclopedia", description="Short articles on science and history."
    )
    sub_engine = SubQuestionQueryEngine.from_defaults(
        query_engine_tools=[tool], llm=llm, use_async=True,
        # core's generator (the default wants OpenAI's package), with a budget of its own: the
        # sub-question list is longer than an answer (a copy sharing the engine)
        question_gen=LLMQuestionGenerator.from_defaults(llm=llm.with_settings(max_tokens=128)),
    )
    before, start = engine.stats(), time.perf_counter()
    answer = sub_engine.query("Compare the depth of Lake Baikal with the age of the Great Wall of China.")
    print(f"sub-questions: {passes(engine, before)}, {time.perf_counter() - start:.1f} s\nA: {str(answer)[:300]}")


if __name__ == "__main__":
    main()
