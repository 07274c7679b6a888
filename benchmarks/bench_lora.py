"""Benchmark Kev's multi-LoRA packed pass against PEFT on the 16-question RAG workload.

Question i uses adapter i % 5 (0 = the base model), so one batch mixes four LoRA adapters of
different ranks and targets with base-model questions: the case Kev routes per segment inside
one packed pass, and PEFT serves either per sample in a padded batch or one question at a time.

* ``kev``         - ``Engine.generate`` on all 16 at once, each with its adapter (one packed prefill).
* ``kev_base``    - the same 16 with no adapters: the price of routing is kev - kev_base.
* ``peft_mixed``  - ``PeftModel`` holding all 4 adapters, ONE left-padded ``generate(adapter_names=...)``.
* ``peft_serial`` - the same ``PeftModel`` one question at a time (``set_adapter`` / ``disable_adapter``):
                    the naive loop, and the reference answers.

The 4 adapters are made with PEFT on the embedded model, random non-zero weights (lora_B ~ N(0, 0.01)
so answers move but stay sensible), into ``benchmarks/.adapters/``. Greedy, fp32 CPU, the same prompt
ids everywhere; each system in its own subprocess after a short warm-up that touches every adapter;
peak RSS is reset after load + warm-up (as in bench_engine.py), so it covers the timed run only.

Usage: python benchmarks/bench_lora.py [--max-tokens 48] [--repeat 1] [--only NAME]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kev_engine import Engine, SamplingParams, loader
from kev_engine.inputs.tokenize import encode_prompt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import CORES, status_kib, strip_stop
from workload import load_rag, rag_messages

SYSTEMS = ["kev", "kev_base", "peft_mixed", "peft_serial"]
ADAPTER_DIR = Path(__file__).resolve().parent / ".adapters"
RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_lora.md"
# name → LoraConfig kwargs: different ranks, targets, scalings (rslora) and a per-module rank
ATTN, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
SPECS: dict[str, dict[str, Any]] = {
    "r4_qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "r8_attn": dict(r=8, lora_alpha=16, target_modules=ATTN),
    "r16_all": dict(r=16, lora_alpha=32, target_modules=ATTN + MLP),
    "r8_rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ATTN + ["up_proj", "down_proj"],
                      rank_pattern={"down_proj": 4}),
}
ROUTES = [None, *SPECS]  # question i uses ROUTES[i % 5]
Runner = tuple[Callable[[], list[list[int]]], Callable[[], dict]]  # (timed run, extra results)


def model_dir() -> Path:
    return loader.converted_gguf_dir(loader.embedded_gguf())  # the exact fp32 weights Engine.from_pretrained() uses


def make_adapters(seed: int) -> None:
    """Write the 4 random-weight adapters (regenerated every run, so files never drift from SPECS)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    for i, (name, spec) in enumerate(SPECS.items()):
        torch.manual_seed(seed + i)  # lora_A: PEFT's kaiming init; lora_B: small noise instead of zeros
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32),
                               LoraConfig(task_type="CAUSAL_LM", **spec))
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0.0, 0.01)
        model.save_pretrained(str(ADAPTER_DIR / name))


