"""What only a GPU shows: torch's varlen_attn, Kev's Triton products, CUDA graphs and the GPU's memory.

Marked `cuda`: deselected by default (pyproject's addopts), run by `make gpu-check`
(`pytest -m cuda`), where a missing GPU is an error, never a skip. The CPU suite checks the same
plumbing against stand-ins of varlen_attn's contracts (tests/test_cuda_backend.py); here the real
kernels run, in the form the installed torch has (paged from torch 2.12, gathered in 2.10/2.11):
  - varlen_attn and Kev's Triton attention through the engine's backends against SDPA per
    segment, and one segment's output the same bits alone as among others (Triton's with a
    control whose key blocks follow the pass);
  - packed == alone bitwise in bf16 on both (shared documents, a later call on the prefix cache,
    chunked prefill, per-question adapters, a model of the embedded one's shape), and the
    controls that can fail;
  - decode through CUDA graphs == eager, bitwise (Kev's Triton attention on every torch, varlen's
    paged form; its gathered form has none);
  - bf16, a paged attention, graphs and batch invariance by default; the KV budget from free
    GPU memory.
Models are random-weight, built on the GPU from the embedded model's config and tokenizer files
(`KEV_TEST_MODEL_FILES` where the embedded model is not installed): nothing large is carried.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model, two_adapters
from test_invariance import alone, answers, differences, doc_questions, greedy, questions, reorder_by_pass_size
from varlen_contract import GatheredContract, VarlenContract

from kev_engine import Engine
from kev_engine.core.blocks import blocks_for
from kev_engine.model.pack import Segment
from kev_engine.platforms.cuda import choice
from kev_engine.platforms.cuda import varlen as cuda_backend
from kev_engine.platforms.cuda.gathered import GatheredBackend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import random_models  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the cuda tests need a CUDA GPU (torch.cuda.is_available() is False); "
                    "`make gpu-check` runs them on one")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def form(cuda) -> str:
    """The form of this torch's varlen_attn: "paged" or "gathered"; none at all fails."""
    function, found, why = choice.varlen_kernel()
    if function is None:
        pytest.fail(f"no usable varlen_attn: {why}")
    return found


@pytest.fixture(scope="module")
def smollm2_folder(cuda, tmp_path_factory, request) -> Path:
    """A model of the embedded SmolLM2-135M's shape (its config and tokenizer), random bf16 weights
    made on the GPU."""
    files = os.environ.get("KEV_TEST_MODEL_FILES") or request.getfixturevalue("embedded_dir")
    folder = random_models.build(Path(files), "smollm2-135m", tmp_path_factory.mktemp("smollm2"), device="cuda")
    torch.cuda.empty_cache()
    return folder


ATTENTIONS = ["varlen", "triton"]  # torch's varlen_attn in this torch's form, and Kev's Triton kernel


def cuda_engine(family: str, tokenizer, cuda: torch.device, **kwargs) -> Engine:
    return Engine(tiny_model(family, tokenizer).to(cuda, torch.bfloat16), tokenizer, name=family, **kwargs)


def installed_backend(form: str, num_splits: int | None = None) -> cuda_backend.VarlenBackend:
    function, _, _ = choice.varlen_kernel()
    backend = choice.backend_for("varlen", function, form)
    backend.num_splits = num_splits
    return backend


def contract_backend(form: str) -> cuda_backend.VarlenBackend:
    """The same form over the plain-torch stand-in of its contract: the reference."""
    if form == "paged":
        return cuda_backend.CudaBackend("varlen", VarlenContract())
    return GatheredBackend(GatheredContract())


def test_defaults_on_a_gpu(cuda, form, smollm2_folder) -> None:
    """bf16, torch's varlen_attn where it is paged (else Kev's Triton attention), decode graphs, and
    batch invariance, nothing asked for."""
    engine = Engine.from_pretrained(str(smollm2_folder), device="cuda")
    try:
        assert engine.dtype == torch.bfloat16 and engine.device.type == "cuda"
        assert engine.attention == ("varlen" if form == "paged" else "triton") and engine._backend.form == "paged"
        assert engine.batch_invariant and engine.cuda_graphs and engine._backend.num_splits == 1
    finally:
        engine.close()


