"""`dtype="auto"` on a CPU: bfloat16 only where Kev's products measure faster in it, measured once
per machine and build, cached, said; float32 unmeasured without native bf16; explicit dtypes kept."""

from __future__ import annotations

import json

import pytest
import torch

from kev_engine import Engine, loader
from kev_engine.platforms.cpu import dtype_choice
from kev_engine.platforms.cpu import isa as cpu_isa

CPU = torch.device("cpu")


def never(dtype: torch.dtype) -> float:
    raise AssertionError("measured although it should not have been")


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    """The decisions' file of this test alone (the kernels and converted models stay shared)."""
    path = tmp_path / dtype_choice.CACHE_FILE
    monkeypatch.setattr(dtype_choice, "_cache_path", lambda: path)
    return path


def test_without_native_bf16_it_is_float32_and_nothing_is_measured(monkeypatch) -> None:
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda isa=None: False)
    choice = dtype_choice.choose(never)
    assert choice.dtype == "float32" and "emulated" in choice.reason
    monkeypatch.setattr(dtype_choice, "_kernel_step", never)
    assert loader.resolve_dtype("auto", CPU) == torch.float32


@pytest.mark.parametrize(("fp32_ms", "bf16_ms", "expected"), [(10.0, 5.0, "bfloat16"), (5.0, 10.0, "float32")])
def test_with_native_bf16_the_faster_dtype_wins_and_is_cached(monkeypatch, private_cache, caplog, fp32_ms, bf16_ms,
                                                              expected) -> None:
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda isa=None: True)
    timings = {torch.float32: fp32_ms, torch.bfloat16: bf16_ms}
    with caplog.at_level("INFO", logger="kev"):
        choice = dtype_choice.choose(timings.__getitem__)
    assert choice.dtype == expected and (choice.float32_ms, choice.bfloat16_ms) == (fp32_ms, bf16_ms)
    assert f"dtype='auto' is {expected} here" in caplog.text and "measured once" in choice.reason
    cached = json.loads(private_cache.read_text())
    assert [entry["dtype"] for entry in cached.values()] == [expected]
    assert dtype_choice.choose(never) == choice  # the second asks the cache
    monkeypatch.setattr(dtype_choice, "_key", lambda: "another build")
    assert dtype_choice.choose(timings.__getitem__) == choice  # a new build measures again


def test_an_explicit_dtype_is_honoured_whatever_was_measured(monkeypatch) -> None:
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda isa=None: True)
    monkeypatch.setattr(dtype_choice, "_kernel_step", lambda dtype: 1.0 if dtype == torch.float32 else 9.0)
    assert loader.resolve_dtype("auto", CPU) == torch.float32
    assert loader.resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert loader.resolve_dtype(torch.bfloat16, CPU) == torch.bfloat16


def test_the_kernels_products_are_really_timed_in_both_dtypes(monkeypatch) -> None:
    """The default measurement: Kev's packed products and attention for a decode step and its prompt
    rows' prefill, each dtype."""
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda isa=None: True)
    choice = dtype_choice.choose()
    assert choice.float32_ms is not None and choice.float32_ms > 0
    assert choice.bfloat16_ms is not None and choice.bfloat16_ms > 0
    assert choice.dtype == ("bfloat16" if choice.bfloat16_ms < choice.float32_ms else "float32")


def test_a_decode_steps_attention_counts_beside_its_products(monkeypatch) -> None:
    """bf16 halves the KV cache's bytes, which products alone do not show: where the products tie,
    the attention decides (and it is timed on the kernels' own paged pool, in each dtype)."""
    loaded = dtype_choice.kernels.load_kernels()
    for dtype in (torch.float32, torch.bfloat16):
        assert dtype_choice._attention(loaded, dtype) > 0
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda isa=None: True)
    monkeypatch.setattr(dtype_choice, "_products", lambda loaded, dtype, path="": 100.0)
    monkeypatch.setattr(dtype_choice, "_attention", lambda loaded, dtype: 8.0 if dtype == torch.float32 else 4.0)
    choice = dtype_choice.choose()
    assert (choice.dtype, choice.float32_ms, choice.bfloat16_ms) == ("bfloat16", 108.0, 104.0)


def test_the_engine_says_what_auto_chose_and_why(monkeypatch) -> None:
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda isa=None: False)
    engine = Engine.from_pretrained(dtype="auto", device="cpu")
    try:
        stats = engine.stats()
        assert stats["dtype"] == "float32" and "emulated" in stats["dtype_choice"]
    finally:
        engine.close()
    engine = Engine.from_pretrained(dtype="float32", device="cpu")
    try:
        assert engine.stats()["dtype_choice"] == "the model's own dtype"
    finally:
        engine.close()


