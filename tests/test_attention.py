"""The attention paths themselves: per-segment SDPA for prefill, one call for all decode rows
(the compiled CPU kernel, or the torch path's batched computation), and the optional flash-attn
paged varlen plumbing.

flash-attn needs CUDA, which CI does not have; its call is checked here against a pure-torch
implementation of `flash_attn_varlen_func`'s paged contract (cu_seqlens, block_table, bottom-right
causal), so its arguments are right on every CI machine. torch's own varlen_attn, the default CUDA
kernel, is checked the same way in tests/test_cuda_backend.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import QUESTIONS, chat, reference_copy, reference_greedy, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from kev_engine import Engine, SamplingParams
from kev_engine.model import attention
from kev_engine.model.kv_pool import kv_shape
from kev_engine.model.pack import Segment, pack
from kev_engine.platforms import torch_ops as reference
from kev_engine.platforms.cpu import kernels
from kev_engine.platforms.cpu.fast import FastBackend
from kev_engine.platforms.cuda import choice
from kev_engine.platforms.cuda import varlen as cuda_backend
from kev_engine.platforms.torch_ops import TorchBackend


def varlen_reference(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                     block_table=None):
    """flash_attn_varlen_func's paged contract in plain torch: q [Tq, H, D]; k/v_cache
    [num_blocks, block_size, kvH, D]; block_table [S, max_blocks] int32; causal is bottom-right aligned."""
    assert block_table is not None and block_table.dtype == torch.int32 and cu_k.dtype == torch.int32
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        n, m = int(cu_q[i + 1] - cu_q[i]), int(cu_k[i + 1] - cu_k[i])
        blocks = block_table[i, : -(-m // k_cache.shape[1])].long()
        ks = k_cache[blocks].flatten(0, 1)[:m].transpose(0, 1)  # [kvH, m, D]
        vs = v_cache[blocks].flatten(0, 1)[:m].transpose(0, 1)
        qs = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)
        mask = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n) if causal else None
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, scale=softmax_scale,
                                           enable_gqa=True)
        out[cu_q[i]:cu_q[i + 1]] = o[0].transpose(0, 1)
    assert max_q == max(int(cu_q[i + 1] - cu_q[i]) for i in range(len(cu_q) - 1))
    assert max_k == max(int(cu_k[i + 1] - cu_k[i]) for i in range(len(cu_k) - 1))
    return out


def test_flash_attn_paged_path_matches_solo(tokenizer, monkeypatch) -> None:
    """The optional flash-attn kernel's plumbing: pool layout, slot writes, block tables, cu_seqlens_k —
    one call per layer."""
    model = tiny_model("llama", tokenizer)
    reference = reference_copy(model)
    calls = []

    def counting_reference(*args, **kwargs):
        calls.append(1)
        return varlen_reference(*args, **kwargs)

    kernel = cuda_backend.CudaBackend("flash-attn", counting_reference, page_multiple=16)
    monkeypatch.setattr(choice, "choose", lambda mode, device, dtype: kernel)
    # a small budget chunks the prefill: new chunks attend to their own cached blocks
    engine = Engine(model, tokenizer, max_batch_tokens=40, max_num_seqs=8, block_size=16, cuda_graphs=False)
    assert engine.stats()["kv_block_size"] == 16 and engine.attention == "flash-attn"
    doc = "The lighthouse was built in 1874 on a granite rock. " * 3
    prompts = QUESTIONS + [chat("Who built it?", doc), chat("When was it built?", doc)]  # a shared prefix
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([engine.encode(prompt)])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        assert result.token_ids == expected[0, ids.shape[1]:].tolist()
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] > 0
    assert len(calls) == stats["forward_passes"] * model.config.num_hidden_layers  # one call per layer per pass
    engine.close()


def test_no_dense_mask_reaches_the_attention(tokenizer, monkeypatch) -> None:
    """transformers must hand Kev's attention no mask at all (no T×T tensor is ever built)."""
    seen = []
    original = attention.kev_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(attention.AttentionInterface._global_mapping, attention.KEV_ATTENTION, spy)
    engine = Engine(tiny_model("qwen3", tokenizer), tokenizer, model_impl="transformers")  # the fallback's attention
    engine.prompt_logits(QUESTIONS)
    assert seen and all(mask is None for mask in seen)


