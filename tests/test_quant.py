"""GGUF's quantized weights computed as stored: each block type decoded bit for bit as gguf-py's
own `dequantize`; products bit for bit their arithmetic on every path and row count (so packed
equals alone): the block-scaled one (quant_reference.py writes it out) or, for a prompt's rows
where the build decodes them and for bf16 on AMX, the packed product on the dequantized weight;
engines on the file's blocks within rounding of the same model dequantized (a prompt's logits bit
for bit where a prompt's rows are decoded), a follow-up repeating an answer the same bits with the
answer's blocks cached or not, LoRA on a quantized base against PEFT on the dequantized one, and
`kev quantize`'s round trip.

Controls: one changed quantized value is seen by every comparison of values and products; the
exact product summed in another order differs from the block-scaled one, and the block-scaled from
the decoded; the packed-versus-alone comparison on a quantized engine fails once a reduction is
ordered by the pass's size (`test_invariance.reorder_by_pass_size`); a follow-up that finds the
answer's blocks differs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import QUESTIONS, make_adapter, rounding_tolerance, save_tiny_model
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from peft import PeftModel
from quant_reference import scaled_product
from test_invariance import alone, answers, differences, doc_questions, greedy, questions, reorder_by_pass_size

from kev_engine import Engine, SamplingParams, loader
from kev_engine.models.gguf_file import GgufFile, read_header, tensor_bytes
from kev_engine.models.quant import FORMATS, QuantTensor, tile
from kev_engine.platforms.cpu import isa as cpu_isa
from kev_engine.platforms.cpu import kernels as cpu_kernels
from kev_engine.tools.cli import main as cli_main
from kev_engine.tools.quantize import quantize

DTYPES = [torch.float32, torch.bfloat16]
NAMES = {f.name: kind for kind, f in FORMATS.items()}
# (dtype, bf16 instruction path): "" is this machine's own
PATHS = [(torch.float32, ""), (torch.bfloat16, ""), (torch.bfloat16, "amx"), (torch.bfloat16, "avx512_bf16"),
         (torch.bfloat16, "fma")]


@pytest.fixture(scope="module")
def kernels():
    return cpu_kernels.load_kernels()


def random_blocks(kind: int, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    """A weight of `kind`: quantized by gguf-py where it can, else random bytes with finite scales
    (one a subnormal fp16: every fp16 converts exactly, and that one must too)."""
    rng = np.random.default_rng(seed)
    f = FORMATS[kind]
    d_at = 208 if f.name == "Q6_K" else 0  # where a block's fp16 d is (Q4_K and Q5_K: dmin follows it)
    try:
        blocks = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), GGMLQuantizationType(kind))
    except NotImplementedError:  # gguf-py has no K-quant quantizer
        blocks = rng.integers(0, 256, size=(rows, cols // f.block_k, f.block_bytes), dtype=np.uint8)
        scales = rng.uniform(1e-3, 2e-2, size=blocks.shape[:2] + (2,)).astype(np.float16).view(np.uint8)
        width = 2 if f.name == "Q6_K" else 4
        blocks[..., d_at:d_at + width] = scales[..., :width]
        blocks = blocks.reshape(rows, -1)
    blocks[0, d_at:d_at + 2] = (1, 0)  # row 0's first scale: the smallest fp16 subnormal
    return QuantTensor(kind, rows, cols, blocks)


def decoded(kernels, tensor: QuantTensor) -> torch.Tensor:
    return kernels.quant_rows(tile(tensor), tensor.type, tensor.rows, tensor.cols, torch.arange(tensor.rows))


@pytest.mark.parametrize("name", list(NAMES))
def test_each_format_decodes_as_gguf_dequantizes_bitwise(kernels, name: str) -> None:
    kind = NAMES[name]
    tensor = random_blocks(kind, 37, 3 * FORMATS[kind].block_k)
    expected = tensor.dequantized()
    assert torch.isfinite(expected).all()
    assert torch.equal(decoded(kernels, tensor), expected)
    changed = QuantTensor(kind, tensor.rows, tensor.cols, tensor.blocks.copy())  # control: one value moved
    changed.blocks[5, -1] ^= 0x11
    assert not torch.equal(decoded(kernels, changed), expected)


def test_the_embedded_files_tensors_decode_as_gguf_dequantizes(kernels) -> None:
    path = loader.embedded_gguf()
    _, infos = read_header(path)
    file = GgufFile(path, loader_config(path), keep_quantized=True)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.7.self_attn.q_proj.weight",
                 "model.embed_tokens.weight"):
        tensor = file.get(name)
        assert isinstance(tensor, QuantTensor)
        rows = torch.arange(0, tensor.rows, 97)  # the 49,152-row table: a sample of its rows
        got = kernels.quant_rows(tile(tensor), tensor.type, tensor.rows, tensor.cols, rows)
        assert torch.equal(got, tensor.dequantized()[rows])
    assert {FORMATS[info.type].name for info in infos.values() if info.type in FORMATS} == {"Q4_1", "Q8_0"}


def loader_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(loader.gguf_header_dir(path)))


def path_or_skip(kernels, dtype, path: str) -> None:
    """Skips a bf16 path this machine's build cannot take (AMX on a CPU without it)."""
    if path:
        try:
            kernels.linear_packed(torch.ones(1, 2, dtype=dtype), kernels.linear_pack(torch.ones(1, 2, dtype=dtype)), 1,
                                  None, path)
        except RuntimeError as exc:
            pytest.skip(str(exc).splitlines()[0])


