"""KEV_CPU_ISA: one machine runs as a smaller CPU would — Kev's kernel build without AMX or
AVX-512 (a build of its own), `dtype="auto"` reading the CPU's flags less those, and torch's own
dispatch capped to match. What the forced builds then compute is checked by running the
kernel- and isolation-dependent tests under them (`make test-isa`, in .ci/run on CPUs that have
more to turn off)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from kev_engine import loader
from kev_engine.platforms.cpu import dtype_choice, kernels
from kev_engine.platforms.cpu import isa as cpu_isa

ZEN4 = ["fpu", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"]
SAPPHIRE_RAPIDS = [*ZEN4, "amx_tile", "amx_bf16", "amx_int8"]


def test_the_level_comes_from_the_argument_then_the_environment_and_is_checked(monkeypatch) -> None:
    monkeypatch.delenv("KEV_CPU_ISA", raising=False)
    assert cpu_isa.resolve() == "native"
    monkeypatch.setenv("KEV_CPU_ISA", "no-amx")
    assert cpu_isa.resolve() == "no-amx" and cpu_isa.resolve("no-avx512") == "no-avx512"
    monkeypatch.setenv("KEV_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="KEV_CPU_ISA='sse2' is not allowed; use one of native, no-amx, no-avx512"):
        cpu_isa.resolve()


@pytest.mark.parametrize("flags, isa, bf16, left", [
    (SAPPHIRE_RAPIDS, "native", True, {"amx_bf16", "avx512f"}),
    (SAPPHIRE_RAPIDS, "no-amx", True, {"avx512_bf16", "avx512f"}),
    (SAPPHIRE_RAPIDS, "no-avx512", False, {"avx2", "fma"}),
    (ZEN4, "native", True, {"avx512_bf16"}),
    (ZEN4, "no-avx512", False, {"avx2"}),
    (["avx2", "fma"], "native", False, {"avx2"}),
])
def test_each_level_takes_its_instruction_sets_away(monkeypatch, tmp_path, flags, isa, bf16, left) -> None:
    monkeypatch.setattr(cpu_isa, "_proc_flags", lambda: list(flags))
    monkeypatch.setenv("KEV_CACHE_DIR", str(tmp_path))  # where bf16 is native, auto measures: a fake bf16 wins
    monkeypatch.setattr(dtype_choice, "_kernel_step", lambda dtype: 1.0 if dtype == torch.bfloat16 else 2.0)
    seen = cpu_isa.cpu_flags(isa)
    assert left <= seen
    if isa != "native":
        assert not any(f.startswith("amx") for f in seen)
    if isa == "no-avx512":
        assert not any(f.startswith("avx512") for f in seen)
    assert cpu_isa.native_bf16(isa) is bf16
    monkeypatch.setenv("KEV_CPU_ISA", isa)
    expected = torch.bfloat16 if bf16 else torch.float32
    assert loader.resolve_dtype("auto", torch.device("cpu")) == expected  # auto follows the level (and the timing)
    assert loader.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16  # an explicit dtype never moves


def test_each_level_is_a_build_of_its_own_with_its_flags(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KEV_CACHE_DIR", str(tmp_path))
    names = {}
    for isa in cpu_isa.ISAS:
        monkeypatch.setenv("KEV_CPU_ISA", isa)
        names[isa] = kernels.build_name("exact")
        assert kernels.build_flags("exact")[: len(kernels.BUILDS["exact"][2])] == kernels.BUILDS["exact"][2]
    assert len(set(names.values())) == 3
    monkeypatch.setenv("KEV_CPU_ISA", "no-avx512")
    assert {"-mno-avx512f", "-mno-amx-tile"} <= set(kernels.build_flags("fast"))
    calls: list[dict[str, Any]] = []

    def load(name: str, sources: list[str], **kwargs: Any) -> object:
        calls.append({"name": name, **kwargs})
        return object()

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    kernels._build("fast")  # what the compiler is handed
    assert calls[0]["name"] == kernels.build_name("fast") and "-mno-avx512f" in calls[0]["extra_cflags"]
    monkeypatch.delenv("KEV_CPU_ISA")
    assert kernels.build_flags("exact") == kernels.BUILDS["exact"][2]  # native: the flags as they always were


def run_as(isa: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kev_engine.platforms.cpu.isa", isa, "--", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120)


def test_the_runner_sets_kevs_level_and_caps_torchs_dispatch() -> None:
    done = run_as("no-avx512", "import os, torch; print(os.environ['KEV_CPU_ISA'], "
                               "os.environ['ONEDNN_MAX_CPU_ISA'], torch.backends.cpu.get_cpu_capability())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["no-avx512", "AVX2", "AVX2"]
    assert "ATEN_CPU_CAPABILITY=avx2" in done.stderr  # it says what it set
    refused = run_as("avx1024", "pass")
    assert refused.returncode == 2 and "KEV_CPU_ISA='avx1024' is not allowed" in refused.stderr
    usage = subprocess.run([sys.executable, "-m", "kev_engine.platforms.cpu.isa", "native"], capture_output=True,
                           text=True, timeout=60)
    assert usage.returncode == 2 and "usage: python -m kev_engine.platforms.cpu.isa" in usage.stderr