def load_peft() -> tuple[Any, Callable[[int], Any]]:
    """Plain HF model (fp32, SDPA) with all 4 adapters loaded in PEFT, and greedy GenerationConfigs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig
    base = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32, attn_implementation="sdpa")
    first, *rest = SPECS
    model = PeftModel.from_pretrained(base, ADAPTER_DIR / first, adapter_name=first)
    for name in rest:
        model.load_adapter(ADAPTER_DIR / name, adapter_name=name)
    eos, pad = base.config.eos_token_id, base.config.pad_token_id or base.config.eos_token_id
    return model.eval(), lambda n: GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=eos,
                                                    pad_token_id=pad)


def run_kev(data: dict, with_adapters: bool = True) -> Runner:
    adapters = {name: str(ADAPTER_DIR / name) for name in SPECS} if with_adapters else {}
    engine = Engine.from_pretrained(adapters=adapters)
    msgs = [rag_messages(it) for it in load_rag()]
    routes = data["routes"] if with_adapters else [None] * len(msgs)
    engine.generate(msgs[:5], SamplingParams(temperature=0, max_tokens=4), adapters=routes[:5])  # warm-up
    sp = SamplingParams(temperature=0, max_tokens=data["max_tokens"])
    extra: dict[str, Any] = {}

    def timed() -> list[list[int]]:
        before = engine.stats()
        comps = engine.generate(msgs, sp, adapters=routes)
        extra["stats"] = {k: v - before.get(k, 0) for k, v in engine.stats().items() if isinstance(v, int)}
        extra["prompt_tokens_match"] = [c.prompt_tokens for c in comps] == [len(p) for p in data["prompts"]]
        return [list(c.token_ids) for c in comps]
    return timed, lambda: extra


def run_peft_mixed(data: dict) -> Runner:
    model, gen = load_peft()

    @torch.inference_mode()
    def batch(ps: list[list[int]], routes: list[str | None], max_new_tokens: int) -> list[list[int]]:
        width, config = max(map(len, ps)), gen(max_new_tokens)
        x = torch.tensor([[config.pad_token_id] * (width - len(p)) + p for p in ps])  # [B, width], left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        out = model.generate(input_ids=x, attention_mask=mask, generation_config=config,
                             adapter_names=[r or "__base__" for r in routes])  # per-row adapter, base rows bare
        return out[:, width:].tolist()
    batch(data["prompts"][:5], data["routes"][:5], 4)  # warm-up
    return (lambda: batch(data["prompts"], data["routes"], data["max_tokens"])), dict


def run_peft_serial(data: dict) -> Runner:
    model, gen = load_peft()

    @torch.inference_mode()
    def one(ids: list[int], route: str | None, max_new_tokens: int) -> list[int]:
        x = torch.tensor([ids])
        kwargs = dict(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gen(max_new_tokens))
        if route is None:
            with model.disable_adapter():
                out = model.generate(**kwargs)
        else:
            model.set_adapter(route)
            out = model.generate(**kwargs)
        return out[0, len(ids):].tolist()
    for ids, route in zip(data["prompts"][:5], data["routes"][:5]):  # warm-up
        one(ids, route, 4)
    return (lambda: [one(p, r, data["max_tokens"]) for p, r in zip(data["prompts"], data["routes"])]), dict


RUNNERS: dict[str, Callable[[dict], Runner]] = {
    "kev": run_kev, "kev_base": lambda data: run_kev(data, with_adapters=False),
    "peft_mixed": run_peft_mixed, "peft_serial": run_peft_serial,
}


def peak_rss_kib(reset: bool = False) -> int:
    """VmHWM of this process; `reset` restarts it from the current RSS (Linux >= 4.0)."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmHWM")


def worker(name: str, job_path: str, out_path: str) -> None:
    """Run one system in this (fresh) process and write its JSON result."""
    torch.set_num_threads(CORES)
    data = json.loads(Path(job_path).read_text())
    timed, extra = RUNNERS[name](data)
    peak_rss_kib(reset=True)
    walls, outs = [], []
    for _ in range(data["repeat"]):  # best of `repeat`: this shared VM's speed varies a lot
        start = time.perf_counter()
        outs = timed()
        walls.append(time.perf_counter() - start)
    res = {"wall_s": min(walls), "walls": walls, "peak_rss_mib": peak_rss_kib() / 1024,
           "token_ids": [strip_stop(o, set(data["stop"])) for o in outs], **extra()}
    Path(out_path).write_text(json.dumps(res))


def same(a: list[list[int]], b: list[list[int]], rows: list[int]) -> int:
    return sum(a[i] == b[i] for i in rows)