def test_segment_attention_with_prefix_is_bottom_right_causal() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 3, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 8)  # 3 new queries over 4 cached
    out = reference.segment_attention(q, k, v, past_len=4, scaling=None)
    full_q = torch.cat([torch.randn(4, 4, 8), q], dim=1)
    expected = F.scaled_dot_product_attention(full_q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0, :, 4:]
    torch.testing.assert_close(out, expected)


def test_model_used_outside_the_engine_fails_loudly(tokenizer) -> None:
    model = tiny_model("llama", tokenizer)
    Engine(model, tokenizer, model_impl="transformers")  # on the fallback, the model's attention is Kev's
    try:
        model(input_ids=torch.tensor([[1, 2, 3]]))
    except RuntimeError as exc:
        assert "kev_engine.Engine" in str(exc)
    else:
        raise AssertionError("a Kev-owned model must not silently run unpacked attention")


def test_pack_round_trip() -> None:
    backend = TorchBackend().bind(SimpleNamespace(block_size=4))
    segments = [Segment(0, [5, 6, 7], 0, True, block_ids=[3]), Segment(1, [9], 4, True, block_ids=[0, 1]),
                Segment(2, [1, 2], 0, False, block_ids=[2])]
    batch = pack(segments, backend=backend)
    assert batch.input_ids.tolist() == [5, 6, 7, 9, 1, 2]
    assert batch.position_ids.tolist() == [0, 1, 2, 4, 0, 1]  # restart per question; decode continues its own
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6] and batch.max_seqlen == 3
    assert batch.logits_indices.tolist() == [2, 3]  # only segments that sample
    assert batch.segment_lengths() == [3, 1, 2] and batch.past_lens == [0, 4, 0]
    assert batch.slot_blocks.tolist() == [3, 3, 3, 1, 2, 2]  # position 4 of request 1 is block 1, offset 0
    assert batch.slot_offsets.tolist() == [0, 1, 2, 0, 0, 1]
    assert batch.attention is not None and batch.attention.row_segments == [1]  # the torch backend's decode rows
    with pytest.raises(ValueError, match="KV pool"):
        pack([Segment(1, [9], 4, True)])


# (GROUP_COST_BLOCKS, GATHER_COST) → how the private and the shared blocks are read
GROUPINGS = {
    "gathered": ((24, 3), [False, False]),  # few blocks far apart: copied
    "ranges with holes": ((4, 3), [True, True]),  # private 2..9 and shared 0..1, each one view
    "one range per block": ((0, 3), [True] * 6),  # private 2, 5, 7, 9 and shared 0, 1: six views
}


