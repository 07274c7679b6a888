"""The batch-invariant Linear kernel (csrc/linear.cpp) on its own: a row's product is bitwise the
same at every row count and thread count — alone (the one-row decode tasks), in a short last
tile, in row blocks of any split — and equal to a float64 reference within rounding.

The row counts cross the kernel's seams: 1 (its one-row path), tiles of 6 and their remainders,
blocks of 96 and the balanced blocks of 97, 191 and 307 rows; the output counts cross its panels of
16 (200 = 12 panels + 8, 40 = 2 panels + 8), and K crosses the paths without AMX's K blocks (576 =
4.5 of a decode pass's blocks of 128; 2051 = a prefill pass's block of 2048 and 3 more) and their
pairs (67 and 2051: odd). Every bf16 instruction path this CPU has is checked, not
only the one its engines use: AMX, AVX512-BF16 (the path of CPUs without AMX, forced here) and the
fused multiply-add fallback; a path the CPU lacks is reported as skipped with the reason. The control
shows the comparison can fail: the same row summed in another order (K in two halves) is caught.
The fma path's arithmetic is pinned bitwise: each output the fp32 sum, k by k from 0, of its exact
products (a product of two bf16s is exact in fp32, so a fused multiply-add adds it with one rounding).
"""

from __future__ import annotations

import pytest
import torch

from kev_engine.platforms.cpu.kernels import load_kernels

ROWS = [1, 2, 5, 6, 7, 13, 95, 96, 97, 191, 307]
# (dtype, bf16 instruction path): "" is this machine's own
PATHS = [(torch.float32, ""), (torch.bfloat16, "amx"), (torch.bfloat16, "avx512_bf16"), (torch.bfloat16, "fma")]


@pytest.fixture(scope="module")
def kernels():
    return load_kernels()


def product(kernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, path: str = "") -> torch.Tensor:
    return kernels.linear_packed(x, kernels.linear_pack(weight), weight.shape[0], bias, path)


def require_path(kernels, path: str) -> None:
    """Skip, naming what is missing, where this CPU or build has no such bf16 path."""
    try:
        product(kernels, torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(1, 2, dtype=torch.bfloat16), None, path)
    except RuntimeError as exc:
        pytest.skip(f"{exc}".splitlines()[0])


def rows_differing(got: torch.Tensor, alone: torch.Tensor) -> list[int]:
    return [i for i in range(got.shape[0]) if not torch.equal(got[i], alone[i])]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype,path", PATHS, ids=["fp32", "bf16-amx", "bf16-avx512_bf16", "bf16-fma"])
@pytest.mark.parametrize("out_features,in_features", [(200, 48), (40, 67), (576, 576), (40, 2051)])
def test_every_row_equals_itself_alone(kernels, threads: int, dtype: torch.dtype, path: str, out_features: int,
                                       in_features: int) -> None:
    if path:
        require_path(kernels, path)
    torch.manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features) * 0.1).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    x = torch.randn(max(ROWS), in_features).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([product(kernels, x[i : i + 1], weight, bias, path) for i in range(x.shape[0])])
        for rows in ROWS:
            got = product(kernels, x[:rows], weight, bias, path)
            assert rows_differing(got, alone[:rows]) == [], rows
    finally:
        torch.set_num_threads(before)
    reference = (x.double() @ weight.double().T + bias.double()).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone, reference, atol=tolerance, rtol=tolerance)


def test_control_a_row_summed_in_another_order_is_caught(kernels) -> None:
    """K in two halves, summed after: the same numbers to rounding, other bits somewhere."""
    torch.manual_seed(0)
    weight, x = torch.randn(200, 96), torch.randn(31, 96)
    half = weight.shape[1] // 2
    split = (product(kernels, x[:, :half].contiguous(), weight[:, :half].contiguous(), None)
             + product(kernels, x[:, half:].contiguous(), weight[:, half:].contiguous(), None))
    whole = product(kernels, x, weight, None)
    torch.testing.assert_close(split, whole)
    assert rows_differing(split, whole) != []


def sequential_sums(x: torch.Tensor, weight: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """out[i, j] = fp32 sum over k (from 0, or from K-1) of x[i, k] * w[j, k], rounded once to bf16."""
    xs, ws = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in (reversed(range(x.shape[1])) if reverse else range(x.shape[1])):
        acc = acc + xs[:, k: k + 1] * ws[None, :, k]  # each product exact in fp32
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,in_features,out_features",
                         [(1, 64, 96), (7, 67, 200), (16, 576, 960), (97, 130, 64), (200, 2051, 40)])
def test_the_fma_path_is_each_outputs_sum_in_k_order_bitwise(kernels, threads: int, rows: int, in_features: int,
                                                             out_features: int) -> None:
    """The vectorized fma path (AVX-512) and its plain loop (other builds) against the sum written
    out in torch; the control (below): the same sums taken from k = K-1 down differ somewhere."""
    generator = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = product(kernels, x, weight, None, "fma")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, sequential_sums(x, weight))


def test_control_the_fma_reference_sees_another_order(kernels) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 576, generator=generator).to(torch.bfloat16)
    weight = torch.randn(960, 576, generator=generator).to(torch.bfloat16)
    got = product(kernels, x, weight, None, "fma")
    assert torch.equal(got, sequential_sums(x, weight))
    assert not torch.equal(got, sequential_sums(x, weight, reverse=True))