def decoded_arithmetic(kernels, dtype, path: str) -> bool:
    """Whether quant_linear takes the decoded weights' arithmetic (bf16 on AMX) rather than the block-scaled one."""
    return dtype == torch.bfloat16 and (path or kernels.bf16_path.path) == "amx"


def dot_arithmetic(kernels, dtype, path: str) -> bool:
    """Whether the block-scaled arithmetic's group sums are `vdpbf16ps`'s (bf16 on the AVX512-BF16 path)."""
    return dtype == torch.bfloat16 and (path or kernels.bf16_path.path) == "avx512_bf16"


FORMAT_SETS = [["Q4_K", "Q8_0", "Q6_K"], ["Q4_0", "Q4_1"], ["Q5_0", "Q5_1", "Q5_K"]]  # a Q4_K_M file mixes the first


@pytest.mark.parametrize("dtype,path", PATHS, ids=["fp32", "bf16", "bf16-amx", "bf16-avx512_bf16", "bf16-fma"])
def test_products_are_their_arithmetic_bitwise_whatever_the_row_count(kernels, dtype, path: str) -> None:
    """Fused parts of every format, a bias, row counts of decode steps and of prefills: every row
    the same bits as the block-scaled arithmetic written out in numpy (quant_reference.py; on the
    AVX512-BF16 path with its group sums as `vdpbf16ps` takes them), or, where bf16 products are
    AMX's, as linear_packed on the dequantized weight; so the same bits whatever the row count
    (packed == alone). Both stay within rounding of the exact product."""
    path_or_skip(kernels, dtype, path)
    decoded = decoded_arithmetic(kernels, dtype, path)
    for seed, names in enumerate(FORMAT_SETS):
        parts = [random_blocks(NAMES[name], 24 + 16 * i, 512, 10 * seed + i) for i, name in enumerate(names)]
        weight = torch.cat([part.dequantized() for part in parts])
        generator = torch.Generator().manual_seed(seed)
        bias = torch.randn(weight.shape[0], generator=generator)
        x = torch.randn(300, 512, generator=generator).to(dtype)
        tiled = [tile(part) for part in parts]
        if decoded:
            expected = kernels.linear_packed(x, kernels.linear_pack(weight.to(dtype)), weight.shape[0], bias, path)
        else:
            expected = scaled_product(x, parts, bias, dot=dot_arithmetic(kernels, dtype, path))
        exact = x.double() @ weight.double().T + bias.double()
        got = {}
        for rows in (1, 2, 5, 7, 17, 97, 300):
            out = kernels.quant_linear(x[:rows], tiled, [p.type for p in parts], [p.rows for p in parts], bias, path)
            assert torch.equal(out, expected[:rows]), (names, rows)
            got[rows] = out
        for rows in (1, 2, 5, 7, 17, 97):
            assert torch.equal(got[rows], got[300][:rows])
        plain = (x.float() @ weight.T + bias).to(dtype)  # control: another order of the same sums differs
        assert not torch.equal(got[300], plain)
        error = (got[300].double() - exact).abs().max() / exact.abs().max()
        assert error < (2**-7 if dtype == torch.bfloat16 else 2**-20), (names, error)
    tiled[1][0, 0, 40] ^= 0x70  # control: one quantized value of the Q5_1 part changed
    out = kernels.quant_linear(x[:5], tiled, [p.type for p in parts], [p.rows for p in parts], bias, path)
    assert not torch.equal(out, got[5])