class FakeBuild:
    """The exact build as `choose_bf16_path` sees it: its own bf16 path, and which it refuses."""

    def __init__(self, native: str, refuse: frozenset[str] = frozenset()) -> None:
        self.native, self.refuse, self.set_to = native, refuse, None

    def linear_paths(self) -> str:
        return f"float32:avx512_fma bfloat16:{self.set_to or self.native}"

    def set_bf16_path(self, name: str) -> None:
        if name in self.refuse:
            raise RuntimeError(f"linear: the {name} path is not available on this machine")
        self.set_to = name


def never_timed(exact, dtype, path="") -> float:
    raise AssertionError("measured although it should not have been")


def test_with_amx_bf16_products_run_on_amx_unmeasured(monkeypatch) -> None:
    monkeypatch.delenv(dtype_choice.PATH_ENV, raising=False)
    monkeypatch.setattr(dtype_choice, "_products", never_timed)
    build = FakeBuild("amx")
    assert dtype_choice.choose_bf16_path(build).path == "amx" and build.set_to is None
    assert dtype_choice.choose_bf16_path(FakeBuild("fma")).path == "fma"  # no native bf16: nothing to choose


@pytest.mark.parametrize(("timings", "expected"), [({"avx512_bf16": 3.0, "fma": 5.0}, "avx512_bf16"),
                                                   ({"avx512_bf16": 9.0, "fma": 5.0}, "fma")])
def test_without_amx_the_faster_path_is_measured_set_and_cached(monkeypatch, private_cache, caplog, timings,
                                                                expected) -> None:
    monkeypatch.delenv(dtype_choice.PATH_ENV, raising=False)
    monkeypatch.setattr(dtype_choice, "_build_key", lambda: "this build")
    monkeypatch.setattr(dtype_choice, "_products", lambda exact, dtype, path="": timings[path])
    build = FakeBuild("avx512_bf16")
    with caplog.at_level("INFO", logger="kev"):
        choice = dtype_choice.choose_bf16_path(build)
    assert choice.path == expected and build.set_to == expected and choice.timings_ms == timings
    assert f"bfloat16 products run on the {expected} path here" in caplog.text and "measured once" in choice.reason
    monkeypatch.setattr(dtype_choice, "_products", never_timed)
    again = FakeBuild("avx512_bf16")
    assert dtype_choice.choose_bf16_path(again) == choice and again.set_to == expected  # the cache, set again
    monkeypatch.setattr(dtype_choice, "_build_key", lambda: "another build")
    with pytest.raises(AssertionError, match="measured although"):
        dtype_choice.choose_bf16_path(FakeBuild("avx512_bf16"))  # a new build measures again


def test_kev_bf16_path_names_one_unmeasured_and_a_bad_one_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(dtype_choice, "_products", never_timed)
    monkeypatch.setenv(dtype_choice.PATH_ENV, "avx512_bf16")
    build = FakeBuild("amx")
    assert dtype_choice.choose_bf16_path(build).path == "avx512_bf16" and build.set_to == "avx512_bf16"
    monkeypatch.setenv(dtype_choice.PATH_ENV, "avx1024")
    with pytest.raises(ValueError, match="KEV_BF16_PATH='avx1024' is not allowed; use one of amx, avx512_bf16, fma"):
        dtype_choice.choose_bf16_path(FakeBuild("amx"))
    monkeypatch.setenv(dtype_choice.PATH_ENV, "amx")
    with pytest.raises(ValueError, match="KEV_BF16_PATH='amx' cannot run here: linear: the amx path is not available"):
        dtype_choice.choose_bf16_path(FakeBuild("avx512_bf16", refuse=frozenset({"amx"})))


def test_the_kernels_keep_one_bf16_path_once_a_product_ran() -> None:
    """linear.cpp refuses another default path after a product ran on this one, naming both."""
    from kev_engine.platforms.cpu import kernels

    loaded = kernels.load_kernels()
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    loaded.linear_packed(x, loaded.linear_pack(x), 2)  # a product on the process's path
    current = loaded.bf16_path.path
    assert f"bfloat16:{current}" in loaded.linear_paths
    loaded.set_bf16_path(current)  # the same path: nothing changes
    other = "fma" if current != "fma" else "avx512_bf16"
    with pytest.raises(RuntimeError, match=f"already ran on the {current} path|this build has no avx512_bf16 path"):
        loaded.set_bf16_path(other)
