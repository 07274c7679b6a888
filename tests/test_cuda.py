"""What only a GPU shows: torch's varlen_attn, Kev's Triton products, CUDA graphs and the GPU's memory.

Marked `cuda`: deselected by default (pyproject's addopts), run by `make gpu-check`
(`pytest -m cuda`), where a missing GPU is an error, never a skip. The CPU suite checks the same
plumbing against a stand-in of varlen_attn's contract (tests/test_cuda_backend.py); here the real
kernels run:
  - varlen_attn through the block table against SDPA per segment, and one segment's output the
    same bits alone as among others (num_splits=1);
  - packed == alone bitwise in bf16 (shared documents, a later call on the prefix cache, chunked
    prefill, per-question adapters, the embedded model), and the control that can fail;
  - decode through CUDA graphs == eager, bitwise;
  - bf16, varlen, graphs and batch invariance by default; the KV budget from free GPU memory.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import make_adapter, tiny_model
from test_invariance import alone, answers, differences, doc_questions, greedy, questions
from varlen_contract import VarlenContract

from kev_engine import Engine
from kev_engine.core.blocks import blocks_for
from kev_engine.platforms.cuda import varlen as cuda_backend
from kev_engine.platforms.cuda.varlen import PagedTables

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the cuda tests need a CUDA GPU (torch.cuda.is_available() is False); "
                    "`make gpu-check` runs them on one")
    return torch.device("cuda")


def cuda_engine(family: str, tokenizer, cuda: torch.device, **kwargs) -> Engine:
    return Engine(tiny_model(family, tokenizer).to(cuda, torch.bfloat16), tokenizer, name=family, **kwargs)


def test_defaults_on_a_gpu(cuda) -> None:
    """bf16, torch's varlen_attn, decode graphs and batch invariance, nothing asked for."""
    engine = Engine.from_pretrained(device="cuda")
    try:
        assert engine.dtype == torch.bfloat16 and engine.device.type == "cuda"
        assert engine.attention == "varlen" and engine.cuda_graphs and engine.batch_invariant
        assert engine._backend.num_splits == 1
    finally:
        engine.close()


def paged_case(cuda: torch.device, segments: list[tuple[int, int]], heads: int = 8, kv_heads: int = 2,
               head_dim: int = 64, page: int = 256, seed: int = 0):
    """A pool of pages (NaN wherever no segment reads), a pack of (past, new) segments over it, and its queries."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [past + new for past, new in segments]
    num_pages = sum(blocks_for(n, page) for n in lengths) + 3
    keys = torch.full((num_pages, page, kv_heads, head_dim), math.nan, dtype=torch.bfloat16)
    values = keys.clone()
    order = torch.randperm(num_pages, generator=generator).tolist()  # pages scattered through the pool
    tables, cursor = [], 0
    for n in lengths:
        pages = order[cursor: cursor + blocks_for(n, page)]
        cursor += len(pages)
        flat = torch.randn(len(pages) * page, kv_heads, head_dim, generator=generator)
        for i, p in enumerate(pages):
            stop = min(page, n - i * page)
            keys[p, :stop] = flat[i * page: i * page + stop].to(torch.bfloat16)
            values[p, :stop] = torch.randn(stop, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
        tables.append(pages)
    width = max(map(len, tables))
    news = [new for _, new in segments]
    query = torch.randn(heads, sum(news), head_dim, generator=generator).to(torch.bfloat16)
    cu_q = [0]
    for new in news:
        cu_q.append(cu_q[-1] + new)
    cu_k = [0]
    for n in lengths:
        cu_k.append(cu_k[-1] + n)

    def int32(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=cuda)

    pool = SimpleNamespace(keys=[keys.to(cuda)], values=[values.to(cuda)], block_size=page)
    batch = SimpleNamespace(
        cu_seqlens=int32(cu_q), max_seqlen=max(news),
        attention=PagedTables(cu_seqlens_k=int32(cu_k), max_seqlen_k=max(lengths),
                          block_table=int32([t + [0] * (width - len(t)) for t in tables]), seqused_k=int32(lengths)),
    )
    return batch, pool, query.to(cuda)


def attend(backend: cuda_backend.CudaBackend, pool, batch, query: torch.Tensor) -> torch.Tensor:
    """The backend's one call of layer 0 on `pool` (the new keys are in it already)."""
    return backend.bind(pool).attend(0, batch, query, None, None, None)