@pytest.mark.parametrize("dtype,path", PATHS, ids=["fp32", "bf16", "bf16-amx", "bf16-avx512_bf16", "bf16-fma"])
def test_a_prompts_rows_take_the_dequantized_weights_bits_and_the_others_their_own(kernels, dtype, path: str) -> None:
    """`prompt` marks a prompt's rows: where this build decodes them (AVX512-BF16), each such row is the
    same bits as linear_packed on gguf's dequantized weight, the other rows the same bits as without
    a mask (the block-scaled arithmetic), whatever the mix and the row count; without it the
    mask changes no bit. Control: the two arithmetics differ on these weights, so a row given the
    wrong one would be seen."""
    path_or_skip(kernels, dtype, path)
    parts = [random_blocks(NAMES[name], 24 + 16 * i, 512, 40 + i) for i, name in enumerate(["Q4_K", "Q5_1", "Q6_K"])]
    weight = torch.cat([part.dequantized() for part in parts])
    generator = torch.Generator().manual_seed(4)
    bias = torch.randn(weight.shape[0], generator=generator)
    x = torch.randn(130, 512, generator=generator).to(dtype)
    tiled, types, widths = [tile(part) for part in parts], [p.type for p in parts], [p.rows for p in parts]
    dense = kernels.linear_packed(x, kernels.linear_pack(weight.to(dtype)), weight.shape[0], bias, path)
    own = kernels.quant_linear(x, tiled, types, widths, bias, path)
    decodes = kernels.quant_prompt_decoded or decoded_arithmetic(kernels, dtype, path)
    expected_prompt = dense if decodes else own
    assert torch.equal(own, dense) == decoded_arithmetic(kernels, dtype, path)  # control: they differ but on AMX
    mask = torch.rand(130, generator=generator) < 0.5
    mixed = kernels.quant_linear(x, tiled, types, widths, bias, path, prompt=mask)
    assert torch.equal(mixed[mask], expected_prompt[mask]) and torch.equal(mixed[~mask], own[~mask])
    for rows in (1, 6, 7, 130):
        every = torch.ones(rows, dtype=torch.bool)
        got = kernels.quant_linear(x[:rows], tiled, types, widths, bias, path, prompt=every)
        assert torch.equal(got, expected_prompt[:rows]), rows
        none = kernels.quant_linear(x[:rows], tiled, types, widths, bias, path, prompt=~every)
        assert torch.equal(none, own[:rows]), rows
    with pytest.raises(RuntimeError, match="prompt must be a bool mask of the input's 130 rows"):
        kernels.quant_linear(x, tiled, types, widths, bias, path, prompt=mask[:-1])


def test_control_the_avx512_bf16_paths_sums_are_vdpbf16ps_order(kernels) -> None:
    """Random inputs round a group's sums to the same bf16 outputs in either order, so this control
    builds one where the order shows: every weight 1 (Q8_0, d = 1), x = 1, 2^24, -2^24, 1, 0, ...
    Summed a k at a time (the fma path's order) p is 1 (1 + 2^24 rounds to 2^24, less 2^24, plus 1);
    by `vdpbf16ps` (k + 1 before k, each rounded) it is 0. Decode tiles and prefill alike."""
    path_or_skip(kernels, torch.bfloat16, "avx512_bf16")
    block = np.concatenate([np.array([1.0], np.float16).view(np.uint8), np.ones(32, np.uint8)])
    ones = QuantTensor(NAMES["Q8_0"], 32, 64, np.tile(block, (32, 2)))
    x = torch.zeros(9, 64)
    x[:, :4] = torch.tensor([1.0, 2.0**24, -(2.0**24), 1.0])
    x = x.to(torch.bfloat16)
    dot, fma = scaled_product(x, [ones], dot=True), scaled_product(x, [ones], dot=False)
    assert torch.equal(dot, torch.zeros_like(dot)) and torch.equal(fma, torch.ones_like(fma))
    for rows in (1, 9):
        out = kernels.quant_linear(x[:rows], [tile(ones)], [ones.type], [ones.rows], None, "avx512_bf16")
        assert torch.equal(out, dot[:rows]) and not torch.equal(out, fma[:rows])
    assert torch.equal(kernels.quant_linear(x, [tile(ones)], [ones.type], [ones.rows], None, "fma"), fma)


