"""Loading runs on a thread that ends, so the caller's thread keeps no OpenMP team beside the
scheduler thread's (kev_engine/threads.py says why that slows every pass)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kev_engine import Engine, loader
from kev_engine.adapters.pool import AdapterPool
from kev_engine.platforms.threads import run_on_passing_thread


def test_passing_thread_returns_the_result_and_has_ended() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return int(torch.arange(10).sum())

    assert run_on_passing_thread(work, "t") == 45
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_passing_thread_hands_back_the_exception_itself() -> None:
    error = KeyError("missing")

    def fail() -> None:
        raise error

    with pytest.raises(KeyError) as caught:
        run_on_passing_thread(fail, "t")
    assert caught.value is error


def test_from_pretrained_and_load_adapter_load_on_ended_threads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The real embedded load, spied on: the model and the adapter are read off the caller's thread."""
    threads: dict[str, threading.Thread] = {}
    real_load, real_read = loader.load, AdapterPool.read

    def spy_load(*args: Any) -> Any:
        threads["model"] = threading.current_thread()
        return real_load(*args)

    def spy_read(self: AdapterPool, name: str, path: str) -> Any:
        threads["adapter"] = threading.current_thread()
        return real_read(self, name, path)

    monkeypatch.setattr(loader, "load", spy_load)
    monkeypatch.setattr(AdapterPool, "read", spy_read)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with Engine.from_pretrained() as engine:
        base = AutoModelForCausalLM.from_config(engine.model.config)
        get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path)
        engine.load_adapter("a", str(tmp_path))
        assert engine.adapters == ["a"]
        [answer] = engine.generate(["Hi"], sampling={"temperature": 0, "max_tokens": 2}, adapters="a")
        assert answer.completion_tokens > 0
    for kind, thread in threads.items():
        assert thread is not threading.current_thread(), kind
        assert not thread.is_alive(), kind
