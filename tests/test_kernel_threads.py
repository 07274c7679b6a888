"""Kev's kernel threads (csrc/pool.h) and the `threads` setting: tasks handed to whichever thread
is free change no bit whatever the thread count, a call from two threads at once, from a forked
child (whose parent's workers do not exist) or one whose task raises still completes, and the
setting is checked, said in `stats()`, and read from `KEV_THREADS`."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import tiny_model

from kev_engine import Engine
from kev_engine.models import DecoderModel
from kev_engine.platforms.cpu.kernels import load_kernels
from kev_engine.platforms.threads import use_threads

SHAPES = [(1, 576, 1536), (16, 576, 1536), (200, 576, 1000)]  # a decode row, a decode step, a prefill


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _products(kernels: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for rows, k, n in SHAPES:
        x = torch.randn(rows, k, generator=generator).to(dtype)
        weight = torch.randn(n, k, generator=generator).to(dtype)
        out.append(kernels.linear_packed(x, kernels.linear_pack(weight), n, None))
        out.append(kernels.rms_norm(out[-1], torch.ones(n, dtype=dtype), 1e-6))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_thread_count_gives_the_same_bits(dtype: torch.dtype, restore_threads: None) -> None:
    kernels = load_kernels()
    torch.set_num_threads(1)
    alone = _products(kernels, dtype)
    for threads in (2, 3, 7):  # 7: more threads than this machine's cores, some always late
        torch.set_num_threads(threads)
        for ours, reference in zip(_products(kernels, dtype), alone):
            assert torch.equal(ours, reference), f"{threads} threads changed a {dtype} result"
    torch.set_num_threads(2)  # the control: another summation order is caught by the same comparison
    x = torch.randn(16, 576, dtype=dtype)
    weight = torch.randn(100, 576, dtype=dtype)
    halves = (kernels.linear_packed(x[:, :288].contiguous(), kernels.linear_pack(weight[:, :288].contiguous()), 100,
                                    None).float()
              + kernels.linear_packed(x[:, 288:].contiguous(), kernels.linear_pack(weight[:, 288:].contiguous()), 100,
                                      None).float()).to(dtype)
    assert not torch.equal(halves, kernels.linear_packed(x, kernels.linear_pack(weight), 100, None))


def test_calls_from_two_threads_at_once_each_get_their_own_bits(restore_threads: None) -> None:
    kernels = load_kernels()
    torch.set_num_threads(2)
    expected = _products(kernels, torch.float32)
    results: list[list[torch.Tensor]] = [[], [], []]

    def call(slot: int) -> None:
        for _ in range(5):
            results[slot] = _products(kernels, torch.float32)

    callers = [threading.Thread(target=call, args=(slot,)) for slot in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=300)
    assert not any(caller.is_alive() for caller in callers)
    for got in results:
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _in_child(queue: Any, kernels: Any, x: torch.Tensor, packed: torch.Tensor, n: int) -> None:
    queue.put(kernels.linear_packed(x, packed, n, None).tolist())  # Kev's pool alone: torch's own ops
    # (libgomp's) are not safe in a child forked after they ran, so the inputs come from the parent


def test_a_forked_child_computes_without_its_parents_workers(restore_threads: None) -> None:
    kernels = load_kernels()
    torch.set_num_threads(2)
    x, weight = torch.randn(16, 576), torch.randn(1000, 576)
    packed = kernels.linear_pack(weight)
    expected = kernels.linear_packed(x, packed, 1000, None)  # the parent's pool has started its workers
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_child, args=(queue, kernels, x, packed, 1000))
    child.start()
    try:
        got = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert torch.equal(torch.tensor(got), expected)


def test_an_error_raised_in_a_task_reaches_the_caller(restore_threads: None) -> None:
    kernels = load_kernels()
    torch.set_num_threads(2)
    query = torch.randn(4, 2, 16)
    keys = torch.zeros(2, 1, 16, 32)  # an exact pool: 2 blocks
    values = torch.zeros(2, 1, 32, 16)
    tables = torch.tensor([[5]], dtype=torch.int32)  # a block the pool does not have
    with pytest.raises(RuntimeError, match="block 5 of 2"):
        kernels.paged_attention(query, keys, values, tables, torch.tensor([0, 4], dtype=torch.int32),
                                torch.tensor([0], dtype=torch.int32), 0.25)
    assert torch.equal(_products(kernels, torch.float32)[0], _products(kernels, torch.float32)[0])  # still serves


def test_threads_is_set_checked_and_said(tokenizer: Any, restore_threads: None, monkeypatch: Any) -> None:
    with Engine(tiny_model("llama", tokenizer), tokenizer, threads=1) as engine:
        assert engine.stats()["threads"] == 1 == torch.get_num_threads()
    monkeypatch.setenv("KEV_THREADS", "2")
    assert use_threads(None) == 2 == torch.get_num_threads()
    assert use_threads(1) == 1  # the argument wins over the variable
    for bad, said in ((0, "threads=0"), (2.5, "threads=2.5"), (True, "threads=True")):
        with pytest.raises(ValueError, match=said):
            use_threads(bad)  # type: ignore[arg-type]
    monkeypatch.setenv("KEV_THREADS", "many")
    with pytest.raises(ValueError, match="KEV_THREADS='many' is not allowed"):
        use_threads(None)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_torch_runs_serially_on_the_pass_thread_only_where_kev_computes_everything(
        tokenizer: Any, restore_threads: None, batch_invariant: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(2)
    seen: list[int] = []
    forward = DecoderModel.forward

    def spy(self: DecoderModel, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DecoderModel, "forward", spy)
    with Engine(tiny_model("llama", tokenizer), tokenizer, batch_invariant=batch_invariant) as engine:
        engine.generate([{"prompt_token_ids": [1, 2, 3]}])
    # batch-invariant: Kev's pool does the work, torch's own ops stay on the pass's thread; the
    # control: on torch's kernels (BLAS) torch keeps its threads
    assert seen and set(seen) == ({1} if batch_invariant else {2})
    assert torch.get_num_threads() == 2  # the caller's thread keeps torch's count