@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_batched_decode_equals_attention_per_row(grouping: str, monkeypatch) -> None:
    """Rows over private blocks and over a shared prefix block, in one call, against SDPA per row,
    for each way the blocks can be grouped. Blocks no row reads are NaN: a range viewed in place
    reads them, and they must stay masked out."""
    (cost, gather), in_place = GROUPINGS[grouping]
    monkeypatch.setattr(reference, "GROUP_COST_BLOCKS", cost)
    monkeypatch.setattr(reference, "GATHER_COST", gather)
    torch.manual_seed(0)
    kv_heads, heads, dim, block = 2, 4, 8, 4
    keys, values = torch.randn(12, kv_heads, block, dim), torch.randn(12, kv_heads, block, dim)
    tables = [[0, 1, 5], [0, 1, 7], [9], [0, 2]]  # rows 0, 1 and 3 share blocks 0 (and 0, 1 rows 0-1)
    past = [9, 10, 2, 5]
    for hole in (3, 4, 6, 8, 10, 11):
        keys[hole], values[hole] = float("nan"), float("nan")
    segments = [Segment(i, [1], p, True, block_ids=t) for i, (t, p) in enumerate(zip(tables, past))]
    batch = pack(segments, backend=TorchBackend().bind(SimpleNamespace(block_size=block)))
    assert [g.block_ids is None for g in batch.attention.groups] == in_place
    query = torch.randn(len(tables), heads, dim)
    out = reference.batched_decode(query, batch.attention, keys, values, scaling=None)
    for i, (table, p) in enumerate(zip(tables, past)):
        k = keys[table].transpose(0, 1).reshape(kv_heads, -1, dim)[:, : p + 1]
        v = values[table].transpose(0, 1).reshape(kv_heads, -1, dim)[:, : p + 1]
        expected = F.scaled_dot_product_attention(query[i][None, :, None], k[None], v[None], enable_gqa=True)
        torch.testing.assert_close(out[i], expected[0, :, 0], atol=1e-5, rtol=1e-5)


def count_attention_kernels(engine: Engine, num_questions: int) -> tuple[int, int]:
    """(matmul-class torch kernels, compiled-kernel calls) that one layer's decode attention runs
    in a decode step of `num_questions` questions — the same in every layer and step."""
    prompts = [chat(f"Question number {i}: tell me something about the number {i * 7}.") for i in range(num_questions)]
    calls = []
    backend = engine._backend
    original = backend.decode_rows
    kernels_in_use = getattr(backend, "kernels", None)

    def counted(rows, decode, layer, scaling):
        compiled = [0]

        def counting_kernel(*args):
            compiled[0] += 1
            return kernels_in_use.paged_decode(*args)

        if kernels_in_use is not None:
            backend.kernels = SimpleNamespace(paged_decode=counting_kernel)
        try:
            with KernelCounter() as counter:
                out = original(rows, decode, layer, scaling)
        finally:
            if kernels_in_use is not None:
                backend.kernels = kernels_in_use
        calls.append((counter.count, compiled[0]))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "decode_rows", counted)
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=3))  # prefill, then 2 decode steps
    per_layer = set(calls)
    assert len(calls) == 2 * engine.model.config.num_hidden_layers and len(per_layer) == 1, calls
    return calls[0]


class KernelCounter(TorchDispatchMode):
    MATMULS = {"bmm", "mm", "matmul", "baddbmm", "_scaled_dot_product_attention_math",
               "_scaled_dot_product_flash_attention_for_cpu"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.MATMULS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_one_attention_call_per_layer_for_any_number_of_decode_rows(tokenizer, path: str) -> None:
    """The compiled decode kernel: one call per layer and no torch matmul; the torch path: a fixed set."""
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, cpu_kernels=path, batch_invariant=False)
    assert engine.attention == {"compiled": "fast", "torch": "torch"}[path]
    two, sixteen = count_attention_kernels(engine, 2), count_attention_kernels(engine, 16)
    engine.close()
    assert two == sixteen
    assert two == (0, 1) if path == "compiled" else two[0] > 0 and two[1] == 0


