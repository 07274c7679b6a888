"""The CUDA backends' plumbing on CPU: both varlen forms, the probe, and the decode graphs' static buffers.

CI has no GPU, so torch's `varlen_attn` is replaced by stand-ins of its contracts in plain torch
(tests/varlen_contract.py): `VarlenContract` for the paged form (torch 2.12+), `GatheredContract`
for torch 2.11's contiguous keys (and 2.10's `is_causal` spelling). Graphs run their static path
eagerly (`capture=False`): the pool layout, slot writes, block tables, `seqused_k`, the gathered
slots, the causal window, bucket choice, padding rows on the trash block — everything but the
kernel and the recording — runs here, with NaN in every byte of the pool nobody wrote. Which form
a signature gets, and the probe that refuses a kernel computing otherwise, are checked against
stand-ins of each kind. What only a GPU shows is in tests/test_cuda.py (`make gpu-check`).
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    QUESTIONS,
    chat,
    prefilled_decode_pack,
    reference_copy,
    reference_greedy,
    rounding_tolerance,
    tiny_model,
)
from torch.utils._python_dispatch import TorchDispatchMode
from varlen_contract import GatheredContract, GatheredContractIsCausal, VarlenContract

from kev_engine import Engine, SamplingParams
from kev_engine.model.pack import Segment, pack
from kev_engine.platforms.cuda import choice, probe
from kev_engine.platforms.cuda import graphs as cuda_graphs
from kev_engine.platforms.cuda import varlen as cuda_backend
from kev_engine.platforms.cuda.gathered import GatheredBackend

DOC = "The lighthouse was built in 1874 on a granite rock. " * 3
PROMPTS = QUESTIONS + [chat("Who built it?", DOC), chat("When was it built?", DOC)]  # a shared prefix


def varlen_engine(tokenizer, monkeypatch, *, graphs: bool, gathered: bool = False, block_size: int = 16,
                  **kwargs) -> tuple[Engine, VarlenContract | GatheredContract]:
    """An engine on a CUDA varlen path with its contract's stand-in (paged, or torch 2.11's contiguous
    keys); 16-token blocks so prompts cross many."""
    kernel: VarlenContract | GatheredContract = GatheredContract() if gathered else VarlenContract()
    backend = GatheredBackend(kernel) if gathered else cuda_backend.CudaBackend("varlen", kernel, page_multiple=16)
    monkeypatch.setattr(choice, "choose", lambda mode, device, dtype: backend)
    model = tiny_model("llama", tokenizer)
    engine = Engine(model, tokenizer, block_size=block_size, cuda_graphs=graphs, **kwargs)
    engine.source = model  # the transformers model Kev's model was read from: the tests' reference
    for keys, values in zip(engine._kv.keys, engine._kv.values):  # stale memory: NaN wherever nobody wrote
        keys.fill_(math.nan)
        values.fill_(math.nan)
    monkeypatch.setattr(engine._kv, "zero", lambda block_ids: None)  # and blocks handed out keep it
    return engine, kernel


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_varlen_path_matches_solo(tokenizer, monkeypatch, graphs) -> None:
    """Chunked prefill over cached blocks, a shared prefix, decode rows: every answer equals plain
    transformers alone, one varlen call per layer per pass, NaN in stale memory reaching nothing."""
    engine, kernel = varlen_engine(tokenizer, monkeypatch, graphs=graphs, max_batch_tokens=40, max_num_seqs=8)
    reference = reference_copy(engine.source)
    assert engine.attention == "varlen" and engine.cuda_graphs == graphs
    results = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6))
    for prompt, result in zip(PROMPTS, results):
        ids = engine.encode(prompt)
        assert result.token_ids == reference_greedy(reference, ids, 6, tokenizer.eos_token_id)
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] > 0
    assert len(kernel.calls) == stats["forward_passes"] * engine.model.config.num_hidden_layers
    assert {call["num_splits"] for call in kernel.calls} == {None}  # not batch-invariant on this path: the kernel picks
    # decode-only passes (one new token a segment) still say max_q >= 2: one causal kernel for every pass
    assert any(call["new_tokens"] == call["segments"] for call in kernel.calls)
    assert min(call["max_q"] for call in kernel.calls) == 2
    if graphs:
        assert engine._runner.graphs.replays > 0 and engine._runner.graphs.captured
        assert {call["max_k"] for call in kernel.calls if call["segments"] in engine._runner.graphs.captured} >= {
            engine.max_context}  # a bucket's bound is the context length
    engine.close()


def test_graph_replay_equals_eager_logits(tokenizer, monkeypatch) -> None:
    """A decode pass through a bucket (padding rows on the trash block) gives the eager logits, up to
    the CPU's rounding."""
    engine, _ = varlen_engine(tokenizer, monkeypatch, graphs=True)
    decode = prefilled_decode_pack(engine, QUESTIONS[:3])  # 3 rows: a bucket of 4, one padding row
    assert engine._runner.graphs.fits(decode)
    via_bucket = engine._runner.graphs.run(decode)
    eager = engine.model.forward(decode, engine._backend)
    # not bitwise here: this stand-in engine is not batch-invariant, and torch's CPU BLAS may sum the
    # bucket's 4 rows in another order than the eager pass's 3 (it does on some CPUs). Bitwise
    # replay on the invariant path is a GPU claim: tests/test_cuda.py
    tolerance = rounding_tolerance(eager)
    torch.testing.assert_close(via_bucket, eager, rtol=0, atol=tolerance)
    assert (via_bucket[0] - eager[1]).abs().max().item() > 10 * tolerance  # control: another row is far outside
    assert engine._runner.graphs.captured == [4] and via_bucket.shape[0] == 3
    engine.close()


