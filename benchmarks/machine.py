"""The machine a benchmark ran on, as its report's header names it."""

from __future__ import annotations

import os
import platform


def cpu_line() -> str:
    """The CPU's model name and the cores this process may use: "<model name>, N cores"."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            name = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {len(os.sched_getaffinity(0))} cores"
