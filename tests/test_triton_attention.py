"""Kev's Triton paged attention (`platforms.cuda.triton_attention`), run by Triton's interpreter on CPU.

Each case (tests/triton_attention_cases.py) runs in a process of its own with TRITON_INTERPRET=1:
the kernel against causal attention per segment in float32 (grouped heads, head sizes and block
sizes of every kind, NaN in every pool byte nobody wrote, both forms of its products), and bit for
bit the same rows alone as packed, whole as in chunks, with a graph bucket's padding rows as
without — with the control, key blocks sized by the pass, that differs. Under the interpreter the
products are elementwise sums (numpy's matrix product may order a row's sum by its place in the
tile); the GPU's tensor-core form is checked against the reference here, and bit for bit by
tests/test_cuda.py on a GPU (`make gpu-check`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).resolve().parent / "triton_attention_cases.py"


@pytest.mark.parametrize("case", ["matches_reference", "same_alone_as_packed", "padding_rows_change_nothing"])
def test_triton_paged_attention_in_the_interpreter(case: str) -> None:
    done = subprocess.run([sys.executable, str(CASES), case], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and f"{case} ok" in done.stdout, done.stderr[-3000:]
