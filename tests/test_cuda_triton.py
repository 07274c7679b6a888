"""Kev's Triton kernels for batch invariance on CUDA, run by Triton's interpreter on CPU.

`TRITON_INTERPRET=1` executes the kernels' Python on CPU tensors (numpy underneath), so their
plumbing runs on every CI machine: strides, masks of partial tiles (M, N and K not multiples of
64), bias, dtype casts, results equal to torch's ops up to rounding, and a row's result the same
alone as among 1, 3, 70 or 130 rows, within rounding. Then the whole batch-invariant CUDA
engine path with those kernels and varlen_attn's stand-ins (tests/varlen_contract.py), in the
paged form and in torch 2.11's gathered one, and with Kev's own Triton attention: installed on
the model, num_splits=1, LoRA deltas by the same products, decode graphs' static path (paged
forms) — packed gives the same tokens as alone
with a shared document and an adapter, logits within rounding, and the model comes back as it was.
Not bitwise here: the interpreter computes `tl.dot` with numpy, whose BLAS may sum a row in
another order by its place in the tile (it does on some CPUs), and the stand-in's attention is
torch's CPU SDPA per segment, no invariant kernel. That the real kernels give packed == alone bit
for bit is tests/test_cuda.py's claim, on a GPU. The interpreter must be set before Triton
compiles anything, hence a fresh process. What the GPU's own arithmetic gives only
`make gpu-check` shows (tests/test_cuda.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)

CHECK = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from kev_engine.platforms.cuda import triton_kernels as cuda_triton

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        weight, bias = torch.randn(96, 80, dtype=dtype), torch.randn(96, dtype=dtype)
        rows = torch.randn(130, 80, dtype=dtype)
        alone = [cuda_triton.linear(rows[i:i + 1], weight, bias) for i in range(130)]
        for m in (1, 3, 70, 130):  # a row alone and among others: close, not bitwise (see the docstring)
            out = cuda_triton.linear(rows[:m], weight, bias)
            torch.testing.assert_close(out.float(), F.linear(rows[:m].float(), weight.float(), bias.float()),
                                       rtol=tol, atol=tol)
            torch.testing.assert_close(out, torch.cat(alone[:m]), rtol=tol, atol=tol)
        packed = cuda_triton.linear(rows.view(10, 13, 80), weight, None)  # [..., K] in, [..., N] out
        assert packed.shape == (10, 13, 96)
        torch.testing.assert_close(packed.float(), F.linear(rows.float(), weight.float()).view(10, 13, 96),
                                   rtol=tol, atol=tol)
        strided = torch.randn(80, 7, dtype=dtype).t()  # last dim not contiguous
        torch.testing.assert_close(cuda_triton.linear(strided, weight, None).float(),
                                   F.linear(strided.float(), weight.float()), rtol=tol, atol=tol)

        # K in chunks (a weight shape's `Tiles`): each chunk a program of its own and a second launch
        # adding them (a decode step's few rows) gives the bits of one program a tile summing its
        # chunks in turn (a prefill's many), at every row count; the control, other chunks, differs
        wide, wide_bias = torch.randn(96, 300, dtype=dtype), torch.randn(96, dtype=dtype)
        many = torch.randn(70, 300, dtype=dtype)
        chunked = cuda_triton.Tiles(64, 64, 64, 4, 3, 128)  # 3 chunks of 2, 2 and the last 1 (partial) steps
        for m in (1, 5, 70):
            spread = cuda_triton.linear(many[:m], wide, wide_bias, tiles=chunked, spread=True)
            assert torch.equal(spread, cuda_triton.linear(many[:m], wide, wide_bias, tiles=chunked, spread=False))
            torch.testing.assert_close(spread.float(), F.linear(many[:m].float(), wide.float(), wide_bias.float()),
                                       rtol=tol, atol=tol * 10)
        whole = cuda_triton.linear(many, wide, wide_bias, tiles=cuda_triton.Tiles(64, 64, 64, 4, 3, 320))
        if dtype == torch.float32:  # bf16's rounding of the output (truncated here) can hide the order
            assert not torch.equal(spread, whole), "the control changed nothing"

        norm = LlamaRMSNorm(72, eps=1e-6).to(dtype)
        norm.weight.data = torch.randn(72, dtype=dtype)
        hidden = torch.randn(1, 70, 72, dtype=dtype)
        out = cuda_triton.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        torch.testing.assert_close(out.float(), norm(hidden).float(), rtol=tol, atol=tol)
        torch.testing.assert_close(out[0], torch.cat([cuda_triton.rms_norm(hidden[:, i:i + 1], norm.weight, 1e-6)[0]
                                                      for i in range(70)]), rtol=tol, atol=tol)
    print("kernels ok")
""")