# (kv heads, query heads, head dim): the unrolled head sizes (64, 128) and the generic loop (8)
KERNEL_SHAPES = [(2, 4, 8), (3, 9, 64), (1, 1, 128), (2, 2, 64)]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=[f"kv{a}-h{b}-d{c}" for a, b, c in KERNEL_SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_kernel_equals_attention_per_row(shape, dtype) -> None:
    """The CPU kernel against SDPA per row: shared and private blocks, partial last blocks, and NaN
    everywhere no row may read (unlisted blocks and the slots past a row's length)."""
    kv_heads, heads, dim = shape
    block = 4
    torch.manual_seed(0)
    keys = torch.full((12, kv_heads, block, dim), float("nan"))
    values = torch.full((12, kv_heads, block, dim), float("nan"))
    tables = [[0, 1, 5], [0, 1, 7], [9], [0, 2], [11, 3, 6, 8, 10]]
    lengths = [10, 11, 3, 6, 17]
    for table, length in zip(tables, lengths):
        for j, block_id in enumerate(table):
            n = min(block, length - j * block)
            keys[block_id, :, :n] = torch.randn(kv_heads, n, dim)
            values[block_id, :, :n] = torch.randn(kv_heads, n, dim)
    keys, values = keys.to(dtype), values.to(dtype)
    backend = FastBackend(kernels.load_kernels()).bind(SimpleNamespace(block_size=block, keys=[keys],
                                                                          values=[values]))
    segments = [Segment(i, [1], n - 1, True, block_ids=t) for i, (t, n) in enumerate(zip(tables, lengths))]
    batch = pack(segments, backend=backend)
    assert batch.attention.tables is not None and not batch.attention.groups
    query = torch.randn(len(tables), heads, dim).to(dtype)
    out = backend.decode_rows(query, batch.attention, 0, scaling=None)
    assert out.dtype == dtype and out.shape == query.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (table, n) in enumerate(zip(tables, lengths)):
        k = keys[table].float().transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n]
        v = values[table].float().transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n]
        expected = F.scaled_dot_product_attention(query[i].float()[None, :, None], k[None], v[None], enable_gqa=True)
        torch.testing.assert_close(out[i].float(), expected[0, :, 0], atol=tolerance, rtol=tolerance)


EXACT_SHAPES = [(4, 12, 64, 32), (3, 9, 80, 16), (2, 2, 128, 32)]  # kv heads, heads, head dim, block


