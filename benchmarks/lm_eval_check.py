"""lm-eval's `local-completions` model against `kev serve`: the same scores whatever lm-eval's batching.

lm-eval scores a multiple-choice question by each choice's loglikelihood after the question, which
it reads from /v1/completions with ``echo: true, logprobs: 1`` (kev_integrations/server/echo.py).
Kev computes those logprobs on the engine's packed path, so they do not depend on what a prompt is
packed with: one prompt a request, 8 prompts a request (one pack) and 8 requests in flight at once
(coalesced by the scheduler) must give every choice the same loglikelihood bit for bit, and so the
same acc and acc_norm. This script checks that on a 20-question task
(benchmarks/data/lm_eval_mc.jsonl), offline.

Setup: lm-eval lives in a venv of its own (it is no dependency of Kev's); its ``api`` extra is
what `local-completions` needs, and transformers reads the tokenizer::

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api]" transformers

Usage: .venv/bin/python benchmarks/lm_eval_check.py [--lm-eval-python /tmp/lmeval/bin/python]
       [--dtype auto] [--pass-time-ms inf] [--timeout 1200]

What runs: Kev's server in this process on a loopback port (uvicorn in a thread); the task's YAML and
the engine's own tokenizer (lm-eval counts the question's tokens with it, to know where each choice
starts) written to a temp dir; then lm-eval in the other venv's python, one subprocess per batching.
The engine fills its passes by token count alone (``--pass-time-ms inf``): under a time target a slow
CPU gets one short prompt a pass, and the batchings would not pack differently at all. Each run's
prefill passes are printed to show that they did. Nothing is fetched: the data is a local JSONL read
by the datasets library's ``json`` builder and the tokenizer a local folder, and lm-eval runs with
HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 so that any Hub lookup fails at once rather than waiting
on a network that an offline machine lacks. Exits 1 when any two batchings differ in a choice's
loglikelihood, acc or acc_norm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from kev_engine import Engine
from kev_integrations.server import ServerConfig, build_app

DATA = Path(__file__).resolve().parent / "data" / "lm_eval_mc.jsonl"
TASK = "kev_mc"
KEY = "lm-eval"
MODEL = "smollm2"
BATCHINGS = [(1, 1), (8, 1), (1, 8)]  # (batch_size: prompts a request, num_concurrent: requests in flight)
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
# Runs in lm-eval's venv: argv[1] is a JSON object of the settings below; prints one "RESULT {json}"
# line on stdout (lm-eval logs to stderr).
DRIVER = """\
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

cfg = json.loads(sys.argv[1])
out = simple_evaluate(
    model="local-completions",
    model_args=dict(model=cfg["model"], base_url=cfg["base_url"], tokenizer_backend="huggingface",
                    tokenizer=cfg["tokenizer"], tokenized_requests=False, num_concurrent=cfg["num_concurrent"],
                    batch_size=cfg["batch_size"], max_retries=1),
    tasks=[cfg["task"]], task_manager=TaskManager(include_path=cfg["include_path"], include_defaults=False),
    log_samples=True, bootstrap_iters=0)
scores = out["results"][cfg["task"]]
samples = sorted(out["samples"][cfg["task"]], key=lambda s: s["doc_id"])
print("RESULT " + json.dumps({"acc": scores["acc,none"], "acc_norm": scores["acc_norm,none"],
                              "loglikelihoods": [[ll for ll, _ in s["filtered_resps"]] for s in samples]}))
"""


@contextlib.contextmanager
def serving(app: Any, start_timeout_s: float = 60.0) -> Iterator[str]:
    """`app` on a free loopback port in a thread; yields its /v1/completions URL; always stops it."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="kev-serve", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"kev serve did not start within {start_timeout_s:g} s")
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        server.should_exit = True
        thread.join(30)


