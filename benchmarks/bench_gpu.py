"""RAG-16, DOC-QA and a 64-question RAG batch: Kev against transformers one at a time and padded, and the floor.

The benchmark half of `make gpu-check` (benchmarks/gpu_check.py puts its result in the report);
alone: `python benchmarks/bench_gpu.py [--device cuda] [--model FOLDER] [--max-tokens 48]
[--systems kev ...] [--out FILE]`.

Every system answers the same prompt ids (`engine.encode`) greedily, in one process, one after
another, each timed after an untimed warm-up (Kev's on the whole workload under another
`cache_salt`, so its decode graphs are captured and Triton has compiled; nothing of it is reused).
  kev        one `Engine.generate` call with every question (a budget of twice the workload's
             tokens for its KV pool, not half the GPU: the pool is allocated up front), on the
             attention `cuda_attention="auto"` picks (Kev's Triton kernel where torch's varlen_attn
             is not paged);
  kev_varlen the same on torch's varlen_attn (`cuda_attention="varlen"`: paged from torch 2.12,
             gathered in 2.10/2.11, where decode runs without graphs); on CUDA with varlen_attn
             only (else the result's `kev_varlen_not_run` says why). Both Kev systems also time
             the workload's prefill alone (`prefill_s`: one token each): which attention prefill
             should take;
  hf_serial  transformers `generate` per question (SDPA, the same dtype);
  hf_padded  transformers `generate` on one left-padded batch.
Per system: wall seconds, generated tokens (cut at the first stop token), tokens/s, peak memory
the device allocated during the timed run (None off CUDA), and how many answers equal
hf_serial's token for token. On a GPU, beside them (`gpu_floor`, measured in the same run): the
device's read bandwidth and bf16 rate, each workload's floor and Kev's time over it, a decode
step of 1 and of 16 rows in milliseconds (two runs of the same questions with `ignore_eos`, 8 and
40 tokens each: the difference over 32 steps), the 16-row step with every other question on a
random rank-16 adapter of every projection (such a pass runs eagerly, off its graph: what
per-question adapters cost a decode step), and the model's weight shapes through Kev's Triton
product against the rate. On a CPU (the report format's test) the same code runs with the
device named in the result and none of the GPU-only figures: never a GPU figure that a GPU did not
produce.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_floor  # noqa: E402
from bench_prefix import doc_qa_messages  # noqa: E402
from workload import SYSTEM_PROMPT, load_rag, rag_messages  # noqa: E402

from kev_engine import (
    Engine,
    SamplingParams,
    loader,  # noqa: E402
)

SYSTEMS = ("kev", "kev_varlen", "hf_serial", "hf_padded")
CUDA_ONLY = ("kev_varlen",)
RAG64_ROUNDS = 4  # 16 passages, 4 rounds: 64 questions, each round under its own system prompt
STEP_ROWS = (1, 16)  # decode steps timed at these row counts
STEP_TOKENS = (8, 40)  # tokens per question in the two runs a step's time is the difference of
PRODUCT_ROWS = 4096  # a prefill's rows, for the products' rates


def rag64_messages() -> list[list[dict]]:
    """64 RAG questions: the 16 passages four times, each round's system prompt numbered, so a
    round shares only its own system prompt (as RAG-16 does) and no two prompts are the same."""
    out = []
    for round_ in range(RAG64_ROUNDS):
        for item in load_rag():
            messages = rag_messages(item)
            messages[0] = {"role": "system", "content": f"{SYSTEM_PROMPT} (batch {round_ + 1})"}
            out.append(messages)
    return out


WORKLOADS: dict[str, Callable[[], list[list[dict]]]] = {
    "rag16": lambda: [rag_messages(item) for item in load_rag()],
    "doc_qa": doc_qa_messages,
    "rag64": rag64_messages,
}


def strip_stop(ids: list[int], stop: set[int]) -> list[int]:
    """Cut at the first stop token (excluded), so every system is counted the same way."""
    return next((ids[:i] for i, t in enumerate(ids) if t in stop), ids)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, run: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]], float | None]:
    """(wall seconds, answers, peak MiB the device allocated during the run, None off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    answers = run()
    sync(device)
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return wall, answers, peak


def kev_runner(engine: Engine, chats: list[list[dict]], max_tokens: int) -> Callable[[], list]:
    """Kev's run on the chats (it encodes them to the very ids the baselines get)."""
    salts = iter(range(10**6))

    def run() -> list[list[int]]:  # a fresh salt: no run reads an earlier run's prefix blocks
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=f"bench-{next(salts)}")
        return [list(c.token_ids) for c in engine.generate(chats, sampling=sampling)]
    return run