def test_graphs_are_kevs_models_and_the_fallback_runs_its_hooks(tokenizer, monkeypatch) -> None:
    """Decode graphs replay Kev's own model, whose weights stay where they were put; the transformers
    fallback has none (a hook or a replaced module there would not run in a replay), and every
    pass of it runs the hooks registered meanwhile."""
    engine, _ = varlen_engine(tokenizer, monkeypatch, graphs=True)
    sampling = SamplingParams(temperature=0, max_tokens=4)
    try:
        plain = [c.token_ids for c in engine.generate(QUESTIONS[:2], sampling)]
        assert engine._runner.graphs.replays == 3 and engine._runner.graphs.captured == [2]  # 3 decode passes of 2 rows
    finally:
        engine.close()
    fallback, _ = varlen_engine(tokenizer, monkeypatch, graphs=True, model_impl="transformers")
    calls: list[str] = []
    try:
        assert not fallback.cuda_graphs
        fallback.model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: calls.append("mlp"))
        assert [c.token_ids for c in fallback.generate(QUESTIONS[:2], sampling)] == plain
        assert calls == ["mlp"] * 4  # the prompts' pass and 3 decode passes
    finally:
        fallback.close()


def test_buckets_and_choice() -> None:
    assert cuda_graphs.buckets(1) == [1]
    assert cuda_graphs.buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert cuda_graphs.buckets(48) == [1, 2, 4, 8, 16, 32, 64]  # the last bucket holds max_num_seqs rows
    sizes = cuda_graphs.buckets(16)
    assert [cuda_graphs.bucket_for(n, sizes) for n in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, None]
    with pytest.raises(ValueError, match="max_rows=0"):
        cuda_graphs.buckets(0)


def _decode_pack(backend, rows: list[tuple[int, list[int]]]):
    """Decode rows (past_len, block_ids) on a stand-in pool of 16-token blocks."""
    segments = [Segment(i, [7 + i], past, True, block_ids=blocks) for i, (past, blocks) in enumerate(rows)]
    return pack(segments, backend=backend)


def _paged_backend():
    return cuda_backend.CudaBackend("varlen", VarlenContract(), page_multiple=16).bind(SimpleNamespace(block_size=16))


