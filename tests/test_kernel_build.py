"""Kev's CPU kernels build once per machine: a folder per build identity (sources, flags, torch,
CPU), the sources copied in, so another checkout or venv with the same sources reuses the build;
a build says so while it runs, a process waiting for another's build says so, and a lock file a
killed build left behind does not make everyone wait forever.

One real build of the small "fast" kernels into a temporary cache (about a minute on 2 cores).
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import threading
from pathlib import Path

import pytest
from server_util import wait_for

from kev_engine import kernels


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KEV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "PROGRESS_EVERY_S", 2.0)
    return tmp_path


def checkout(root: Path, name: str) -> Path:
    """The kernel sources as another checkout of the project holds them — marked, so their build is
    not the one this test process may already have loaded (torch reuses a loaded extension's name)."""
    folder = root / name / "csrc"
    shutil.copytree(kernels.CSRC, folder)
    source = folder / "paged_decode.cpp"
    source.write_text(source.read_text() + "\n// a copy built by tests/test_kernel_build.py\n")
    return folder


def test_one_build_serves_every_checkout_and_says_what_it_does(fresh_cache, monkeypatch, caplog) -> None:
    first, second = checkout(fresh_cache, "a"), checkout(fresh_cache, "b")
    monkeypatch.setattr(kernels, "CSRC", first)
    name = kernels.build_name("fast")
    folder = kernels.build_root() / name
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")  # left by a build that was killed: torch would wait on it forever
    with caplog.at_level(logging.WARNING, logger="kev"):
        module = kernels._build("fast")
    assert hasattr(module, "paged_decode")
    assert f"building Kev's CPU kernels ({name})" in caplog.text and f"built Kev's CPU kernels ({name})" in caplog.text
    built = folder / f"{name}.so"
    stamp = built.stat().st_mtime_ns
    assert not (folder / "lock").exists()

    caplog.clear()
    monkeypatch.setattr(kernels, "CSRC", second)  # the same sources at another path
    assert kernels.build_name("fast") == name
    with caplog.at_level(logging.WARNING, logger="kev"):
        kernels._build("fast")
    assert "building" not in caplog.text  # found, not rebuilt
    assert built.stat().st_mtime_ns == stamp

    (second / "paged_decode.cpp").write_text((second / "paged_decode.cpp").read_text() + "// changed\n")
    assert kernels.build_name("fast") != name  # other sources: another build, never a stale one


def test_a_process_waiting_for_another_build_says_so(fresh_cache, monkeypatch, caplog) -> None:
    folder = kernels.build_root() / "kev_fast_test"
    folder.mkdir(parents=True)
    entered = threading.Event()
    with open(folder / ".kev-build.lock", "w") as other:  # another process is building here
        fcntl.flock(other, fcntl.LOCK_EX)

        def wait() -> None:
            with kernels._build_lock(folder, "kev_fast_test"):
                entered.set()

        with caplog.at_level(logging.WARNING, logger="kev"):
            waiter = threading.Thread(target=wait)
            waiter.start()
            wait_for(lambda: "waiting for another process" in caplog.text, 30, "the waiter to say it waits")
            assert not entered.is_set()  # blocked while the lock is held
            fcntl.flock(other, fcntl.LOCK_UN)
            waiter.join(30)
    assert entered.is_set()
    assert "waiting for another process that is building Kev's CPU kernels (kev_fast_test)" in caplog.text
