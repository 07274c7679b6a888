"""`kev serve` as a user starts it (issue 23, item 6): a model or adapter that cannot load exits 2
with the reason on stderr, as `kev generate` does, instead of a server answering 503 forever; a
good start prints a "ready" line with the URL; `--help` lists the endpoints.

Each server is the real CLI in a subprocess on a tiny model folder, bounded and always killed.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import save_tiny_model

from kev_integrations import cli

EXIT_TIMEOUT_S = 180  # importing torch and loading a tiny model, on a busy 2-core machine


@pytest.fixture(scope="module")
def model_dir(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer))


def _kev_serve(*flags: str) -> subprocess.Popen[str]:
    # --port 0: the OS picks a free port; the ready line says which
    return subprocess.Popen([sys.executable, "-m", "kev_integrations", "serve", "--port", "0", *flags], text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "KEV_API_KEY": ""})


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def _exit_and_stderr(process: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = process.communicate(timeout=EXIT_TIMEOUT_S)
    return process.returncode, err


def test_a_model_that_cannot_load_exits_2_with_the_reason(started: list[Any], tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    started.append(process := _kev_serve("--model", missing))
    code, err = _exit_and_stderr(process)
    assert code == 2, err[-2000:]
    assert f"kev: error: --model {missing!r} could not be loaded" in err and "does not exist" in err


def test_a_damaged_adapter_exits_2_naming_it(started: list[Any], model_dir: str, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    started.append(process := _kev_serve("--model", model_dir, "--adapter", f"sql={broken}"))
    code, err = _exit_and_stderr(process)
    assert code == 2, err[-2000:]
    assert f"kev: error: --adapter sql={broken} could not be loaded: AdapterError" in err
    assert "kev: ready" not in err


def test_a_missing_adapter_folder_exits_2_before_loading_anything(capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.setattr("kev_engine.Engine.from_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["serve", "--adapter", f"sql={tmp_path / 'nope'}"]) == 2
    assert f"kev: error: --adapter sql={tmp_path / 'nope'}: folder" in capsys.readouterr().err


def test_a_good_start_prints_ready_with_the_url(started: list[Any], model_dir: str) -> None:
    started.append(process := _kev_serve("--model", model_dir, "--served-model-name", "tiny", "--speculative", "ngram"))
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    ready = None
    while ready is None:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))  # queue.Empty: never ready in time
        ready = re.search(r"kev: ready: (\S+) \((?:float32|bfloat16), (?:not )?batch-invariant\) "
                          r"at (http://127\.0\.0\.1:\d+) ", line)
    name, url = ready.groups()
    assert name == "tiny"
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}  # ready means ready
    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]] == ["tiny"]
    assert "kev_draft_tokens_total 0" in httpx.get(url + "/metrics", timeout=30).text  # speculation's counters
    process.send_signal(signal.SIGTERM)
    assert process.wait(EXIT_TIMEOUT_S) == 0


def test_help_lists_the_endpoints(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for endpoint in ("POST /v1/chat/completions, /v1/completions", "GET  /v1/models", "GET  /health",
                     "GET  /metrics", "/kev/v1/generate", "DELETE /admin/adapters/NAME", "POST /admin/defaults"):
        assert endpoint in out