def run_lm_eval(python: str, base_url: str, workdir: Path, batch_size: int, num_concurrent: int,
                timeout_s: float) -> dict[str, Any]:
    """One batching's acc, acc_norm and per-choice loglikelihoods (by question, then choice), from an
    lm-eval subprocess reading the task from `workdir`/tasks and the tokenizer from `workdir`/tokenizer."""
    settings = {"model": MODEL, "base_url": base_url, "tokenizer": str(workdir / "tokenizer"), "task": TASK,
                "include_path": str(workdir / "tasks"), "batch_size": batch_size, "num_concurrent": num_concurrent}
    env = {**os.environ, "OPENAI_API_KEY": KEY,  # local-completions sends it as the bearer key
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(workdir / "datasets")}  # a fresh cache: an edited JSONL is read again
    done = subprocess.run([python, "-c", DRIVER, json.dumps(settings)], env=env, stdout=subprocess.PIPE,
                          text=True, timeout=timeout_s)
    results = [line.removeprefix("RESULT ") for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or len(results) != 1:
        raise SystemExit(f"lm-eval failed (exit {done.returncode}); its log is above")
    return json.loads(results[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval-python", default=os.environ.get("LM_EVAL_PYTHON", "/tmp/lmeval/bin/python"),
                        help="a python with lm-eval[api] and transformers (default: $LM_EVAL_PYTHON or "
                             "/tmp/lmeval/bin/python)")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype, as `kev serve --dtype`")
    parser.add_argument("--pass-time-ms", type=float, default=math.inf,
                        help="the engine's pass target (Kev's CPU default is 300). Default inf: passes are filled "
                             "by token count alone, so batch_size 8 really packs its prompts together even where "
                             "one prompt's pass takes longer than a target")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds one lm-eval run may take")
    args = parser.parse_args()
    if not Path(args.lm_eval_python).is_file():
        parser.error(f"--lm-eval-python {args.lm_eval_python} does not exist; install lm-eval as this "
                     "script's docstring says")

    started = time.perf_counter()
    engine = Engine.from_pretrained(dtype=args.dtype, pass_time_ms=args.pass_time_ms)
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="kev-lm-eval-") as tmp:
            workdir = Path(tmp)
            (workdir / "tasks").mkdir()
            (workdir / "tasks" / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=json.dumps(str(DATA))))
            engine.tokenizer.save_pretrained(workdir / "tokenizer")  # the server's own: token counts agree
            app = build_app(engine, ServerConfig(api_keys=(KEY,)), model_name=MODEL)
            with serving(app) as base_url:
                for batch_size, num_concurrent in BATCHINGS:
                    before, run_started = engine.stats(), time.perf_counter()
                    run = run_lm_eval(args.lm_eval_python, base_url, workdir, batch_size, num_concurrent,
                                      args.timeout)
                    after = engine.stats()
                    runs.append({**run, "batch_size": batch_size, "num_concurrent": num_concurrent,
                                 "seconds": time.perf_counter() - run_started,
                                 **{key: after[key] - before[key] for key in ("requests", "prefill_passes")}})
        stats = engine.stats()
    finally:
        engine.close()

    num_choices = sum(len(row) for row in runs[0]["loglikelihoods"])
    print(f"\n{len(runs[0]['loglikelihoods'])} questions, {num_choices} choices; engine dtype {stats['dtype']}, "
          f"batch-invariant {stats['batch_invariant']}, pass target {args.pass_time_ms:g} ms")
    print(f"{'batch_size':>10} {'num_concurrent':>14} {'acc':>6} {'acc_norm':>8} {'requests':>8} "
          f"{'prefill passes':>14} {'seconds':>8}")
    for run in runs:
        print(f"{run['batch_size']:>10} {run['num_concurrent']:>14} {run['acc']:>6.3f} {run['acc_norm']:>8.3f} "
              f"{run['requests']:>8} {run['prefill_passes']:>14} {run['seconds']:>8.1f}")
    print(f"total {time.perf_counter() - started:.1f} s (engine load, and each run's lm-eval start and requests)")
    reference = runs[0]
    differing = [run for run in runs[1:] if any(run[k] != reference[k] for k in ("acc", "acc_norm", "loglikelihoods"))]
    for run in differing:
        changed = sum(a != b for ra, rb in zip(reference["loglikelihoods"], run["loglikelihoods"])
                      for a, b in zip(ra, rb))
        print(f"FAIL: batch_size {run['batch_size']}, num_concurrent {run['num_concurrent']}: {changed} of "
              f"{num_choices} loglikelihoods differ from batch_size 1, num_concurrent 1 (acc {run['acc']} vs "
              f"{reference['acc']}, acc_norm {run['acc_norm']} vs {reference['acc_norm']})")
    if not differing:
        print("OK: every batching gives every choice the same loglikelihood, bit for bit, and the same acc "
              "and acc_norm")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