def test_a_bad_tiled_weight_or_type_is_refused(kernels) -> None:
    tensor = random_blocks(NAMES["Q4_0"], 16, 64)
    with pytest.raises(RuntimeError, match="not one Kev computes in place"):
        kernels.quant_linear(torch.randn(1, 64), [tile(tensor)], [10], [16])
    with pytest.raises(RuntimeError, match="not a tiled weight of 16 outputs x 96 inputs"):
        kernels.quant_linear(torch.randn(1, 96), [tile(tensor)], [tensor.type], [16])
    with pytest.raises(RuntimeError, match="row 16 of a weight of 16 rows"):
        kernels.quant_rows(tile(tensor), tensor.type, 16, 64, torch.tensor([16]))


# ---- engines on the embedded file ----------------------------------------------------------------


@pytest.fixture(scope="module", params=DTYPES, ids=["fp32", "bf16"])
def stored_and_dense(request):
    stored = Engine.from_pretrained(dtype=request.param, weights="as-stored")
    dense = Engine.from_pretrained(dtype=request.param, weights="dense")
    yield stored, dense
    stored.close()
    dense.close()


def test_the_embedded_file_as_stored_stays_within_rounding_of_the_dequantized(stored_and_dense) -> None:
    """The file's 211 quantized weights kept as stored, at the file's size. A prompt's logits: where
    this build decodes a prompt's rows (AVX512-BF16), bit for bit the same model dequantized; elsewhere
    within the dtype's rounding of it (the block-scaled products sum other roundings). Where bf16
    products are AMX's (every row decoded) the same answers bit for bit too."""
    stored, dense = stored_and_dense
    assert stored.stats()["weights"] == "as stored (210 Q4_1, 1 Q8_0)" and dense.stats()["weights"] == "dense"
    assert stored.stats()["weight_bytes"] <= 1.1 * tensor_bytes(loader.embedded_gguf())
    dtype = getattr(torch, stored.stats()["dtype"])
    decodes = cpu_kernels.load_kernels().quant_prompt_decoded
    for got, expected in zip(stored.prompt_logits(QUESTIONS[:3]), dense.prompt_logits(QUESTIONS[:3])):
        torch.testing.assert_close(got, expected, atol=rounding_tolerance(expected, dtype), rtol=0)
        if decodes:  # a prompt's rows on the dequantized weights: the dense model's bits
            assert torch.equal(got, expected)
        else:  # block-scaled: fp32 shows the other roundings (bf16's rounding may hide them)
            assert not torch.equal(got, expected) or dtype == torch.bfloat16
    if decoded_arithmetic(cpu_kernels.load_kernels(), dtype, ""):
        prompts = questions(5, 6)
        assert differences(answers(stored, prompts, greedy(6, 10)), answers(dense, prompts, greedy(6, 10))) == []


def test_the_embedded_file_as_stored_packed_equals_alone_bitwise(stored_and_dense) -> None:
    stored, _ = stored_and_dense
    prompts = doc_questions()
    packed = answers(stored, prompts, greedy(6, 12))
    assert differences(packed, alone(stored, prompts, greedy(6, 12))) == []


