"""Speculative decoding that changes no bit: the same workloads with speculation off and on.

For each model and dtype, one process holds engines over the same weights — `speculative="off"`,
`"ngram"` (drafts from each question's own text) and, with --draft-model, `"model"` (drafts
written by that smaller model) — and times each workload on them in alternating rounds (off,
ngram, model, off, ...), each round with fresh prefix-cache keys; best of `--rounds` per engine.
Workloads (bench_invariance's prompts): "one" (the first RAG question alone), "rag16" (16 RAG
questions with their own passages), "docqa" (20 questions on one ~1,500-token document); greedy,
answers ending at their end-of-text or at --max-tokens. Reported per mode: wall seconds off and
on and their ratio, the passes and decode steps each took, the draft tokens verified and the
share taken, the seconds the draft model took, tokens per decode step, and whether every answer's
token ids are the same as off's (they must be: speculation changes no bit on the batch-invariant
path).

With --oracle, two more engines bound what any drafter could gain on this machine: "oracle" drafts
each question's answer as speculation off wrote it (every draft token is taken; the scheduler
prices the drafts as it does any other), and "oracle-free" drafts the same with the scheduler's
pricing set aside (each decoding question drafts up to MAX_DRAFT tokens in every pass, whatever
the rows cost). If a workload's "oracle-free" time is not below a goal, no drafter reaches it here.

Models: the embedded SmolLM2-135M-Instruct; ``--model llama-0.7b``, a 0.7B Llama of random weights
built in --model-dir (its answers copy nothing, so drafts are rarely taken: there the question is
whether the scheduler turns them down so that nothing gets slower); or ``--model smollm2-silent``,
the embedded model with --silent-layers more layers that add exactly zero (`random_models.
with_silent_layers`), built in --model-dir: a model several times the embedded one's cost whose
answers are the embedded model's bit for bit, so the embedded model (`--draft-model embedded`)
drafts for it as a matched small model drafts for its large sibling. Its figures are those of a
draft that nearly always agrees: an upper bound on what a real pair gains.

Usage: python benchmarks/bench_speculative.py [--rounds 3] [--dtype float32 bfloat16]
           [--workload one rag16 docqa] [--model embedded|llama-0.7b|smollm2-silent --model-dir DIR]
           [--draft-model embedded|FOLDER [--draft-dtype bfloat16]] [--oracle] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_invariance import MODELS, WARM_UP, build_model, messages, write_report  # noqa: E402
from machine import cpu_line  # noqa: E402

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_speculative.md"
MAX_TOKENS = {"one": 48, "rag16": 48, "docqa": 32}
COUNTERS = ("forward_passes", "decode_steps", "generated_tokens", "draft_tokens", "draft_accepted_tokens",
            "draft_seconds")


def timed(engine: Any, prompts: list[Any], max_tokens: int, salt: str) -> dict[str, Any]:
    """One `generate` of `prompts`: wall seconds, the engine's counters over it, the answers' ids."""
    from kev_engine import SamplingParams

    before = engine.stats()
    started = time.perf_counter()
    answers = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=salt))
    wall = time.perf_counter() - started
    after = engine.stats()
    return {"wall_s": wall, "ids": [a.token_ids for a in answers],
            **{key: after[key] - before[key] for key in COUNTERS}}


class Answers:
    """The answers speculation off wrote, by prompt ids: what the oracle engines draft from."""

    def __init__(self) -> None:
        self.by_prompt: dict[tuple[int, ...], list[int]] = {}

    def drafter(self) -> type:
        """A `Drafter` class proposing, for a question whose ids start with a known prompt, the next
        tokens of the answer off wrote for it (found once per question, then kept)."""
        from kev_engine.core.drafts import Drafter

        answers = self.by_prompt

        class Oracle(Drafter):
            prompt_len = -1
            answer: list[int] = []

            def propose(self, ids: Any, limit: int) -> list[int]:
                if self.prompt_len < 0:
                    for prompt, answer in answers.items():
                        if len(ids) > len(prompt) and tuple(ids[: len(prompt)]) == prompt:
                            self.prompt_len, self.answer = len(prompt), answer
                            break
                    else:
                        return []
                done = len(ids) - self.prompt_len
                return self.answer[done : done + limit]

        return Oracle


@contextlib.contextmanager
def unpriced(engine: Any) -> Iterator[None]:
    """`engine`'s scheduler takes every draft it is offered (up to MAX_DRAFT a question, any rows'
    cost): its rows-alike limit lifted and `_draft_pays` always true, for the runs inside."""
    from kev_engine.core import schedule

    scheduler = engine._scheduler
    pays, alike, budget = schedule._draft_pays, scheduler.rows_alike, scheduler.pass_time_s
    schedule._draft_pays = lambda *args: True
    scheduler.rows_alike = lambda rows: rows + schedule.MAX_DRAFT * max(rows, 1)
    scheduler.pass_time_s = float("inf")
    try:
        yield
    finally:
        schedule._draft_pays, scheduler.rows_alike, scheduler.pass_time_s = pays, alike, budget


def measure(model: str | None, dtype: str, workloads: list[str], rounds: int,
            draft: Any = None, oracle: bool = False) -> list[dict[str, Any]]:
    from kev_engine import Engine

    engines = {mode: Engine.from_pretrained(model, dtype=dtype, speculative=mode) for mode in ("off", "ngram")}
    if draft is not None:
        engines["model"] = Engine.from_pretrained(model, dtype=dtype, speculative="model", draft_model=draft)
    answers = Answers()
    if oracle:
        for mode in ("oracle", "oracle-free"):
            engines[mode] = Engine.from_pretrained(model, dtype=dtype, speculative="ngram")
            engines[mode]._scheduler.drafter = answers.drafter()
    rows = []
    try:
        for engine in engines.values():
            engine.generate([WARM_UP] * 2)
        for workload in workloads:
            prompts, best = messages(workload), {}
            prompt_ids = [tuple(engines["off"].encode(p)) for p in prompts]
            for round_ in range(rounds):
                for mode, engine in engines.items():
                    with unpriced(engine) if mode == "oracle-free" else contextlib.nullcontext():
                        run = timed(engine, prompts, MAX_TOKENS[workload], f"{workload}-{mode}-{round_}")
                    if mode == "off":
                        answers.by_prompt.update(zip(prompt_ids, run["ids"]))
                    print(f"  {workload} {dtype} {mode} round {round_}: {run['wall_s']:.3f} s", flush=True)
                    if mode not in best or run["wall_s"] < best[mode]["wall_s"]:
                        best[mode] = run
            off = best["off"]
            for mode in engines:
                if mode != "off":
                    rows.append({"dtype": dtype, "workload": workload, "mode": mode, "off": off, "on": best[mode],
                                 "same": off["ids"] == best[mode]["ids"],
                                 "kernels": engines["off"].stats()["dtype_choice"]})
    finally:
        for engine in engines.values():
            engine.close()
    return rows


def report(rows: list[dict[str, Any]], model: str, rounds: int, draft: str | None) -> str:
    import torch

    drafted_by = f"; draft model: {draft}" if draft else ""
    lines = [f"# bench_speculative: speculation off vs on ({model}{drafted_by}; {cpu_line()}; torch "
             f"{torch.__version__}, {platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"Wall = best of {rounds} alternating rounds per engine; greedy; the same answers required.", "",
             "| dtype | workload | mode | off s | on s | on / off | passes off / on | decode steps off / on | "
             "drafted | taken | draft model s | tokens per decode step off / on | same answers |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        off, on = row["off"], row["on"]
        taken = f"{on['draft_accepted_tokens']} ({on['draft_accepted_tokens'] / on['draft_tokens']:.0%})" \
            if on["draft_tokens"] else "0"
        per_step = [r["generated_tokens"] / max(r["decode_steps"], 1) for r in (off, on)]
        lines.append(f"| {row['dtype']} | {row['workload']} | {row['mode']} | {off['wall_s']:.3f} | "
                     f"{on['wall_s']:.3f} | {on['wall_s'] / off['wall_s']:.2f}x | "
                     f"{off['forward_passes']} / {on['forward_passes']} | "
                     f"{off['decode_steps']} / {on['decode_steps']} | "
                     f"{on['draft_tokens']} | {taken} | {on['draft_seconds']:.3f} | "
                     f"{per_step[0]:.1f} / {per_step[1]:.1f} | {'yes' if row['same'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def silent_model(folder: Path, extra: int) -> Path:
    """The embedded model with `extra` silent layers in `folder` (built once)."""
    import random_models

    from kev_engine import loader

    if not (folder / "config.json").exists():
        random_models.with_silent_layers(loader.converted_gguf_dir(loader.embedded_gguf()), extra, folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--workload", nargs="+", default=list(MAX_TOKENS), choices=list(MAX_TOKENS))
    ap.add_argument("--model", default="embedded", choices=(*MODELS, "smollm2-silent"))
    ap.add_argument("--model-dir", dest="model_dir", help="where a built --model is built (and reused)")
    ap.add_argument("--silent-layers", dest="silent_layers", type=int, default=90,
                    help="smollm2-silent: the layers added to the embedded model's 30")
    ap.add_argument("--draft-model", dest="draft_model",
                    help="also time speculative='model' with this draft: 'embedded' or a model folder")
    ap.add_argument("--draft-dtype", dest="draft_dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--oracle", action="store_true",
                    help="also time drafts that are the answers themselves, priced and unpriced (the ceiling)")
    ap.add_argument("--out", default=str(RESULTS_MD), help="the report's path (.md; its .json beside it)")
    args = ap.parse_args()
    model = None
    if args.model != "embedded":
        if not args.model_dir:
            ap.error(f"--model {args.model} needs --model-dir")
        folder = Path(args.model_dir)
        model = str(silent_model(folder, args.silent_layers) if args.model == "smollm2-silent"
                    else build_model(args.model, folder, None))
    draft = None
    if args.draft_model:
        from kev_engine import Engine

        draft = Engine.from_pretrained(None if args.draft_model == "embedded" else args.draft_model,
                                       dtype=args.draft_dtype, speculative="off")
    try:
        rows = [row for dtype in args.dtype
                for row in measure(model, dtype, args.workload, args.rounds, draft, args.oracle)]
    finally:
        if draft is not None:
            draft.close()
    for row in rows:  # the answers are compared above; the report keeps counters, not ids
        row["off"].pop("ids", None)
        row["on"].pop("ids", None)
    name = args.model if args.model != "smollm2-silent" else f"smollm2-silent (+{args.silent_layers} layers)"
    draft_name = None if draft is None else f"{args.draft_model} in {args.draft_dtype}"
    write_report(args.out, report(rows, name, args.rounds, draft_name), rows)
    if not all(row["same"] for row in rows):
        sys.exit("speculation changed an answer: see the report")


if __name__ == "__main__":
    main()