SEGMENTS = [(0, 37), (300, 1), (0, 1), (700, 64), (255, 1), (1024, 1), (10, 300)]  # prefill, chunks, decode rows


@pytest.mark.parametrize("num_splits", [1, None], ids=["unsplit", "kernel-chosen"])
def test_varlen_paged_matches_sdpa_per_segment(cuda, num_splits) -> None:
    """torch's kernel through the block table (pages scattered, NaN where nothing is read, GQA,
    bottom-right causal) against SDPA per segment in float32."""
    batch, pool, query = paged_case(cuda, SEGMENTS)
    kernel = cuda_backend.CudaBackend("varlen", cuda_backend.varlen_function()[0], num_splits=num_splits)
    out = attend(kernel, pool, batch, query)
    fp32 = SimpleNamespace(keys=[pool.keys[0].float()], values=[pool.values[0].float()], block_size=pool.block_size)
    expected = attend(cuda_backend.CudaBackend("varlen", VarlenContract()), fp32, batch, query.float())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_varlen_unsplit_is_the_same_alone_and_among_others(cuda) -> None:
    """num_splits=1: each segment's output has the same bits whatever else is in the call."""
    kernel = cuda_backend.CudaBackend("varlen", cuda_backend.varlen_function()[0], num_splits=1)
    batch, pool, query = paged_case(cuda, SEGMENTS)
    together = attend(kernel, pool, batch, query)
    cu = batch.cu_seqlens.tolist()
    for i in range(len(SEGMENTS)):
        paged = batch.attention
        one = SimpleNamespace(
            cu_seqlens=torch.tensor([0, cu[i + 1] - cu[i]], dtype=torch.int32, device=cuda),
            max_seqlen=cu[i + 1] - cu[i],
            attention=PagedTables(cu_seqlens_k=torch.stack([paged.cu_seqlens_k[0] * 0, paged.seqused_k[i]]),
                              max_seqlen_k=int(paged.seqused_k[i]), block_table=paged.block_table[i: i + 1],
                              seqused_k=paged.seqused_k[i: i + 1]))
        alone_out = attend(kernel, pool, one, query[:, cu[i]: cu[i + 1]])
        assert torch.equal(alone_out, together[cu[i]: cu[i + 1]]), f"segment {i} {SEGMENTS[i]}"


def test_triton_products_are_row_count_invariant(cuda) -> None:
    from kev_engine.platforms.cuda import triton_kernels as cuda_triton

    torch.manual_seed(0)
    weight = torch.randn(576, 576, device=cuda, dtype=torch.bfloat16)
    rows = torch.randn(700, 576, device=cuda, dtype=torch.bfloat16)
    full = cuda_triton.linear(rows, weight, None)
    torch.testing.assert_close(full.float(), F.linear(rows.float(), weight.float()), rtol=2e-2, atol=0.5)
    for m in (1, 2, 3, 17, 64, 65, 333):
        assert torch.equal(cuda_triton.linear(rows[:m], weight, None), full[:m]), m


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_equals_alone_bitwise_bf16(cuda, family, tokenizer) -> None:
    engine = cuda_engine(family, tokenizer, cuda)
    try:
        assert engine.batch_invariant and engine.attention == "varlen"
        prompts = questions(1, 10, document_words=400)  # a document over one 256-token block
        packed = answers(engine, prompts, greedy(10, 16))
        assert engine.stats()["prefix_hit_tokens"] > 0  # the shared document was computed once
        assert differences(packed, alone(engine, prompts, greedy(10, 16))) == []
        before = engine.stats()["prefix_hit_tokens"]
        again = answers(engine, prompts[:3], greedy(3, 16))  # a later call, on the prefix cache
        assert engine.stats()["prefix_hit_tokens"] > before
        assert differences(again, packed[:3]) == []
    finally:
        engine.close()


