"""Kev's CPU kernels build once per environment: a folder per build identity (sources, flags, torch,
CPU, and the compiler and include paths of the environment, which ninja's command lines hold), the
sources copied in, so another checkout in the same environment reuses the build and environments
sharing the cache never rebuild each other's; a build says so while it runs, a process waiting for
another's build says whose and why, and a lock file a killed build left behind does not make
everyone wait forever.

One real build of the small "fast" kernels into a temporary cache (about a minute on 2 cores).
"""

from __future__ import annotations

import logging
import multiprocessing
import shlex
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from server_util import wait_for

from kev_engine.platforms.cpu import build_lock, kernels


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


def command_line_paths(ninja_file: Path) -> set[str]:
    """The compiler and every path in the compile and link lines of a build.ninja torch wrote."""
    values = dict(line.split(" = ", 1) for line in ninja_file.read_text().splitlines() if " = " in line)
    tokens = shlex.split(values["cflags"]) + shlex.split(values["ldflags"])
    return {values["cxx"]} | {token.removeprefix("-L").removeprefix("-I") for token in tokens if "/" in token}


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
    # every path of this environment that ninja compares between runs is in the build's name
    assert command_line_paths(folder / "build.ninja") <= set(kernels.toolchain())

    caplog.clear()
    monkeypatch.setattr(kernels, "CSRC", second)  # the same sources at another path
    assert kernels.build_name("fast") == name
    with caplog.at_level(logging.WARNING, logger="kev"):
        kernels._build("fast")
    assert "building" not in caplog.text  # found, not rebuilt
    assert built.stat().st_mtime_ns == stamp

    (second / "paged_decode.cpp").write_text((second / "paged_decode.cpp").read_text() + "// changed\n")
    assert kernels.build_name("fast") != name  # other sources: another build, never a stale one


def test_two_environments_sharing_the_cache_never_rebuild_each_others_build(fresh_cache, monkeypatch) -> None:
    """Two virtual environments on one machine, started in turn: each builds once (minutes), then
    every start finds its own build (under a second). A start is counted as a build or not, never timed.

    torch's load stands in for ninja as far as rebuilding goes: it compiles when the library is
    missing or its command line (the environment's paths and the flags) differs from the last build's.
    """
    environments = {
        venv: ("c++", f"/venvs/{venv}/lib/python3.11/site-packages/torch/include",
               f"/venvs/{venv}/lib/python3.11/site-packages/torch/include/torch/csrc/api/include",
               "/usr/include/python3.11", f"/venvs/{venv}/lib/python3.11/site-packages/torch/lib")
        for venv in ("a", "b")
    }
    builds: list[str] = []

    def load(name: str, sources: list[str], *, extra_cflags: list[str], extra_ldflags: list[str],
             build_directory: str, **kwargs: Any) -> object:
        command = "\n".join((*kernels.toolchain(), *extra_cflags, *extra_ldflags))
        library, last = Path(build_directory) / f"{name}.so", Path(build_directory) / ".ninja_log"
        if not library.exists() or last.read_text() != command:
            builds.append(name)
            library.write_text("")
            last.write_text(command)
        return object()

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)

    def start(venv: str) -> str:
        monkeypatch.setattr(kernels, "toolchain", lambda: environments[venv])
        kernels._build("fast")
        return kernels.build_name("fast")

    a, b = start("a"), start("b")
    assert a != b and builds == [a, b]
    for _ in range(3):
        assert (start("a"), start("b")) == (a, b)
    assert builds == [a, b]  # each environment's second and later starts built nothing


def test_a_process_waiting_for_another_build_says_whose_and_why(fresh_cache, caplog) -> None:
    folder = kernels.build_root() / "kev_fast_test"
    folder.mkdir(parents=True)
    fork = multiprocessing.get_context("fork")  # another process, without importing torch again
    holding, done = fork.Event(), fork.Event()

    def build_elsewhere() -> None:
        with build_lock.hold(folder, "kev_fast_test", 2.0) as note:
            note("building it")
            holding.set()
            done.wait(60)

    other = fork.Process(target=build_elsewhere)
    other.start()
    assert holding.wait(60)
    entered = threading.Event()

    def wait() -> None:
        with build_lock.hold(folder, "kev_fast_test", 2.0):
            entered.set()

    with caplog.at_level(logging.WARNING, logger="kev"):
        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_for(lambda: "waiting for another process" in caplog.text, 30, "the waiter to say it waits")
        assert not entered.is_set()  # blocked while the other process holds the folder
        done.set()
        waiter.join(30)
        other.join(30)
    assert entered.is_set()
    said = caplog.records[0].getMessage()
    assert said.startswith(f"waiting for another process's build of Kev's CPU kernels (kev_fast_test) in {folder}: "
                           f"pid {other.pid} of the Python environment {sys.prefix}, building it since ")
    assert "Why: a folder is built by one process at a time" in said