def test_a_follow_up_repeating_an_answer_gets_the_same_bits_with_its_blocks_cached_or_not(stored_and_dense) -> None:
    """Where a prompt's rows take their own arithmetic (`Ops.prompt_arithmetic`: AVX512-BF16), the
    blocks holding a generated answer are never found by a later prompt: a follow-up turn that
    repeats the answer computes those tokens as a prompt's, the same bits as with nothing cached.
    Control: with the answer's blocks findable (`keys_answers`), the follow-up's bits differ."""
    stored, _ = stored_and_dense
    split = stored.model.ops.prompt_arithmetic
    assert stored._scheduler.keys_answers is not split
    first = stored.encode(QUESTIONS[0])
    turn = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, cache_salt="turns")
    answer = stored.generate([{"prompt_token_ids": first}], turn)[0].token_ids
    follow = {"prompt_token_ids": first + answer + first[:8]}

    def follow_up(salt: str):
        return answers(stored, [follow], [SamplingParams(temperature=0, max_tokens=4, cache_salt=salt)])

    assert differences(follow_up("turns"), follow_up("cold")) == []
    if split:
        stored._scheduler.keys_answers = True
        try:
            stored.generate([{"prompt_token_ids": first}], dataclasses.replace(turn, cache_salt="turns-keyed"))
            assert differences(follow_up("turns-keyed"), follow_up("cold-again")) != []
        finally:
            stored._scheduler.keys_answers = False


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_control_a_reordered_reduction_on_quantized_weights_is_caught(dtype) -> None:
    control = Engine.from_pretrained(dtype=dtype, weights="as-stored")
    try:
        reorder_by_pass_size(control.model)
        prompts = doc_questions()
        assert differences(answers(control, prompts, greedy(6, 12)), alone(control, prompts, greedy(6, 12))) != []
    finally:
        control.close()


def test_weights_is_checked_and_refused_where_it_cannot_be_computed() -> None:
    allowed = r"weights='as-is' is not allowed; use one of \['auto', 'as-stored', 'dense'\]"
    with pytest.raises(ValueError, match=allowed):
        Engine.from_pretrained(weights="as-is")
    with pytest.raises(ValueError, match="here batch_invariant=False; use weights='dense'"):
        Engine.from_pretrained(weights="as-stored", batch_invariant=False)
    with pytest.raises(ValueError, match="here cpu_kernels='torch'"):
        Engine.from_pretrained(weights="as-stored", cpu_kernels="torch")
    engine = Engine.from_pretrained(batch_invariant=False)  # auto: dequantized, saying why
    try:
        assert engine.stats()["weights"] == "dense"
        assert "batch_invariant=False" in engine.stats()["weights_choice"]
    finally:
        engine.close()


def test_auto_keeps_dense_weights_where_they_fit_and_the_blocks_where_they_would_not(monkeypatch) -> None:
    """Batches measured faster on dense weights on every path: auto dequantizes where the dense
    weights fit in half the memory available (saying why: on a build without AVX-512 the blocks'
    products take a lane at a time), and keeps the blocks where they would not."""
    from kev_engine import platforms

    built = cpu_kernels.load_kernels()
    vectorized = built.quant_path == "avx512"
    assert built.quant_path == ("avx512" if "avx512bw" in cpu_isa.cpu_flags() else "scalar")
    for dtype in ("bfloat16", "float32"):
        engine = Engine.from_pretrained(dtype=dtype)
        try:
            choice = engine.stats()["weights_choice"]
            assert engine.stats()["weights"] == "dense" and "fit in memory" in choice
            assert ("batches measured faster on dense weights" if vectorized else "a lane at a time") in choice
        finally:
            engine.close()
    monkeypatch.setattr(platforms, "available_memory", lambda: 400_000_000)  # 0.27 GB of bf16 > half of it
    stored = Engine.from_pretrained(dtype="bfloat16")
    try:
        assert stored.stats()["weights"] == "as stored (210 Q4_1, 1 Q8_0)"
        assert "would take more than 50% of the memory available (0.4 GB)" in stored.stats()["weights_choice"]
    finally:
        stored.close()