def report(res: dict[str, dict], job: dict) -> str:
    lens, n, kev = [len(p) for p in job["prompts"]], len(job["prompts"]), res.get("kev", {})
    counts = {r or "base": job["routes"].count(r) for r in ROUTES}
    lines = [f"# bench_lora: {n} RAG questions over 4 LoRA adapters + base, greedy, max_new_tokens="
             f"{job['max_tokens']}, fp32 CPU, {CORES} threads, torch {torch.__version__}", "",
             f"Questions per adapter: {counts}. Adapters: " + "; ".join(f"{k}: {v}" for k, v in SPECS.items()), "",
             f"Prompt tokens: {sum(lens)} total, min {min(lens)}, max {max(lens)}. "
             f"Wall = best of {job['repeat']} timed run(s) after a 5-question warm-up (every adapter).", "",
             "| system | wall s | tokens generated | kev speedup vs it | peak RSS MiB |", "|---|---|---|---|---|"]
    for name, r in ((s, res[s]) for s in SYSTEMS if s in res):
        if "failed" in r:
            lines.append(f"| {name} | failed: {r['failed']} | | | |")
            continue
        speed = f"{r['wall_s'] / kev['wall_s']:.2f}x" if "wall_s" in kev else "n/a"
        wall = f"{r['wall_s']:.2f}" + (f" (worst {max(r['walls']):.2f})" if len(r["walls"]) > 1 else "")
        lines.append(f"| {name} | {wall} | {sum(map(len, r['token_ids']))} | {speed} | {r['peak_rss_mib']:.0f} |")
    if "stats" in kev:
        lines += ["", f"kev engine stats for the timed run: {kev['stats']}; prompt_tokens match: "
                      f"{kev['prompt_tokens_match']}"]
    ids = {name: r["token_ids"] for name, r in res.items() if "token_ids" in r}
    everything, base_rows = list(range(n)), [i for i, r in enumerate(job["routes"]) if r is None]
    ref = ids.get("peft_serial")
    if ref:
        for name in ("kev", "peft_mixed"):
            if name in ids:
                lines.append(f"{name} answers identical to peft_serial token-for-token: "
                             f"{same(ids[name], ref, everything)}/{n}")
        if "kev_base" in ids:
            lines.append(f"kev_base answers identical to peft_serial on the base-model questions: "
                         f"{same(ids['kev_base'], ref, base_rows)}/{len(base_rows)}")
    if "kev" in ids and "kev_base" in ids:
        rows = [i for i in everything if i not in base_rows]
        lines.append(f"adapter questions whose kev answer differs from the base model's: "
                     f"{len(rows) - same(ids['kev'], ids['kev_base'], rows)}/{len(rows)} (the adapters do act)")
    lines.append("\nPeak RSS: over the timed run only (VmHWM reset after load + warm-up).")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per system; the best is reported")
    ap.add_argument("--only", choices=SYSTEMS)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random adapter weights")
    ap.add_argument("--worker", nargs=3, metavar=("NAME", "JOB_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir())  # the engine's tokenizer: same ids for every system
    prompts = [encode_prompt(tokenizer, rag_messages(it), 8192) for it in load_rag()]  # 8192: SmolLM2's context
    stop = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None})
    make_adapters(args.seed)
    job = {"prompts": prompts, "routes": [ROUTES[i % len(ROUTES)] for i in range(len(prompts))], "stop": stop,
           "max_tokens": args.max_tokens, "repeat": args.repeat}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        job_path = os.path.join(tmp, "job.json")
        Path(job_path).write_text(json.dumps(job))
        for name in [args.only] if args.only else SYSTEMS:
            out = os.path.join(tmp, f"{name}.json")
            print(f"--- {name}", flush=True)
            rc = subprocess.call([sys.executable, __file__, "--worker", name, job_path, out])
            r = results[name] = json.loads(Path(out).read_text()) if rc == 0 else {"failed": f"worker exit code {rc}"}
            print(f"{name}: " + (r["failed"] if "failed" in r else f"{r['wall_s']:.2f} s"), flush=True)
    md = report(results, job)
    RESULTS_MD.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_MD.write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
