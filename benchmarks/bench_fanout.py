"""Fan-out: how many passes the callers people use take, and what coalescing costs a lone request.

In one run, on the embedded model (fp32, the engine's defaults otherwise: its quiet window,
announcements and follow-up expectations as shipped; `pass_time_ms=inf` so that the count is
the callers' coalescing alone, not the pass budget's chunks), each `--trials` times:

  llamaindex-gather4   4 queries gathered on a LlamaIndex RetrieverQueryEngine (BM25-like nodes)
  agent-batch4         examples/langchain_agent.py's two-round tool agent (a call forced, then the
                       answer), batch(4)
  openai-threads8      8 threads of the `openai` client against `kev serve` on loopback
  chatopenai-batch6    langchain-openai's ChatOpenAI.batch(6) against the same server

reported as LLM calls / prefill passes (min, median, max). Then a lone request's latency
(`engine.submit` of a 60-token chat question, 8 new tokens), median of `--lone` in the same run
for this tree and, with `--baseline DIR` (a checkout of an earlier commit), for that tree, each in
a fresh process, alternated.

Usage: python benchmarks/bench_fanout.py [--trials 5] [--lone 30] [--baseline /tmp/kev-before]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))  # the LangGraph agent of examples/langchain_agent.py

RESULTS = Path(__file__).resolve().parent / "results" / "bench_fanout.md"
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Who wrote Hamlet?",
             "What is the largest ocean?", "Name a prime number.", "What is water made of?", "Name a planet."]


def passes(engine: Any, run: Callable[[], Any]) -> tuple[int, int]:
    before = engine.stats()
    run()
    after = engine.stats()
    return after["requests"] - before["requests"], after["prefill_passes"] - before["prefill_passes"]


def llamaindex_gather(engine: Any) -> Callable[[], Any]:
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode

    from kev_integrations.llamaindex import Kev

    facts = ["Paris is the capital of France.", "Red, blue and yellow are primary colours.",
             "Two plus two is four.", "Shakespeare wrote Hamlet."]

    class Facts(BaseRetriever):
        def _retrieve(self, query_bundle: Any) -> list[NodeWithScore]:
            words = set(query_bundle.query_str.lower().split())
            best = max(facts, key=lambda f: len(words & set(f.lower().split())))
            return [NodeWithScore(node=TextNode(text=best), score=1.0)]

    llm = Kev(engine=engine, temperature=0, max_tokens=8)
    query_engine = RetrieverQueryEngine.from_args(Facts(), llm=llm, response_mode="compact", use_async=True)

    async def gathered() -> list[Any]:
        return await asyncio.gather(*(query_engine.aquery(q) for q in QUESTIONS[:4]))
    return lambda: asyncio.run(gathered())


def agent_batch(engine: Any) -> Callable[[], Any]:
    from langchain_agent import QUESTIONS as AGENT_QUESTIONS
    from langchain_agent import run

    from kev_integrations.langchain import ChatKev

    llm = ChatKev(engine=engine, temperature=0, max_tokens=48)
    return lambda: run(llm, AGENT_QUESTIONS)


def openai_threads(url: str) -> Callable[[], Any]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=300)

    def run() -> None:
        threads = [threading.Thread(target=client.chat.completions.create, kwargs={
            "model": "m", "messages": [{"role": "user", "content": q}], "max_tokens": 8}) for q in QUESTIONS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return run


def chatopenai_batch(url: str) -> Callable[[], Any]:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url + "/v1", api_key="k", model="m", max_tokens=8, temperature=0, max_retries=0)
    return lambda: llm.batch(QUESTIONS[:6])


def lone(count: int) -> None:
    """Print the median seconds of `count` lone requests (run in a fresh process per tree)."""
    from kev_engine import Engine, SamplingParams

    engine = Engine.from_pretrained(dtype="float32", pass_time_ms=float("inf"))
    question = [{"role": "user", "content": "Answer in one sentence: " + " ".join(QUESTIONS)}]
    sampling = SamplingParams(max_tokens=8, temperature=0)
    engine.generate([question], sampling)
    times = []
    for _ in range(count):
        time.sleep(0.05)  # the engine idle before each, as a lone request finds it
        start = time.perf_counter()
        engine.submit(question, sampling).result()
        times.append(time.perf_counter() - start)
    engine.close()
    print(json.dumps({"median_s": statistics.median(times), "times": times}))


def lone_in(tree: Path, count: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--lone-only", str(count)], env=env,
                         capture_output=True, text=True, check=True, cwd=tree).stdout
    return float(json.loads(out.strip().splitlines()[-1])["median_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--lone", type=int, default=30, help="lone requests per tree and round")
    parser.add_argument("--baseline", type=Path, default=None, help="a checkout of an earlier commit to compare")
    parser.add_argument("--lone-only", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lone_only is not None:
        return lone(args.lone_only)

    from bench_latency import _cpu
    from server_util import serving

    from kev_engine import Engine
    from kev_engine.platforms.cpu import isa as cpu_isa
    from kev_integrations.server import ServerConfig, build_app

    engine = Engine.from_pretrained(dtype="float32", pass_time_ms=float("inf"))
    engine.generate(["warm up"], {"max_tokens": 1})
    rows = []
    with serving(build_app(engine, ServerConfig(api_keys=("k",), max_tokens_limit=64), model_name="m")) as url:
        callers = {"llamaindex-gather4": llamaindex_gather(engine), "agent-batch4": agent_batch(engine),
                   "openai-threads8": openai_threads(url), "chatopenai-batch6": chatopenai_batch(url)}
        for name, run in callers.items():
            counts = [passes(engine, run) for _ in range(args.trials)]
            calls, used = counts[0][0], sorted(p for _, p in counts)
            rows.append(f"| {name} | {calls} | {used[0]} / {statistics.median(used):g} / {used[-1]} |")
            print(rows[-1], flush=True)
    engine.close()
    lone_rows = []
    trees = [("this tree", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
    medians: dict[str, list[float]] = {name: [] for name, _ in trees}
    for _ in range(3):
        for name, tree in trees:
            medians[name].append(lone_in(tree, args.lone))
    for name, _ in trees:
        lone_rows.append(f"| {name} | {statistics.median(medians[name]) * 1000:.1f} ms |")
        print(lone_rows[-1], flush=True)
    flags = cpu_isa.flags_line().split()
    isa = ", ".join(f"{'' if flag in flags else 'no '}{name}" for flag, name in (("avx512f", "AVX-512"),
                                                                               ("amx_tile", "AMX")))
    text = "\n".join([
        f"# bench_fanout ({time.strftime('%Y-%m-%d')}, {_cpu()}, {isa}; embedded model fp32)", "",
        "| caller | LLM calls | prefill passes (min / median / max) |", "|---|---|---|", *rows, "",
        f"Lone request (60-token chat question, 8 new tokens), median of 3 rounds of {args.lone}:", "",
        "| tree | latency |", "|---|---|", *lone_rows, ""])
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