def test_chunked_prefill_equals_alone_bf16(cuda, tokenizer) -> None:
    prompts = questions(2, 8, document_words=400)  # over one 256-token block each
    whole = cuda_engine("llama", tokenizer, cuda)
    chunked = cuda_engine("llama", tokenizer, cuda, max_batch_tokens=100, max_num_seqs=4)
    try:
        found = differences(answers(chunked, prompts, greedy(8, 12)), alone(whole, prompts, greedy(8, 12)))
        assert chunked.stats()["prefill_passes"] > 8 and found == []
    finally:
        whole.close()
        chunked.close()


def test_per_question_adapters_equal_alone_bf16(cuda, tokenizer, tmp_path) -> None:
    base = tiny_model("qwen2", tokenizer)
    folders = {
        "qv": make_adapter(base, tmp_path / "qv", seed=1),
        "all": make_adapter(base, tmp_path / "all", seed=2, r=8, lora_alpha=16, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    }
    engine = Engine(base.to(cuda, torch.bfloat16), tokenizer)
    try:
        assert engine.batch_invariant
        for name, folder in folders.items():
            engine.load_adapter(name, str(folder))
        prompts = questions(3, 9, document_words=400)  # questions 0 and 6 (qv), 4 and 8 (all) share it
        names = [("qv", "all", None)[i % 3] for i in range(9)]
        packed = answers(engine, prompts, greedy(9, 12), names)
        assert engine.stats()["prefix_hit_tokens"] > 0
        assert differences(packed, alone(engine, prompts, greedy(9, 12), names)) == []
        assert len({tuple(tokens) for tokens, _ in packed}) > 1
    finally:
        engine.close()


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["invariant", "control"])
def test_embedded_model_packed_equals_alone_bf16(cuda, batch_invariant) -> None:
    """Six questions on one document. The control (cuBLAS, varlen_attn splitting as it likes)
    differs: the comparison can fail."""
    engine = Engine.from_pretrained(device="cuda", batch_invariant=batch_invariant)
    try:
        prompts = doc_questions()
        found = differences(answers(engine, prompts, greedy(6, 24)), alone(engine, prompts, greedy(6, 24)))
        assert (found == []) if batch_invariant else (found != [])
    finally:
        engine.close()


def test_graph_replay_equals_eager_bitwise(cuda, tokenizer) -> None:
    """Decode through captured graphs (buckets padded with trash-block rows) against eager decode:
    the same tokens and logits, bit for bit."""
    prompts = questions(6, 11)  # 11 rows: buckets of 16, 8, 4 ... as questions finish
    graphed = cuda_engine("llama", tokenizer, cuda)
    eager = cuda_engine("llama", tokenizer, cuda, cuda_graphs=False)
    try:
        assert graphed.cuda_graphs and not eager.cuda_graphs
        found = differences(answers(graphed, prompts, greedy(11, 20)), answers(eager, prompts, greedy(11, 20)))
        assert found == []
        assert graphed._runner.graphs.replays > 0 and all(graphed._runner.graphs.statics[b].graph is not None
                                                    for b in graphed._runner.graphs.captured)
    finally:
        graphed.close()
        eager.close()


def test_kv_budget_is_half_the_free_gpu_memory(cuda, tokenizer) -> None:
    """With no kv_cache_bytes, the pool takes half of what is free once the model is loaded (a
    context long enough that the useful-tokens cap does not bind), one block kept for graphs."""
    model = tiny_model("llama", tokenizer, max_position_embeddings=1 << 22).to(cuda, torch.bfloat16)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(cuda)
    engine = Engine(model, tokenizer, max_num_seqs=64)
    try:
        kv = engine._kv
        cap = blocks_for(2 * 64 * engine.max_context, kv.block_size) * kv.block_bytes
        assert free // 2 < cap  # the free-memory branch, not the cap
        expected = int(free * 0.5) // kv.block_bytes * kv.block_bytes
        budget = engine.stats()["kv_cache_budget_bytes"] + kv.block_bytes  # the trash block
        assert expected - (64 << 20) <= budget <= expected
    finally:
        engine.close()
        del engine
        torch.cuda.empty_cache()