def hf_runners(model: Any, prompts: list[list[int]], max_tokens: int, pad_id: int,
               device: torch.device) -> dict[str, Callable[[], list]]:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=model.config.eos_token_id,
                              pad_token_id=pad_id)

    @torch.inference_mode()
    def serial() -> list[list[int]]:
        out = []
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            out.append(model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)[0, len(ids):]
                       .tolist())
        return out

    @torch.inference_mode()
    def padded() -> list[list[int]]:
        width = max(map(len, prompts))
        x = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        return model.generate(x, attention_mask=mask, generation_config=config)[:, width:].tolist()

    return {"hf_serial": serial, "hf_padded": padded}


def kv_budget(engine: Engine, prompts: list[list[int]], max_tokens: int) -> int:
    """Twice the workload's tokens (prompts + answers) of KV, in whole blocks per question."""
    kv = engine._kv
    blocks = sum(-(-(len(p) + max_tokens) // kv.block_size) for p in prompts)
    return 2 * (blocks + 1) * kv.block_bytes


def decode_step_ms(engine: Engine, chats: list[list[dict]], rows: int,
                   adapters: list[str | None] | None = None) -> float:
    """Milliseconds of one decode step of `rows` questions: the same questions answered to
    STEP_TOKENS[1] and to STEP_TOKENS[0] tokens (no stop), the difference over the steps between.
    `adapters`: each question's adapter (None: the base model's)."""
    device = engine.device
    walls = []
    for tokens in STEP_TOKENS:
        sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, cache_salt=f"step-{tokens}")
        engine.generate(chats[:rows], sampling=sampling, adapters=adapters)  # warm: this row count's graph captured
        sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, cache_salt=f"step-{tokens}-timed")
        walls.append(timed(device, lambda s=sampling: engine.generate(chats[:rows], sampling=s,
                                                                      adapters=adapters))[0])
    return (walls[1] - walls[0]) / (STEP_TOKENS[1] - STEP_TOKENS[0]) * 1e3


ADAPTER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")


def random_adapter(model: Any, folder: Path, rank: int = 16, seed: int = 0) -> Path:
    """A PEFT LoRA adapter folder for Kev's `model`: every projection of every layer, rank `rank`,
    random A and B (small: the answers stay near the base model's)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index in range(len(model.layers)):
        for part in ADAPTER_PARTS:
            name = f"model.layers.{index}.{part}"
            in_features, out_features = model.lora_target(name)
            for key, shape in (("lora_A", (rank, in_features)), ("lora_B", (out_features, rank))):
                tensors[f"base_model.model.{name}.{key}.weight"] = torch.randn(shape, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": [part.split(".")[-1] for part in ADAPTER_PARTS], "base_model_name_or_path": ""}))
    return folder


def adapter_step_ms(engine: Engine, chats: list[list[dict]], rows: int) -> float:
    """A decode step of `rows` questions, every other one on a rank-16 adapter of every projection:
    such a pass runs eagerly (no graph), so this beside `decode_step_ms` is what adapters cost."""
    with tempfile.TemporaryDirectory() as tmp:
        engine.load_adapter("bench", str(random_adapter(engine.model, Path(tmp) / "bench")))
        try:
            return decode_step_ms(engine, chats, rows, ["bench" if i % 2 == 0 else None for i in range(rows)])
        finally:
            engine.unload_adapter("bench")


def device_figures(engine: Engine, chats: list[list[dict]], rates: dict[str, float]) -> dict[str, Any]:
    """The GPU-only figures of one engine: decode steps (with and without adapters) and its weight
    shapes' product rates."""
    return {"decode_step_ms": {str(rows): decode_step_ms(engine, chats, rows) for rows in STEP_ROWS},
            "decode_step_half_on_an_adapter_ms": {str(rows): adapter_step_ms(engine, chats, rows)
                                                  for rows in STEP_ROWS if rows > 1},
            "products": gpu_floor.products(engine.model, engine.device, PRODUCT_ROWS, rates["bf16_flop_s"],
                                           rates["read_bytes_s"])}


