"""Kev's Triton kernels compile for the GPUs they serve, on a machine without one.

Triton's NVIDIA backend (its wheel carries `ptxas`) compiles a kernel to PTX and a cubin for a
named target with no device present: the attention (bf16, fp16, fp32; grouped heads of 1, 3 and 8;
a head_dim that is not a power of two), the products and the norm, for sm_80 (A100) and sm_90
(H100, H200), and the product on a GGUF's blocks. The interpreter tests run the kernels' Python;
this is what the GPU compiler makes of it, so an error only a compiled kernel has shows here rather
than on a lent GPU — and what the PTX holds: the block product's decode is not contracted into
fused multiply-adds (gguf's `d * q + m` rounds twice), while its product keeps the dense kernel's
multiply-adds, one for one; the control, compiled with contraction, fuses the decode.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kev_engine.platforms.cuda import triton_attention, triton_elementwise, triton_kernels, triton_quant

TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def compile_for(kernel, arch: int, pointers: dict[str, str], constants: dict[str, object], **options):
    """`kernel` compiled for sm_`arch`: pointers typed as given, other runtime arguments int32/fp32."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in ("scale", "eps") else "i32"
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 128), (8, 80)])
def test_attention_compiles(arch, dtype, group, head_dim) -> None:
    rows, tokens = triton_attention.tile_rows(group)
    pointers = {name: TYPES[dtype] for name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
    pointers.update({name: "*i32" for name in ("cu_q_ptr", "seqused_ptr", "table_ptr")})
    compiled = compile_for(triton_attention._paged_attention_kernel, arch, pointers, dict(
        GROUP=group, TOKENS=tokens, ROWS=rows, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=32, BN=triton_attention.BLOCK_N, DOT=True, IEEE=dtype == "fp32"), num_warps=triton_attention.NUM_WARPS,
        enable_fp_fusion=triton_attention.FP_FUSION)
    assert compiled.asm["cubin"]
    assert ("mma" in compiled.asm["ptx"]) == (dtype != "fp32")  # half products on tensor cores, fp32 ones exact


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_products_and_norm_compile(arch, dtype) -> None:
    pointers = {name: TYPES[dtype] for name in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    for n, k in ((896, 896), (1536, 4096)):  # small tiles, and the large weights' 128 x 128 of 8 warps
        tiles = triton_kernels.tiles_for(n, k, torch_dtype)
        options = dict(num_warps=tiles.warps, num_stages=tiles.stages, enable_fp_fusion=triton_kernels.FP_FUSION)
        shape = dict(IEEE=dtype == "fp32", UPCAST=False, BM=tiles.bm, BN=tiles.bn, BK=tiles.bk)
        linear = compile_for(triton_kernels._linear_kernel, arch, pointers, dict(HAS_BIAS=True, **shape), **options)
        spread = compile_for(triton_kernels._chunk_kernel, arch, {"x_ptr": TYPES[dtype], "w_ptr": TYPES[dtype],
                                                                   "p_ptr": "*fp32"}, shape, **options)
        assert linear.asm["cubin"] and spread.asm["cubin"]
        if arch == 80:  # the A100's shared memory a block: 163 KiB
            assert linear.metadata.shared <= 163 * 1024, (tiles, linear.metadata.shared)
    added = compile_for(triton_kernels._add_chunks_kernel, arch, {"p_ptr": "*fp32", "b_ptr": TYPES[dtype],
                                                                  "y_ptr": TYPES[dtype]},
                        dict(HAS_BIAS=True, BLOCK=triton_kernels.ADD_BLOCK), enable_fp_fusion=triton_kernels.FP_FUSION)
    assert added.asm["cubin"]
    norm = compile_for(triton_kernels._rms_norm_kernel, arch, pointers, dict(BLOCK=1024),
                       enable_fp_fusion=triton_kernels.FP_FUSION)
    assert norm.asm["cubin"]
    pointers = {name: TYPES[dtype] for name in ("x_ptr", "d_ptr", "w_ptr", "h_ptr", "y_ptr")}
    add_norm = compile_for(triton_kernels._add_rms_norm_kernel, arch, pointers, dict(BLOCK=1024),
                           enable_fp_fusion=triton_kernels.FP_FUSION)
    assert add_norm.asm["cubin"]


def elementwise_ptx(arch: int, dtype: str, fusion: bool) -> dict[str, str]:
    """The rotary (Qwen2.5-0.5B's 14 query and 2 key heads of 64) and silu·mul kernels' PTX."""
    rotary = compile_for(triton_elementwise._rotary_kernel, arch, {
        name: TYPES[dtype] for name in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "ko_ptr")},
        dict(Q_HEADS=16, K_HEADS=2, HALF=32), enable_fp_fusion=fusion)
    silu = compile_for(triton_elementwise._silu_mul_kernel, arch, {"g_ptr": TYPES[dtype], "y_ptr": TYPES[dtype]},
                       dict(BLOCK=triton_elementwise.SILU_BLOCK), enable_fp_fusion=fusion)
    assert rotary.asm["cubin"] and silu.asm["cubin"]
    return {"rotary": rotary.asm["ptx"], "silu": silu.asm["ptx"]}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_elementwise_compile_uncontracted(arch, dtype) -> None:
    """As shipped, the fp32 rotary rounds each product before the sum, as torch does: no fused
    multiply-add in its PTX; the control, compiled with contraction, fuses them."""
    shipped = elementwise_ptx(arch, dtype, fusion=triton_elementwise.FP_FUSION)
    assert fused(shipped["rotary"]) == 0
    if dtype == "fp32":
        assert fused(elementwise_ptx(arch, dtype, fusion=True)["rotary"]) > 0


def quant_ptx(arch: int, name: str, fusion: bool) -> str:
    code, block_bytes = triton_quant.FORMATS[name]
    pointers = {"x_ptr": "*fp32", "q_ptr": "*u8", "y_ptr": "*fp32"}
    return compile_for(triton_quant._quant_linear_kernel, arch, pointers, dict(
        FORMAT=code, BLOCK_BYTES=block_bytes, BF16=False, IEEE=True, UPCAST=False, BM=64, BN=64, BK=64),
        num_warps=4, num_stages=3, enable_fp_fusion=fusion).asm["ptx"]


def fused(ptx: str) -> int:
    return len(re.findall(r"\bfma\.rn\.f32\b", ptx))


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", list(triton_quant.FORMATS))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_quant_product_compiles(arch, name, dtype) -> None:
    code, block_bytes = triton_quant.FORMATS[name]
    pointers = {"x_ptr": TYPES[dtype], "q_ptr": "*u8", "y_ptr": TYPES[dtype]}
    compiled = compile_for(triton_quant._quant_linear_kernel, arch, pointers, dict(
        FORMAT=code, BLOCK_BYTES=block_bytes, BF16=dtype == "bf16", IEEE=dtype == "fp32", UPCAST=False,
        BM=triton_kernels.BLOCK_M, BN=triton_kernels.BLOCK_N, BK=triton_kernels.BLOCK_K),
        num_warps=triton_kernels.NUM_WARPS, num_stages=triton_kernels.NUM_STAGES, enable_fp_fusion=False)
    assert compiled.asm["cubin"] and ("mma" in compiled.asm["ptx"]) == (dtype == "bf16")


def test_quant_decode_is_not_contracted() -> None:
    """fp32, 64x64x64 tiles: the dense kernel's product is 4096 multiply-adds in its PTX (a chunk's
    steps written twice: the first chunk's and the others' loop); the Q4_1 kernel as shipped (no
    contraction) has exactly those, and its decode's mul and add apart; the control, the same
    kernel compiled with contraction, has more fused ones: its decode fused."""
    dense = compile_for(triton_kernels._linear_kernel, 90, {n: "*fp32" for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")},
                        dict(HAS_BIAS=False, IEEE=True, UPCAST=False, BM=64, BN=64, BK=64), num_warps=4, num_stages=3,
                        enable_fp_fusion=triton_kernels.FP_FUSION).asm["ptx"]
    shipped, control = quant_ptx(90, "Q4_1", fusion=False), quant_ptx(90, "Q4_1", fusion=True)
    assert fused(shipped) == fused(dense) > 0
    assert re.search(r"\bmul\.(rn\.)?f32\b", shipped) and re.search(r"\badd\.(rn\.)?f32\b", shipped)
    assert fused(control) > fused(dense)