def varlen_case(cuda: torch.device, shapes: list[tuple[int, int]], heads: int = 8, kv_heads: int = 2,
                head_dim: int = 64, page: int = 256, seed: int = 0):
    """A pool of pages (NaN wherever no segment reads), the (past, new) segments over it, their
    cu_seqlens and queries [H, T, D]."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [past + new for past, new in shapes]
    num_pages = sum(blocks_for(n, page) for n in lengths) + 3
    keys = torch.full((num_pages, page, kv_heads, head_dim), math.nan, dtype=torch.bfloat16)
    values = keys.clone()
    order = torch.randperm(num_pages, generator=generator).tolist()  # pages scattered through the pool
    segments, cursor = [], 0
    for i, ((past, new), n) in enumerate(zip(shapes, lengths)):
        pages = order[cursor: cursor + blocks_for(n, page)]
        cursor += len(pages)
        for j, p in enumerate(pages):
            stop = min(page, n - j * page)
            keys[p, :stop] = torch.randn(stop, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
            values[p, :stop] = torch.randn(stop, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
        segments.append(Segment(i, [0] * new, past, True, block_ids=pages))
    cu_q = [0]
    for _, new in shapes:
        cu_q.append(cu_q[-1] + new)
    query = torch.randn(heads, cu_q[-1], head_dim, generator=generator).to(torch.bfloat16)
    pool = SimpleNamespace(keys=[keys.to(cuda)], values=[values.to(cuda)], block_size=page)
    return segments, pool, cu_q, query.to(cuda)


def attend(backend: cuda_backend.VarlenBackend, pool, segments: list[Segment], cu_q: list[int],
           query: torch.Tensor) -> torch.Tensor:
    """The backend's one call of layer 0 on `pool` (the new keys are in it already), planned as a pass plans it."""
    backend.bind(pool)
    device = query.device
    batch = SimpleNamespace(cu_seqlens=torch.tensor(cu_q, dtype=torch.int32, device=device), cu_seqlens_list=cu_q,
                            max_seqlen=max(b - a for a, b in zip(cu_q, cu_q[1:])),
                            attention=backend.plan(segments, cu_q, device))
    return backend.attend(0, batch, query, None, None, None)


SEGMENTS = [(0, 37), (300, 1), (0, 1), (700, 64), (255, 1), (1024, 1), (10, 300)]  # prefill, chunks, decode rows


@pytest.mark.parametrize("num_splits", [1, None], ids=["unsplit", "kernel-chosen"])
def test_varlen_matches_sdpa_per_segment(cuda, form, num_splits) -> None:
    """torch's kernel in this torch's form (pages scattered, NaN where nothing is read, GQA,
    bottom-right causal) against its contract's stand-in in float32."""
    segments, pool, cu_q, query = varlen_case(cuda, SEGMENTS)
    out = attend(installed_backend(form, num_splits), pool, segments, cu_q, query)
    fp32 = SimpleNamespace(keys=[pool.keys[0].float()], values=[pool.values[0].float()], block_size=pool.block_size)
    expected = attend(contract_backend(form), fp32, segments, cu_q, query.float())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_varlen_unsplit_is_the_same_alone_and_among_others(cuda, form) -> None:
    """Each segment's output has the same bits whatever else is in the call (num_splits=1 where
    paged; the gathered form never splits)."""
    kernel = installed_backend(form, num_splits=1)
    segments, pool, cu_q, query = varlen_case(cuda, SEGMENTS)
    together = attend(kernel, pool, segments, cu_q, query)
    for i, segment in enumerate(segments):
        n = cu_q[i + 1] - cu_q[i]
        alone_out = attend(kernel, pool, [segment], [0, n], query[:, cu_q[i]: cu_q[i + 1]])
        assert torch.equal(alone_out, together[cu_q[i]: cu_q[i + 1]]), f"segment {i} {SEGMENTS[i]}"


@pytest.mark.parametrize("page", [256, 16])
def test_triton_attention_matches_sdpa_per_segment(cuda, page) -> None:
    """Kev's Triton attention (pages scattered, NaN where nothing is read, GQA, bottom-right causal)
    against the paged contract's stand-in in float32, on tensor cores."""
    from kev_engine.platforms.cuda.triton_paged import TritonBackend

    segments, pool, cu_q, query = varlen_case(cuda, SEGMENTS, page=page)
    out = attend(TritonBackend(), pool, segments, cu_q, query)
    fp32 = SimpleNamespace(keys=[pool.keys[0].float()], values=[pool.values[0].float()], block_size=pool.block_size)
    expected = attend(contract_backend("paged"), fp32, segments, cu_q, query.float())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape_dependent", [False, True], ids=["invariant", "control"])
