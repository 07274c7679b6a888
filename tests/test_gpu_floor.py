"""The GPU benchmark's floor (benchmarks/gpu_floor.py): its arithmetic, on CPU.

The rates it divides by are measured on the GPU in the same run (`make gpu-check`); here a
floor worked by hand, a model's shape read from Kev's model, whose product flops per token must
be twice the parameters of its layers' products, and the measurements' code run small on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_model

from kev_engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_gpu  # noqa: E402
import gpu_floor  # noqa: E402


def test_floor_by_hand() -> None:
    """One layer of width 2, one head of 2, MLP 2, vocab 3, 100 weight bytes; a 2-token prompt, 2 tokens.
    Products: 2 × (q, k, v 12 + o 4 + MLP 12) = 56 flops a token; head 12. Prefill: 2 tokens' 112,
    one head row 12, attention over 3 pairs 24 → 148 flops (1.48 s at 100 flop/s) against 1 s of bytes.
    Decode step 1: 3 keys of 8 bytes beside the weights, 124 bytes (1.24 s) against 92 flops."""
    shape = gpu_floor.Shape(layers=1, hidden=2, heads=1, kv_heads=1, head_dim=2, intermediate=2, vocab=3,
                            weight_bytes=100)
    assert shape.product_flops_per_token == 56 and shape.kv_bytes_per_token == 8
    found = gpu_floor.floor(shape, [2], max_tokens=2, read_bytes_s=100.0, flop_s=100.0)
    assert found == pytest.approx({"prefill_s": 1.48, "decode_s": 1.24, "floor_s": 2.72})
    longer = gpu_floor.floor(shape, [2], max_tokens=3, read_bytes_s=100.0, flop_s=100.0)
    assert longer["decode_s"] == pytest.approx(1.24 + 1.32)  # step 2 reads one key more


def test_shape_of_kevs_model(tokenizer) -> None:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer)
    try:
        model = engine.model
        shape = gpu_floor.Shape.of(model)
        assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate) == (
            2, 64, 4, 2, 16, 128)
        assert shape.vocab == len(tokenizer) and shape.weight_bytes == model.weight_bytes() and shape.dtype_bytes == 4
        products = sum(getattr(layer, name).out_features * getattr(layer, name).in_features
                       for layer in model.layers for name in ("qkv", "o", "gate_up", "down"))
        assert shape.product_flops_per_token == 2 * products
    finally:
        engine.close()


def test_rates_and_a_decode_step_run(tokenizer) -> None:
    """What `make gpu-check` measures first runs here, small, on the CPU: its plumbing, not a figure."""
    import torch

    found = gpu_floor.rates(torch.device("cpu"), read_bytes=1 << 20, size=64)
    assert set(found) == {"read_bytes_s", "bf16_flop_s"} and min(found.values()) > 0
    engine = Engine(tiny_model("llama", tokenizer), tokenizer)
    try:
        chats = [[{"role": "user", "content": f"Question {i}?"}] for i in range(2)]
        assert isinstance(bench_gpu.decode_step_ms(engine, chats, 2), float)
        assert engine.stats()["generated_tokens"] == 2 * 2 * sum(bench_gpu.STEP_TOKENS)  # no stop token ended one
        assert isinstance(bench_gpu.adapter_step_ms(engine, chats, 2), float)  # one of the two on a random adapter
        assert engine.stats()["generated_tokens"] == 2 * 2 * 2 * sum(bench_gpu.STEP_TOKENS)
        assert "bench" not in engine.adapters  # unloaded after
    finally:
        engine.close()


PRODUCTS = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    import torch
    from conftest import tiny_model
    from transformers import AutoTokenizer
    import gpu_floor
    from kev_engine import Engine, loader

    tokenizer = AutoTokenizer.from_pretrained(str(loader.converted_gguf_dir(loader.embedded_gguf())))
    engine = Engine(tiny_model("llama", tokenizer), tokenizer)
    try:
        found = gpu_floor.products(engine.model, torch.device("cpu"), 8, 1e9, 1e9, decode_rows=2)
    finally:
        engine.close()
    assert {tuple(row["weights"]) for row in found} >= {("head",)}
    for row in found:
        assert row["chunks"] >= 1 and row["tiles"].count("x") == 2 and row["weight_read_us"] > 0
        assert min(row[key] for key in ("decode_spread_us", "decode_one_program_a_tile_us", "decode_torch_us")) > 0
    print("products ok")
""")


def test_products_run_in_the_interpreter() -> None:
    """The products' timings (`make gpu-check`'s) run small under Triton's interpreter: each weight
    shape's tiles and chunks, a few rows spread and not; their plumbing, not a figure."""
    benchmarks = str(Path(__file__).resolve().parent.parent / "benchmarks")
    done = subprocess.run([sys.executable, "-c", PRODUCTS, str(Path(__file__).resolve().parent), benchmarks],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "products ok" in done.stdout, done.stderr[-3000:]