ELEMENTWISE = textwrap.dedent("""
    import torch
    from kev_engine.models.ops import Ops
    from kev_engine.platforms.cuda import triton_elementwise, triton_kernels

    torch.manual_seed(0)
    reference = Ops()  # torch's formulas, each product and sum rounded to the dtype
    T, heads, kv_heads, dim, width = 9, 6, 2, 80, 1500  # head_dim 80: halves of 40, masked to 64
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # bf16 within its operands' ulps: the interpreter's float32 -> bf16 cast truncates (the GPU's
        # rounds to nearest even, as torch does); float32 and float16 casts are numpy's, rounded as torch's
        same = (lambda a, b: torch.equal(a, b)) if dtype != torch.bfloat16 else (
            lambda a, b: torch.allclose(a.float(), b.float(), rtol=2 ** -6, atol=2 ** -3))
        qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, dtype=dtype)  # a qkv product's output, viewed
        query = qkv[:, :heads * dim].view(T, heads, dim)
        key = qkv[:, heads * dim:(heads + kv_heads) * dim].view(T, kv_heads, dim)
        cos, sin = torch.randn(T, dim).to(dtype), torch.randn(T, dim).to(dtype)
        q_out, k_out = triton_elementwise.rotary_qk(query, key, cos, sin)
        assert same(q_out, reference.rotary(query, cos, sin)) and same(k_out, reference.rotary(key, cos, sin)), dtype
        for m in (1, 4):  # each token by itself
            q_alone, k_alone = triton_elementwise.rotary_qk(query[m:m + 1], key[m:m + 1], cos[m:m + 1], sin[m:m + 1])
            assert torch.equal(q_alone, q_out[m:m + 1]) and torch.equal(k_alone, k_out[m:m + 1])
        if dtype == torch.float16:  # the control: the rotary rounded once, as a fused kernel would, is told apart
            half = dim // 2
            rotated = torch.cat((-query[..., half:], query[..., :half]), dim=-1)
            once = (query.float() * cos.float()[:, None] + rotated.float() * sin.float()[:, None]).to(dtype)
            assert not torch.equal(once, reference.rotary(query, cos, sin)), "the control changed nothing"

        gate_up = torch.randn(T, 2 * width, dtype=dtype)
        out = triton_elementwise.silu_mul(gate_up, width)  # the exp is the kernel's own: close, not bitwise
        torch.testing.assert_close(out.float(), reference.silu_mul(gate_up, width).float(),
                                   rtol=2 ** -6 if dtype != torch.float32 else 1e-5, atol=1e-6)
        assert torch.equal(triton_elementwise.silu_mul(gate_up[3:4], width), out[3:4])

        x, delta = torch.randn(T, 72, dtype=dtype), torch.randn(T, 72, dtype=dtype)
        weight = torch.randn(72, dtype=dtype)
        total, normed = triton_kernels.add_rms_norm(x, delta, weight, 1e-6)
        assert same(total, x + delta), dtype  # the residual: torch's add
        assert torch.equal(normed, triton_kernels.rms_norm(total, weight, 1e-6))  # the norm: the unfused kernel's
        torch.testing.assert_close(normed.float(), reference.rms_norm(x + delta, weight, 1e-6).float(),
                                   rtol=2 ** -6 if dtype != torch.float32 else 1e-5, atol=1e-5)
    print("elementwise ok")
""")