def test_triton_attention_rows_equal_alone(cuda, shape_dependent) -> None:
    """Each segment's rows have the same bits alone as among the others, and a prompt's the same
    whole as in chunks continuing its cache. The control (key blocks sized by the pass) differs:
    a difference is found where the order moves, so the comparison can fail on this GPU."""
    from kev_engine.platforms.cuda.triton_paged import TritonBackend

    kernel = TritonBackend(shape_dependent=shape_dependent)
    segments, pool, cu_q, query = varlen_case(cuda, SEGMENTS, page=16)
    together = attend(kernel, pool, segments, cu_q, query)
    found = []
    for i, segment in enumerate(segments):
        alone_out = attend(kernel, pool, [segment], [0, cu_q[i + 1] - cu_q[i]], query[:, cu_q[i]: cu_q[i + 1]])
        if not torch.equal(alone_out, together[cu_q[i]: cu_q[i + 1]]):
            found.append(i)
    last = segments[-1]  # (10 cached, 300 new): chunks of 100 continuing its own cache, one pass each
    for done in (0, 100, 200):
        chunk = Segment(0, [0] * 100, last.past_len + done, True, block_ids=last.block_ids)
        start = cu_q[-2] + done
        if not torch.equal(attend(kernel, pool, [chunk], [0, 100], query[:, start: start + 100]),
                           together[start: start + 100]):
            found.append(f"chunk at {done}")
    assert (found != []) if shape_dependent else (found == [])


@pytest.mark.parametrize("n,k", [(576, 576), (896, 4864), (1536, 4096)])
def test_triton_products_are_row_count_invariant(cuda, n, k) -> None:
    """Each row the same bits alone as among 2,048, on shapes with small tiles and one chunk, small
    tiles and K in chunks, and the large weights' 128 x 128 tiles in chunks: where K has chunks,
    a few rows spread them over programs and 2,048 sum them in one program a tile — the same bits.
    The control: the same shape's K in other chunks differs."""
    from kev_engine.platforms.cuda import triton_kernels as cuda_triton

    torch.manual_seed(0)
    weight = torch.randn(n, k, device=cuda, dtype=torch.bfloat16)
    rows = torch.randn(2048, k, device=cuda, dtype=torch.bfloat16)
    full = cuda_triton.linear(rows, weight, None)
    torch.testing.assert_close(full.float(), F.linear(rows.float(), weight.float()), rtol=2e-2, atol=1.0)
    for m in (1, 2, 3, 17, 64, 65, 333, 1500):
        assert torch.equal(cuda_triton.linear(rows[:m], weight, None), full[:m]), m
    tiles = cuda_triton.tiles_for(n, k, torch.bfloat16)
    if tiles.splits(k) > 1:
        assert torch.equal(cuda_triton.linear(rows, weight, None, spread=True), full)
        other = dataclasses.replace(tiles, chunk=tiles.chunk + tiles.bk)
        assert not torch.equal(cuda_triton.linear(rows, weight, None, tiles=other), full), "the control changed nothing"


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_equals_alone_bitwise_bf16(cuda, family, attention, tokenizer) -> None:
    engine = cuda_engine(family, tokenizer, cuda, cuda_attention=attention, block_size=256)
    try:
        assert engine.batch_invariant and engine.attention == attention
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


@pytest.mark.parametrize("shape_dependent", [False, True], ids=["invariant", "control"])
def test_triton_engine_packed_equals_alone_bf16(cuda, shape_dependent, tokenizer) -> None:
    """Kev's Triton attention in an engine, with decode graphs, chunked prefill and a shared document:
    packed == alone bitwise; the control (its key blocks sized by the pass) differs."""
    engine = cuda_engine("llama", tokenizer, cuda, cuda_attention="triton", max_batch_tokens=300, max_num_seqs=6)
    try:
        assert engine.batch_invariant and engine.attention == "triton" and engine.cuda_graphs
        engine._backend.shape_dependent = shape_dependent
        prompts = questions(4, 10, document_words=400)
        found = differences(answers(engine, prompts, greedy(10, 16)), alone(engine, prompts, greedy(10, 16)))
        assert engine._runner.graphs.replays > 0
        assert (found != []) if shape_dependent else (found == [])
    finally:
        engine.close()


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_chunked_prefill_equals_alone_bf16(cuda, attention, tokenizer) -> None:
    prompts = questions(2, 8, document_words=400)  # over one 256-token block each
    whole = cuda_engine("llama", tokenizer, cuda, cuda_attention=attention, block_size=256)
    chunked = cuda_engine("llama", tokenizer, cuda, cuda_attention=attention, block_size=256, max_batch_tokens=100,
                          max_num_seqs=4)
    try:
        found = differences(answers(chunked, prompts, greedy(8, 12)), alone(whole, prompts, greedy(8, 12)))
        assert chunked.stats()["prefill_passes"] > 8 and found == []
    finally:
        whole.close()
        chunked.close()


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_per_question_adapters_equal_alone_bf16(cuda, attention, tokenizer, tmp_path) -> None:
    base = tiny_model("qwen2", tokenizer)
    folders = two_adapters(base, tmp_path)
    engine = Engine(base.to(cuda, torch.bfloat16), tokenizer, cuda_attention=attention)
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