def run(device: str = "cuda", source: str | None = None, max_tokens: int = 48,
        workloads: list[str] | None = None, limit: int | None = None, dtype: str | None = None,
        systems: list[str] | None = None) -> dict[str, Any]:
    """The benchmark's JSON result. `source`: a model folder (None: the embedded SmolLM2-135M);
    `limit`: the first N questions of each workload (the CPU format test); `dtype`: None is the
    engine's default (bf16 on CUDA); `systems`: which of SYSTEMS run (default all; "kev" always)."""
    from transformers import AutoModelForCausalLM

    torch_device = loader.resolve_device(device)
    on_gpu = torch_device.type == "cuda"
    from kev_engine.platforms.cuda import choice

    why_not_varlen = choice.varlen_kernel()[2] if on_gpu else "not on CUDA"
    default = [name for name in SYSTEMS if name not in CUDA_ONLY or why_not_varlen is None]
    chosen = ["kev", *[name for name in (systems or default) if name != "kev"]]
    if set(chosen) - set(SYSTEMS):
        raise ValueError(f"systems {sorted(set(chosen) - set(SYSTEMS))} are not allowed; use some of {list(SYSTEMS)}")
    if not on_gpu and set(chosen) & set(CUDA_ONLY):
        raise ValueError(f"systems {sorted(set(chosen) & set(CUDA_ONLY))} run on CUDA only; this run is on {device}")
    names = workloads or list(WORKLOADS)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; use some of {list(WORKLOADS)}")
    folder = source or str(loader.converted_gguf_dir(loader.embedded_gguf()))
    probe = Engine.from_pretrained(folder, device=device, dtype=dtype, cuda_graphs=False, kv_cache_bytes=1 << 26)
    torch_dtype, tokenizer = probe.dtype, probe.tokenizer
    stop = set(probe.eos_ids)
    chats = {name: WORKLOADS[name]()[:limit] for name in names}
    suites = {name: [probe.encode(m) for m in chats[name]] for name in names}
    budgets = {name: kv_budget(probe, prompts, max_tokens) for name, prompts in suites.items()}
    probe.close()
    result: dict[str, Any] = {"model": folder if source else "embedded SmolLM2-135M-Instruct",
                              "device": str(device), "dtype": str(torch_dtype).removeprefix("torch."),
                              "max_tokens": max_tokens, "workloads": {}}
    if "kev_varlen" not in chosen:
        result["kev_varlen_not_run"] = why_not_varlen or "not asked for"
    rates = gpu_floor.rates(torch_device) if on_gpu else None
    result["rates"] = rates
    for name, prompts in suites.items():
        systems: dict[str, dict[str, Any]] = {}
        for system, attention in (("kev", None), ("kev_varlen", "varlen")):
            if system not in chosen:
                continue
            engine = Engine.from_pretrained(folder, device=device, dtype=torch_dtype, kv_cache_bytes=budgets[name],
                                            cuda_attention=attention)
            result.setdefault(f"{system}_engine", {"attention": engine.attention, "cuda_graphs": engine.cuda_graphs,
                                                   "batch_invariant": engine.batch_invariant})
            kev = kev_runner(engine, chats[name], max_tokens)
            kev()  # warm-up on the whole workload: graphs captured, kernels compiled
            systems[system] = measure(torch_device, kev)
            systems[system]["kv_cache_bytes"] = budgets[name]
            systems[system]["prefill_s"] = timed(torch_device, kev_runner(engine, chats[name], 1))[0]
            shape = gpu_floor.Shape.of(engine.model)
            if system == "kev" and rates is not None and "device_figures" not in result:
                result["device_figures"] = device_figures(engine, chats.get("rag16", chats[name]), rates)
            engine.close()
            del engine, kev
        if set(chosen) & {"hf_serial", "hf_padded"}:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation="sdpa")
            model = model.to(torch_device).eval()
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop)
            for system, runner in hf_runners(model, prompts, max_tokens, pad, torch_device).items():
                if system in chosen:
                    runner_warm = hf_runners(model, prompts[:1], max_tokens, pad, torch_device)[system]
                    runner_warm()
                    systems[system] = measure(torch_device, runner)
            del model
        if on_gpu:
            torch.cuda.empty_cache()
        reference = systems["hf_serial"].pop("answers") if "hf_serial" in systems else None
        for system in chosen:
            answers = [strip_stop(a, stop) for a in systems[system].pop("answers", reference)]
            systems[system]["generated_tokens"] = sum(map(len, answers))
            systems[system]["tokens_per_s"] = systems[system]["generated_tokens"] / systems[system]["wall_s"]
            systems[system]["answers_equal_to_hf_serial"] = None if reference is None else sum(
                a == strip_stop(b, stop) for a, b in zip(answers, reference))
        row: dict[str, Any] = {"questions": len(prompts), "prompt_tokens": sum(map(len, prompts)), "systems": systems}
        for system in chosen[1:]:
            row[f"kev_speedup_vs_{system}"] = systems[system]["wall_s"] / systems["kev"]["wall_s"]
        if rates is not None:
            row["floor"] = gpu_floor.floor(shape, list(map(len, prompts)), max_tokens, rates["read_bytes_s"],
                                           rates["bf16_flop_s"])
            row["kev_over_floor"] = systems["kev"]["wall_s"] / row["floor"]["floor_s"]
        result["workloads"][name] = row
    return result


def measure(device: torch.device, runner: Callable[[], list[list[int]]]) -> dict[str, Any]:
    wall, answers, peak = timed(device, runner)
    return {"wall_s": wall, "peak_device_mib": peak, "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS))
    parser.add_argument("--dtype", default=None, help="default: the engine's (bf16 on CUDA)")
    parser.add_argument("--limit", type=int, default=None, help="the first N questions of each workload")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=None, help="default: all")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run(args.device, args.model, args.max_tokens, args.workload, limit=args.limit, dtype=args.dtype,
                 systems=args.systems)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