ENGINE = textwrap.dedent("""
    import pathlib, sys, tempfile
    sys.path.insert(0, sys.argv[1])
    import torch
    from transformers import AutoTokenizer
    from conftest import make_adapter, rounding_tolerance, tiny_model
    from test_invariance import alone, answers, greedy, questions
    from varlen_contract import GatheredContract, VarlenContract
    from kev_engine import Engine
    from kev_engine import loader
    from kev_engine.platforms.cuda import choice
    from kev_engine.platforms.cuda import invariant as cuda_invariant
    from kev_engine.platforms.cuda import varlen as cuda_backend
    from kev_engine.platforms.cuda.gathered import GatheredBackend
    from kev_engine.platforms.cuda.triton_paged import TritonBackend

    kind = sys.argv[2]  # "paged" (torch 2.12's varlen_attn), "gathered" (2.10/2.11's) or Kev's "triton"
    paged = kind != "gathered"
    tokenizer = AutoTokenizer.from_pretrained(str(loader.converted_gguf_dir(loader.embedded_gguf())))
    kernel = VarlenContract() if kind == "paged" else GatheredContract()
    backend = {"paged": lambda: cuda_backend.CudaBackend("varlen", kernel, page_multiple=16),
               "gathered": lambda: GatheredBackend(kernel), "triton": TritonBackend}[kind]()
    choice.choose = lambda mode, device, dtype: backend
    base = tiny_model("llama", tokenizer)
    folder = make_adapter(base, pathlib.Path(tempfile.mkdtemp()) / "qv", seed=1)
    engine = Engine(base.to(torch.bfloat16), tokenizer, block_size=16, batch_invariant=True)
    assert engine.batch_invariant and engine.cuda_graphs == paged
    assert engine.attention == ("triton" if kind == "triton" else "varlen")
    assert engine._backend.num_splits == 1 and engine._backend.form == ("gathered" if kind == "gathered" else "paged")
    assert engine.model.ops.name == "cuda-invariant"  # Kev's model: every product and norm by Triton
    engine.load_adapter("qv", str(folder))
    prompts = questions(1, 4, document_words=30)
    names = ["qv", None, "qv", None]
    packed = answers(engine, prompts, greedy(4, 3), names)
    assert engine.stats()["prefix_hit_tokens"] > 0
    solo = alone(engine, prompts, greedy(4, 3), names)
    assert [tokens for tokens, _ in packed] == [tokens for tokens, _ in solo]
    for (_, mine), (_, theirs) in zip(packed, solo):  # close: the emulation's products are numpy's
        torch.testing.assert_close(mine, theirs, rtol=0, atol=rounding_tolerance(theirs, torch.bfloat16))
    assert len({tuple(tokens) for tokens, _ in packed}) > 1
    if paged:
        assert engine._runner.graphs.replays > 0
    if kind == "paged":
        assert {call["num_splits"] for call in kernel.calls} == {1}
    elif kind == "gathered":
        assert kernel.calls and min(call["max_q"] for call in kernel.calls) == 2
    engine.close()
    assert not any(cuda_invariant._is_ours(m.__dict__.get("forward")) for m in base.modules())
    print("engine ok")
""")


GRAPHS = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from transformers import AutoTokenizer
    from conftest import QUESTIONS, prefilled_decode_pack, tiny_model
    from test_invariance import reorder_by_pass_size
    from kev_engine import Engine, loader
    from kev_engine.platforms.cuda import choice
    from kev_engine.platforms.cuda.triton_paged import TritonBackend

    tokenizer = AutoTokenizer.from_pretrained(str(loader.converted_gguf_dir(loader.embedded_gguf())))
    control = sys.argv[2] == "control"
    backend = TritonBackend()
    choice.choose = lambda mode, device, dtype: backend
    engine = Engine(tiny_model("llama", tokenizer).to(torch.bfloat16), tokenizer, block_size=16, batch_invariant=True)
    assert engine.cuda_graphs and engine.attention == "triton" and engine.model.ops.name == "cuda-invariant"
    if control:
        reorder_by_pass_size(engine.model)  # the down projections summed in an order set by the pass's rows
    decode = prefilled_decode_pack(engine, QUESTIONS[:3])  # 3 live rows: a bucket of 4, one padding row
    via_bucket = engine._runner.graphs.run(decode)
    eager = engine.model.forward(decode, backend)
    assert via_bucket.shape == eager.shape == (3, engine.model.config.vocab_size)
    assert torch.equal(via_bucket, eager) != control, "the control changed nothing" if control else "graphs != eager"
    engine.close()
    print("graphs ok")
""")


def interpreted(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=900)


def test_triton_kernels_in_the_interpreter() -> None:
    done = interpreted(CHECK)
    assert done.returncode == 0 and "kernels ok" in done.stdout, done.stderr[-3000:]


def test_elementwise_kernels_in_the_interpreter() -> None:
    """The fused rotary of queries and keys, silu·mul and the residual add with RMSNorm against
    torch's formulas: the rotary and the add bit for bit where the interpreter rounds as the GPU
    does (float32, float16), with a control that rounds once; silu close (its exp is Triton's)."""
    done = interpreted(ELEMENTWISE)
    assert done.returncode == 0 and "elementwise ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("case", ["invariant", "control"])
def test_decode_bucket_equals_eager_bitwise_in_the_interpreter(case) -> None:
    """With Kev's Triton attention and products, a decode pass through its graph bucket (the static
    path, a padding row on the trash block) gives the eager logits bit for bit: a live row sits at
    the same place of every tile either way. The control, the down projections summed in an order
    the pass's row count sets, differs."""
    done = interpreted(GRAPHS, TESTS, case)
    assert done.returncode == 0 and "graphs ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("form", ["paged", "gathered", "triton"])
def test_batch_invariant_cuda_path_in_the_interpreter(form) -> None:
    done = interpreted(ENGINE, TESTS, form)
    assert done.returncode == 0 and "engine ok" in done.stdout, done.stderr[-3000:]