def test_fill_copies_rows_and_pads_on_the_trash_block() -> None:
    kv, trash = _paged_backend(), 99
    static = cuda_graphs.static_pack(4, 16, max_context=100, device=torch.device("cpu"))
    assert static.attention.block_table.shape == (4, 7)  # ceil(100 / 16) blocks: any row the model can hold
    cuda_graphs.fill(static, _decode_pack(kv, [(20, [3, 5]), (0, [8])]), trash)
    assert static.input_ids.tolist() == [7, 8, 0, 0]
    assert static.position_ids.tolist() == [20, 0, 0, 0]
    assert static.slot_blocks.tolist() == [5, 8, trash, trash] and static.slot_offsets.tolist() == [4, 0, 0, 0]
    assert static.attention.seqused_k.tolist() == [21, 1, 1, 1]
    assert static.attention.cu_seqlens_k.tolist() == [0, 21, 22, 23, 24]
    assert static.attention.block_table[:, :2].tolist() == [[3, 5], [8, 0], [trash, 0], [trash, 0]]
    assert static.cu_seqlens.tolist() == [0, 1, 2, 3, 4] and static.logits_indices.tolist() == [0, 1, 2, 3]
    cuda_graphs.fill(static, _decode_pack(kv, [(40, [1, 2, 6])]), trash)  # fewer rows: the others become padding
    assert static.attention.seqused_k.tolist() == [41, 1, 1, 1]
    assert static.slot_blocks.tolist() == [6, trash, trash, trash]
    assert static.attention.block_table[1].tolist()[:1] == [trash]
    with pytest.raises(ValueError, match="do not fit a bucket of 4"):
        cuda_graphs.fill(static, _decode_pack(kv, [(0, [i]) for i in range(5)]), trash)


def test_which_passes_replay() -> None:
    kv = _paged_backend()
    assert cuda_graphs.why_not_graph(_decode_pack(kv, [(3, [0]), (5, [1])])) is None
    prefill = pack([Segment(0, [1, 2, 3], 0, True, block_ids=[0])], backend=kv)
    assert "prefill" in cuda_graphs.why_not_graph(prefill)
    adapter = pack([Segment(0, [1], 3, True, block_ids=[0], adapter="a")], backend=kv)
    assert "LoRA" in cuda_graphs.why_not_graph(adapter)


class _SyncSpy(TorchDispatchMode):
    """Records ops that copy a device value to the host (a capture would fail on them)."""

    SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
               "aten.equal.default"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.SYNCING:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_decode_forward_never_reads_a_device_value(tokenizer, monkeypatch) -> None:
    """What a capture records must not sync with the host. transformers skips its own packed-sequence
    check while a stream captures (`is_tracing`); with that as under a capture, Kev's decode pass has none."""
    import transformers.masking_utils as masking_utils

    engine, _ = varlen_engine(tokenizer, monkeypatch, graphs=True)
    engine.generate(QUESTIONS[:2], SamplingParams(temperature=0, max_tokens=2))  # a bucket is prepared
    static = engine._runner.graphs.statics[2].batch
    monkeypatch.setattr(masking_utils, "is_tracing", lambda *args: True)
    spy = _SyncSpy()
    with spy:
        engine._runner.graphs.forward(static)
    assert spy.seen == []
    engine.close()