# ---- tiny models through `kev quantize` -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_files(tokenizer, tmp_path_factory):
    """(HF folder, its Q8_0 GGUF, its Q4_0 GGUF) for a tiny llama and a tiny qwen2."""
    root = tmp_path_factory.mktemp("quant")
    files = {}
    for family in ("llama", "qwen2"):
        folder = save_tiny_model(root / family, tokenizer, family)
        files[family] = (folder, quantize(folder, root / f"{family}-q8.gguf", "Q8_0"),
                         quantize(folder, root / f"{family}-q4.gguf", "Q4_0"))
    return files


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_quantized_tiny_models_packed_equal_alone_and_dense(tiny_files, family: str, dtype) -> None:
    _, q8, q4 = tiny_files[family]
    for path in (q8, q4):
        stored = Engine.from_pretrained(str(path), dtype=dtype, weights="as-stored", max_batch_tokens=64)
        dense = Engine.from_pretrained(str(path), dtype=dtype, weights="dense")
        try:
            assert stored.stats()["weights"].startswith("as stored")
            prompts = questions(7, 7)
            packed = answers(stored, prompts, greedy(7))  # chunked: at most 64 tokens a pass
            assert stored.stats()["prefill_passes"] > 1
            assert differences(packed, alone(stored, prompts, greedy(7))) == []
            for got, expected in zip(stored.prompt_logits(prompts[:2]), dense.prompt_logits(prompts[:2])):
                torch.testing.assert_close(got, expected, atol=rounding_tolerance(expected, dtype), rtol=0)
        finally:
            stored.close()
            dense.close()


def test_q8_0_stays_close_to_the_model_it_was_written_from(tiny_files) -> None:
    """The round trip through `kev quantize` keeps the model (rows in transformers' order again):
    Q8_0's logits within a few hundredths of the original's, far nearer than another model's."""
    folder, q8, _ = tiny_files["llama"]
    original = Engine.from_pretrained(str(folder), dtype="float32")
    stored = Engine.from_pretrained(str(q8), dtype="float32", weights="as-stored")
    try:
        a, b = original.prompt_logits(QUESTIONS[:2]), stored.prompt_logits(QUESTIONS[:2])
        for x, y in zip(a, b):
            assert (x - y).abs().max() < 0.05 * x.abs().max()
    finally:
        original.close()
        stored.close()


def test_lora_on_a_quantized_base_equals_peft_on_the_dequantized_model(tiny_files, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    _, q8, _ = tiny_files["qwen2"]
    base = AutoModelForCausalLM.from_pretrained(str(q8.parent), gguf_file=q8.name, dtype=torch.float32).eval()
    folder = make_adapter(base, tmp_path / "a", 1, r=4, lora_alpha=8,
                          target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    engine = Engine.from_pretrained(str(q8), dtype="float32", weights="as-stored", adapters={"a": str(folder)})
    try:
        names = ["a", None, "a"]
        for prompt, name, logits in zip(QUESTIONS[:3], names, engine.prompt_logits(QUESTIONS[:3], adapters=names)):
            reference = PeftModel.from_pretrained(base, str(folder)).eval() if name else base
            with torch.no_grad():
                expected = reference(input_ids=torch.tensor([engine.encode(prompt)])).logits[0]
            if name:
                reference.unload()
            torch.testing.assert_close(logits, expected, atol=rounding_tolerance(expected, torch.float32), rtol=0)
        plain = engine.prompt_logits(QUESTIONS[:1])[0]
        assert not torch.allclose(plain, engine.prompt_logits(QUESTIONS[:1], adapters=["a"])[0], atol=1e-3)  # control
    finally:
        engine.close()


def test_kev_quantize_refuses_what_it_cannot_write(tiny_files, tmp_path, capsys) -> None:
    folder, _, _ = tiny_files["llama"]
    assert cli_main(["quantize", str(folder), str(tmp_path / "x.gguf"), "--type", "Q3_K"]) == 2
    refused = "type 'Q3_K' is not one kev quantize writes; use one of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1"
    assert refused in capsys.readouterr().err
    assert cli_main(["quantize", str(tmp_path), str(tmp_path / "x.gguf")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert cli_main(["quantize", str(folder), str(tmp_path / "ok.gguf"), "--type", "Q5_1"]) == 0
    _, infos = read_header(tmp_path / "ok.gguf")
    assert {info.type for info in infos.values()} == {int(GGMLQuantizationType.Q5_1), int(GGMLQuantizationType.F32)}
    assert GGML_QUANT_SIZES[GGMLQuantizationType.Q5_1] == (32, 24)