@pytest.mark.parametrize("shape", EXACT_SHAPES, ids=[f"kv{a}-h{b}-d{c}-b{d}" for a, b, c, d in EXACT_SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_kernel_rows_are_bitwise_the_same_in_any_pass(shape, dtype) -> None:
    """The batch-invariant kernel (csrc/attention.cpp) on 16 decode rows and a prefill chunk in one
    call against each segment in a call of its own: `torch.equal` (a pass of many decode rows
    reads several kv heads per task, a pass of one row one head per task), and each against SDPA
    in float64. NaN fills every slot no row may read. The control: one row's own key changed,
    only that row's output changes."""
    kv_heads, heads, dim, block = shape
    gen = torch.Generator().manual_seed(1)
    prefill_rows = 5  # segment 0: its last five positions are query rows
    lengths = [int(n) for n in torch.randint(prefill_rows, 7 * block, (17,), generator=gen)]
    per = [-(-n // block) for n in lengths]
    num_blocks = sum(per) + 3
    keys = torch.full((num_blocks, kv_heads, dim, block), float("nan"))
    values = torch.full((num_blocks, kv_heads, block, dim), float("nan"))
    order = torch.randperm(num_blocks, generator=gen)[: sum(per)].tolist()
    tables, at = [], 0
    for n, count in zip(lengths, per):
        table, at = order[at: at + count], at + count
        tables.append(table)
        for j, block_id in enumerate(table):
            used = min(block, n - j * block)
            keys[block_id, :, :, :used] = torch.randn(kv_heads, dim, used, generator=gen)
            values[block_id, :, :used] = torch.randn(kv_heads, used, dim, generator=gen)
    keys, values = keys.to(dtype), values.to(dtype)
    rows = [prefill_rows] + [1] * 16
    query = torch.randn(sum(rows), heads, dim, generator=gen).to(dtype)
    kernel = kernels.load_kernels().paged_attention

    def call(segments: list[int], k: torch.Tensor = keys) -> torch.Tensor:
        width = max(per[s] for s in segments)
        table = torch.tensor([tables[s] + [0] * (width - per[s]) for s in segments], dtype=torch.int32)
        cu = torch.tensor([0] + [sum(rows[s] for s in segments[: i + 1]) for i in range(len(segments))],
                          dtype=torch.int32)
        past = torch.tensor([lengths[s] - rows[s] for s in segments], dtype=torch.int32)
        first = [sum(rows[:s]) for s in segments]
        q = torch.cat([query[f: f + rows[s]] for f, s in zip(first, segments)])
        return kernel(q, k, values, table, cu, past, dim ** -0.5)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        packed = call(list(range(17)))
        starts = [sum(rows[:s]) for s in range(17)]
        for s in range(17):
            alone = call([s])
            assert torch.equal(packed[starts[s]: starts[s] + rows[s]], alone), f"segment {s}"
            k = keys[tables[s]].double().permute(1, 0, 3, 2).reshape(kv_heads, -1, dim)[:, : lengths[s]]
            v = values[tables[s]].double().transpose(0, 1).reshape(kv_heads, -1, dim)[:, : lengths[s]]
            q = query[starts[s]: starts[s] + rows[s]].double().transpose(0, 1)
            mask = torch.ones(rows[s], lengths[s], dtype=torch.bool).tril(diagonal=lengths[s] - rows[s])
            expected = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(alone.double(), expected[0].transpose(0, 1), atol=tolerance, rtol=tolerance)
        # control: row 3's first key changed; only row 3 sees it
        changed = keys.clone()
        changed[tables[3][0], :, :, 0] += 1
        moved = call(list(range(17)), changed)
        differ = [s for s in range(17)
                  if not torch.equal(moved[starts[s]: starts[s] + rows[s]], packed[starts[s]: starts[s] + rows[s]])]
        assert differ == [3]
    finally:
        torch.set_num_threads(threads)


def test_compiled_decode_kernel_refuses_tables_outside_the_pool() -> None:
    """A block id past the pool or a length past the table is an error naming it, never a stray read."""
    kernel = kernels.load_kernels().paged_decode
    keys = torch.zeros(4, 1, 4, 8)
    query = torch.zeros(1, 1, 8)
    table = torch.tensor([[1, 9]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="names block 9 of 4"):
        kernel(query, keys, keys, table, torch.tensor([6], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="reads 9 tokens; its block table holds 8"):
        kernel(query, keys, keys, table, torch.tensor([9], dtype=torch.int32), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kv_write_equals_index_put(dtype) -> None:
    """The kernel's row-copy store against torch's index_put: strided keys (a transposed view),
    several tokens into one block, and every slot not written left exactly as it was (NaN)."""
    write = kernels.load_kernels().paged_write
    torch.manual_seed(0)
    pools = [torch.full((10, 3, 4, 8), float("nan"), dtype=dtype) for _ in range(4)]
    key = torch.randn(5, 3, 8).to(dtype).transpose(0, 1)  # [kvH, T, D], not contiguous
    value = torch.randn(3, 5, 8).to(dtype)
    block_ids, offsets = torch.tensor([2, 2, 7, 0, 9]), torch.tensor([0, 3, 1, 2, 3])
    write(pools[0], pools[1], key, value, block_ids, offsets)
    pools[2][block_ids, :, offsets] = key.transpose(0, 1)
    pools[3][block_ids, :, offsets] = value.transpose(0, 1)
    assert torch.equal(pools[0].nan_to_num(7.0), pools[2].nan_to_num(7.0))
    assert torch.equal(pools[1].nan_to_num(7.0), pools[3].nan_to_num(7.0))


def test_compiled_kv_write_refuses_slots_outside_the_pool_and_writes_nothing() -> None:
    write = kernels.load_kernels().paged_write
    keys, values = torch.zeros(4, 1, 4, 8), torch.zeros(4, 1, 4, 8)
    new = torch.ones(1, 2, 8)
    with pytest.raises(RuntimeError, match="token 1 goes to block 4 offset 0; the pool has 4 blocks of 4"):
        write(keys, values, new, new, torch.tensor([0, 4]), torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="token 0 goes to block 1 offset 4"):
        write(keys, values, new, new, torch.tensor([1, 1]), torch.tensor([4, 0]))
    assert not keys.any() and not values.any()


def test_cpu_kernels_mode_is_checked_and_a_failed_build_is_said(tokenizer, monkeypatch, caplog) -> None:
    """A bad mode names itself; "auto" says why it decodes with torch; "compiled" fails with the reason."""
    with pytest.raises(ValueError, match="cpu_kernels='fast' is not allowed; use one of auto, compiled, torch"):
        Engine(tiny_model("llama", tokenizer), tokenizer, cpu_kernels="fast")
    monkeypatch.setenv("KEV_CPU_KERNELS", "gpu")
    with pytest.raises(ValueError, match="KEV_CPU_KERNELS='gpu' is not allowed"):
        Engine(tiny_model("llama", tokenizer), tokenizer)
    monkeypatch.delenv("KEV_CPU_KERNELS")

    def no_compiler(build: str):
        raise OSError("no C++ compiler on PATH")

    monkeypatch.setattr(kernels, "_kernels", None)
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.setattr(kernels, "_build", no_compiler)
    model = tiny_model("llama", tokenizer)
    reference = reference_copy(model)  # before an engine claims the model
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler on PATH"):
        Engine(model, tokenizer, cpu_kernels="compiled", model_impl="transformers")
    with caplog.at_level("WARNING", logger="kev"):
        engine = Engine(model, tokenizer, model_impl="transformers")  # the failed "compiled" left the model unclaimed
    assert engine.attention == "torch" and not engine.batch_invariant
    assert "no C++ compiler on PATH" in caplog.text and "not batch-invariant" in caplog.text
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.__dict__["forward"].args[2] is None for m in linears)  # nor the compiled few-row product
    answer = engine.generate([chat("Hi")], SamplingParams(temperature=0, max_tokens=3))[0]
    assert answer.token_ids == reference_greedy(reference, engine.encode(chat("Hi")), 3, tokenizer.eos_token_id)
    engine.close()


BACKEND_OPTIONS = {"exact": {}, "fast": {"batch_invariant": False}, "torch": {"cpu_kernels": "torch"}}


@pytest.mark.parametrize("kind", list(BACKEND_OPTIONS))
def test_each_backend_owns_its_pool_and_a_pack_is_plain_data(tokenizer, kind: str) -> None:
    """The backend allocates the pool in its own layout and is bound to it; a pass's PackedBatch
    carries tensors, lists and the backend's plain plan — never the pool or the backend."""
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, block_size=32, **BACKEND_OPTIONS[kind])
    backend, pool = engine._backend, engine._kv
    assert engine.attention == kind == backend.name and backend.pool is pool
    _, kv_heads, head_dim = kv_shape(engine.model)
    key_shape, value_shape = backend.layout(pool.num_blocks, kv_heads, 32, head_dim)
    assert pool.keys[0].shape == key_shape and pool.values[0].shape == value_shape
    assert (key_shape == value_shape) == (kind != "exact")  # the exact kernel keeps keys transposed
    packs = []
    forward = engine._runner.forward

    def recorded(batch, resident):
        packs.append(batch)
        return forward(batch, resident)

    engine._runner.forward = recorded
    engine.generate(QUESTIONS[:2], SamplingParams(temperature=0, max_tokens=3))
    engine.close()
    assert len(packs) == 3 and packs[-1].attention is not None  # a decode pass always has the backend's plan

    def plain(value) -> bool:
        if dataclasses.is_dataclass(value):
            return all(plain(getattr(value, f.name)) for f in dataclasses.fields(value))
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (torch.Tensor, int, str))

    assert all(plain(batch) for batch in packs)