def test_choose_names_the_bad_value_and_the_reason(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert choice.choose(None, cpu, torch.float32) is None
    assert choice.choose("torch", cpu, torch.float32) is None
    with pytest.raises(ValueError, match=r"cuda_attention='varlen' names a CUDA kernel; this engine runs on cpu"):
        choice.choose("varlen", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match=r"cuda_attention='triton' names a CUDA kernel; this engine runs on cpu"):
        choice.choose("triton", cpu, torch.float32)
    with pytest.raises(ValueError, match=r"cuda_attention='flash' is not allowed; use one of \['auto', 'varlen', "
                                         "'triton'"):
        choice.choose("flash", cpu, torch.bfloat16)
    assert "CUDA only" in choice.why_not_device(cpu, torch.bfloat16)


def test_auto_takes_the_triton_kernel_before_a_gather(monkeypatch, caplog) -> None:
    """On a GPU, "auto" takes torch's paged varlen_attn; where it is only the gathered form (torch
    2.10/2.11), Kev's Triton kernel first (the pool in place, graphs), the gathered form where
    Triton fails its probe; named kernels are that kernel or an error; none at all warns with every
    reason. (What each candidate finds installed and the probe are stood in for: no GPU here.)"""
    paged = cuda_backend.CudaBackend("varlen", VarlenContract())
    gathered = GatheredBackend(GatheredContract())
    triton = SimpleNamespace(name="triton", form="paged")
    installed = {"varlen": (paged, None), "triton": (triton, None), "flash-attn": (None, "no flash-attn package")}
    failing: set[str] = set()
    monkeypatch.setattr(choice, "candidate", lambda name, device, dtype: installed[name])
    monkeypatch.setattr(probe, "contract_error",
                        lambda backend, device, dtype: "it differs" if backend.name in failing else None)
    cuda = torch.device("cuda")
    assert choice.choose(None, cuda, torch.bfloat16) is paged
    installed["varlen"] = (gathered, None)  # torch 2.10/2.11
    assert choice.choose(None, cuda, torch.bfloat16) is triton
    assert choice.choose("varlen", cuda, torch.bfloat16) is gathered
    failing.add("triton")
    assert choice.choose(None, cuda, torch.bfloat16) is gathered
    with pytest.raises(ValueError, match="cuda_attention='triton' cannot be honoured: it differs"):
        choice.choose("triton", cuda, torch.bfloat16)
    failing.add("varlen")
    with caplog.at_level("WARNING", logger="kev"):
        assert choice.choose(None, cuda, torch.bfloat16) is None
    assert "triton: it differs; varlen: it differs; flash-attn: no flash-attn package" in caplog.text


def test_triton_is_refused_off_cuda_and_in_other_dtypes() -> None:
    assert "runs on CUDA only" in choice.candidate("triton", torch.device("cpu"), torch.bfloat16)[1]
    assert "computes float32, float16 and bfloat16" in choice.why_not_triton_device(torch.device("cuda"), torch.int8)


def test_varlen_form_is_read_from_its_signature(monkeypatch) -> None:
    """This torch's varlen_attn is paged; torch 2.11's signature (contiguous keys, causal by window)
    and 2.10's (by is_causal) get the gathered backend; one with neither is refused, naming what it has."""
    function, form, why = choice.varlen_kernel()
    assert (form, why) == ("paged", None)
    assert set(choice.PAGED_PARAMETERS) <= set(inspect.signature(function).parameters)
    assert choice.form_of(GatheredContract()) == ("gathered", None)
    assert choice.form_of(GatheredContractIsCausal()) == ("gathered", None)

    def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1)):
        raise AssertionError("never called")

    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn_2_11)
    function, form, why = choice.varlen_kernel()
    assert function is varlen_attn_2_11 and (form, why) == ("gathered", None)
    assert isinstance(choice.backend_for("varlen", function, form), GatheredBackend)

    def unknown(query, key, value, lengths, *, scale=None):
        raise AssertionError("never called")

    form, why = choice.form_of(unknown)
    assert form is None and "varlen_attn(query, key, value, lengths, *, scale=None) has neither the paged form" in why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_probe_accepts_each_contract(dtype) -> None:
    """Every stand-in of a correct kernel passes the probe, through its backend's own plan and attend."""
    cpu = torch.device("cpu")
    assert probe.contract_error(cuda_backend.CudaBackend("varlen", VarlenContract()), cpu, dtype) is None
    assert probe.contract_error(GatheredBackend(GatheredContract()), cpu, dtype) is None
    backend = GatheredBackend(GatheredContractIsCausal())
    assert backend.causal == {"is_causal": True} and probe.contract_error(backend, cpu, dtype) is None
    assert backend.pool is None  # the probe's pool is let go


