"""The GPU's product on a GGUF's blocks (`platforms.cuda.triton_quant`), run by Triton's interpreter on CPU.

For Q8_0, Q4_0 and Q4_1 blocks of random weights (gguf's own quantizer), in float32 and bfloat16, at
1, 5 and 70 rows, K of 160 and of 1,088 (two chunks of the weight shape's `Tiles`, which the dense
product gives programs of their own at these row counts, the block product not): the product on
the blocks is bit for bit the dense fixed-order product (`triton_kernels.linear`) on the weight
gguf's `dequantize` gives, rounded to the dtype as torch rounds it — the decode in the tile
changes no bit. The control: the same comparison against the dequantized weight with one entry
off by 1 finds the difference (every row's input at that entry's column is 1, so the output moves
by 1 against outputs near 0.6: far above bf16's rounding, whatever the random draw). In a process
of its own (TRITON_INTERPRET=1 must be set before Triton compiles anything). What the GPU compiler
makes of the kernel is tests/test_triton_compile.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import itertools
    import numpy as np, torch
    from gguf import GGMLQuantizationType, quants
    from kev_engine.platforms.cuda import triton_kernels, triton_quant

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    for (N, K), name in itertools.product(((96, 160), (96, 1088)), ("Q8_0", "Q4_0", "Q4_1")):
        # a partial tile of outputs; K over two and a half steps of 64, or in two chunks (`Tiles`)
        weights = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
        kind = GGMLQuantizationType[name]
        blocks = quants.quantize(weights, kind)
        dequantized = torch.from_numpy(quants.dequantize(blocks, kind).reshape(N, K).copy())
        stored = torch.from_numpy(blocks.view(np.uint8).reshape(N, -1).copy())
        for dtype in (torch.float32, torch.bfloat16):
            dense = dequantized.to(dtype)
            nudged = dense.clone()
            nudged[7, 33] = dense[7, 33] + 1  # one weight decoded wrong
            rows = torch.randn(70, K).to(dtype)
            rows[:, 33] = 1  # so the wrong weight moves output 7 by 1 in every row
            for m in (1, 5, 70):
                got = triton_quant.quant_linear(rows[:m], stored, name, K)
                assert got.dtype == dtype and got.shape == (m, N)
                assert torch.equal(got, triton_kernels.linear(rows[:m], dense, None)), (name, dtype, m)
                assert not torch.equal(got, triton_kernels.linear(rows[:m], nudged, None)), ("control", name, dtype, m)
    for bad, match in ((lambda: triton_quant.quant_linear(rows, stored, "Q5_K", K), "format='Q5_K' is not allowed"),
                       (lambda: triton_quant.quant_linear(rows, stored[:, :-1], "Q4_1", K), "uint8 bytes a row"),
                       (lambda: triton_quant.quant_linear(rows.half(), stored, "Q4_1", K), "float32 and bfloat16")):
        try:
            bad()
        except ValueError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(match)
    print("quant ok")
""")


def test_quant_product_equals_dense_on_dequantized_bitwise() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "quant ok" in done.stdout, done.stderr[-3000:]