@pytest.mark.parametrize("case", ["invariant", "control", "reordered-control"])
def test_smollm2_shape_packed_equals_alone_bf16(cuda, smollm2_folder, case) -> None:
    """Six questions on one document, then 48 of mixed lengths (every other one on a shared
    document), on the embedded model's shape. Two controls: cuBLAS with varlen_attn splitting as it
    likes (`batch_invariant=False`), which may or may not differ — with six short questions the
    passes packed and alone can be of shapes for which cuBLAS picks kernels that sum in the same
    order (an H200 did; the 48 of mixed lengths make passes of many shapes) — and the invariant
    engine with its down projections summed in an order the pass's rows set
    (`reorder_by_pass_size`), which differs by construction on any GPU."""
    batch_invariant = case != "control"
    engine = Engine.from_pretrained(str(smollm2_folder), device="cuda", batch_invariant=batch_invariant)
    try:
        if case == "reordered-control":
            reorder_by_pass_size(engine.model)
        found = []
        for prompts, sampling in ((doc_questions(), greedy(6, 24)), (questions(5, 48, 300), greedy(48, 32))):
            found += differences(answers(engine, prompts, sampling), alone(engine, prompts, sampling))
        assert (found == []) if batch_invariant else (found != [])
    finally:
        engine.close()


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_graph_replay_equals_eager_bitwise(cuda, form, attention, tokenizer) -> None:
    """Decode through captured graphs (buckets padded with trash-block rows) against eager decode:
    the same tokens and logits, bit for bit — on Kev's Triton attention on every torch. torch's
    gathered varlen form has no graphs: asked for, it says so."""
    prompts = questions(6, 11)  # 11 rows: buckets of 16, 8, 4 ... as questions finish
    graphed = cuda_engine("llama", tokenizer, cuda, cuda_attention=attention)
    eager = cuda_engine("llama", tokenizer, cuda, cuda_attention=attention, cuda_graphs=False)
    try:
        if attention == "varlen" and form != "paged":
            assert not graphed.cuda_graphs
            pytest.skip(f"torch {torch.__version__}'s varlen_attn is not paged: decode runs eagerly, no graphs")
        assert graphed.cuda_graphs and not eager.cuda_graphs
        found = differences(answers(graphed, prompts, greedy(11, 20)), answers(eager, prompts, greedy(11, 20)))
        assert found == []
        assert graphed._runner.graphs.replays > 0 and all(graphed._runner.graphs.statics[b].graph is not None
                                                    for b in graphed._runner.graphs.captured)
    finally:
        graphed.close()
        eager.close()


def test_graphs_replay_kevs_model_and_the_fallback_runs_its_hooks(cuda, tokenizer) -> None:
    """Kev's own model replays its decode graphs; the transformers fallback has none, and a forward
    hook registered while it serves runs on every pass, with the same tokens."""
    engine = cuda_engine("llama", tokenizer, cuda)
    fallback = cuda_engine("llama", tokenizer, cuda, model_impl="transformers")
    try:
        prompts, sampling = questions(2, 2), greedy(2, 6)
        plain = answers(engine, prompts, sampling)
        assert not fallback.cuda_graphs
        calls: list[int] = []
        fallback.model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: calls.append(1))
        assert differences(answers(fallback, prompts, sampling), plain) == [] and len(calls) >= 6
        assert engine.cuda_graphs and engine._runner.graphs.replays > 0  # a paged attention on every torch
    finally:
        engine.close()
        fallback.close()


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
        # the engine reads free memory itself, a moment later: the driver's figure moves by a few pages
        assert abs(budget - expected) <= 64 << 20
    finally:
        engine.close()
        del engine
        torch.cuda.empty_cache()