def test_probe_refuses_a_kernel_that_computes_otherwise() -> None:
    """The probe's controls: the right signature with top-left causal alignment, a kernel that
    raises, and one without grouped heads are each refused, with what showed it."""
    cpu = torch.device("cpu")
    why = probe.contract_error(GatheredBackend(GatheredContract(top_left=True)), cpu, torch.bfloat16)
    assert why is not None and "differs from causal attention per segment" in why
    assert "1 new after 5 cached" in why and "3 new after 0 cached" not in why  # a prefill is alike either way

    def broken(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        raise RuntimeError("no kernel image is available for execution on the device")

    why = probe.contract_error(GatheredBackend(broken), cpu, torch.bfloat16)
    assert why == ("it failed on a probe pack (RuntimeError: no kernel image is available for execution on "
                   "the device)")

    def no_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        if query.shape[1] != key.shape[1]:
            raise RuntimeError("Number of heads in key/value must equal those of the query")
        raise AssertionError("the probe has grouped heads")

    assert "Number of heads" in probe.contract_error(GatheredBackend(no_gqa), cpu, torch.bfloat16)


@pytest.mark.parametrize("block_size", [16, 5], ids=["16-token blocks", "5-token blocks"])
def test_gathered_path_matches_solo(tokenizer, monkeypatch, block_size) -> None:
    """torch 2.11's contiguous varlen_attn: chunked prefill over cached blocks, a shared prefix,
    decode rows, each equal to plain transformers alone; one gathered call per layer per pass, no
    decode graphs even when asked, blocks of any size, and NaN in stale memory reaching nothing
    (only the listed slots are gathered, so blocks handed out are not even cleared)."""
    engine, kernel = varlen_engine(tokenizer, monkeypatch, graphs=True, gathered=True, block_size=block_size,
                                   max_batch_tokens=40, max_num_seqs=8)
    reference = reference_copy(engine.source)
    assert engine.attention == "varlen" and engine._backend.form == "gathered" and not engine.cuda_graphs
    assert engine._backend.causal == {"window_size": (-1, 0)} and not engine._backend.takes_enable_gqa
    results = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6))
    for prompt, result in zip(PROMPTS, results):
        ids = engine.encode(prompt)
        assert result.token_ids == reference_greedy(reference, ids, 6, tokenizer.eos_token_id)
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] > 0
    assert len(kernel.calls) == stats["forward_passes"] * engine.model.config.num_hidden_layers
    assert min(call["max_q"] for call in kernel.calls) == 2  # decode-only passes too: never the regrouped kernel
    assert max(call["keys"] for call in kernel.calls) > 40  # cached prefixes are gathered, not only new tokens
    engine.close()


def test_gathered_slots_follow_each_segments_blocks() -> None:
    """A segment's keys are its blocks' slots in position order, cut at its length, one segment after another."""
    from kev_engine.platforms.cuda.gathered import gather_slots

    segments = [Segment(0, [1, 2], 3, True, block_ids=[7, 2]), Segment(1, [9], 0, True, block_ids=[4])]
    assert gather_slots(segments, [5, 1], block_size=4).tolist() == [28, 29, 30, 31, 8, 16]


def test_block_size_must_suit_the_paged_kernel(tokenizer, monkeypatch) -> None:
    kernel = cuda_backend.CudaBackend("varlen", VarlenContract())
    with pytest.raises(ValueError, match=r"block_size=128 is not allowed with cuda_attention='varlen' \(paged\); use "
                                         "a multiple of 256"):
        kernel.check_block_size(128)
    kernel.check_block_size(512)
    GatheredBackend(GatheredContract()).check_block_size(5)  # contiguous keys: any block size
    monkeypatch.setattr(choice, "choose", lambda mode, device, dtype: kernel)
    with pytest.raises(ValueError, match="block_size=32 is not allowed"):
        Engine(tiny_model("llama", tokenizer), tokenizer, block_size=32)


def test_cuda_graphs_flag_is_checked(tokenizer) -> None:
    with pytest.raises(TypeError, match="cuda_graphs='no' is not allowed; use True or False"):
        Engine(tiny_model("llama", tokenizer), tokenizer, cuda_graphs="no")
    engine = Engine(tiny_model("llama", tokenizer), tokenizer)
    assert not engine.cuda_graphs  # a CPU engine: no paged CUDA attention, so no graphs
    engine.close()
