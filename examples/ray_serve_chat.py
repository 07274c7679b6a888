"""Kev replicas on Ray Serve behind one OpenAI-compatible endpoint, queried by LangChain's ChatOpenAI.

Starts a local Ray, deploys `kev_integrations.ray.build_app` — two replicas of the embedded model
with the example adapters (`examples/train_adapters.py` writes them) — and sends:
- the 16 RAG questions as ONE `ChatOpenAI.batch()`: concurrent requests, which Serve spreads over
  the replicas and each replica's engine packs;
- questions for each adapter, chosen by `model=` as with any OpenAI-compatible server: the
  ingress routes each to the replica that already holds that adapter.
Prints the answers, where each adapter was loaded, and the time; then shuts everything down.
Needs `kev-llm[ray]` and `langchain-openai` (both in the test extra).

    python examples/ray_serve_chat.py [--replicas 2] [--port 8000]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import httpx

DATA = Path(__file__).parent / "data" / "rag.jsonl"
ADAPTERS = Path(__file__).parent / "adapters"
SYSTEM = "Answer the question using only the context. Be brief."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no telemetry from an example
    import ray
    from langchain_openai import ChatOpenAI
    from ray import serve

    from kev_integrations.ray import build_app

    adapters = {p.name: str(p) for p in sorted(ADAPTERS.iterdir()) if (p / "adapter_config.json").exists()}
    ray.init(include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    try:
        start = time.perf_counter()
        serve.run(build_app(adapters=adapters, num_replicas=args.replicas), name="kev", route_prefix="/")
        print(f"{args.replicas} replicas ready in {time.perf_counter() - start:.1f} s; adapters {sorted(adapters)}\n")
        base_url = f"http://127.0.0.1:{args.port}/v1"
        model = httpx.get(f"{base_url}/models").json()["data"][0]["id"]

        llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=48,
                         max_retries=0, timeout=600)
        items = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
        chats = [[("system", SYSTEM), ("user", f"Context:\n{i['context']}\n\nQuestion: {i['question']}")]
                 for i in items]
        start = time.perf_counter()
        replies = llm.batch(chats, config={"max_concurrency": len(chats)})
        elapsed = time.perf_counter() - start
        for item, reply in zip(items, replies):
            print(f"[{item['id']}] {item['question']}\n    -> {str(reply.content).strip()}")
        print(f"\n{len(chats)} questions in one ChatOpenAI.batch(): {elapsed:.1f} s\n")

        for name in adapters:
            tuned = ChatOpenAI(base_url=base_url, api_key="unused", model=name, temperature=0, max_tokens=24,
                               max_retries=0, timeout=600)
            for question in ("What is the capital of Germany?", "Who invented the telephone?"):
                print(f"[{name}] {question}\n    -> {str(tuned.invoke(question).content).strip()}")
        view = httpx.get(f"http://127.0.0.1:{args.port}/kev/ray/replicas", timeout=60).json()
        print("\nreplica   loaded adapters (times)   requests")
        for replica in view["replicas"]:
            print(f"{replica['replica']}  {replica['loads'] or '-'}   {replica['stats']['requests']}")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
