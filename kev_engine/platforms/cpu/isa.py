"""Which x86 instruction sets Kev uses on this CPU, and how to run as a smaller CPU would.

Kev's CPU kernels are compiled with `-march=native`, and `dtype="auto"` reads the CPU's flags,
so the same checkout takes another path on an AMX Xeon, an AVX-512 EPYC without AMX and a CPU
without AVX-512. To test the other paths on one machine, `KEV_CPU_ISA` turns instruction sets
off (never on: a CPU cannot run what it lacks):

  native     everything this CPU has (default)
  no-amx     AMX off: bfloat16 products by AVX512-BF16 where the CPU has it (AMD Zen 4/5)
  no-avx512  AVX-512 off (AMX and AVX512-BF16 with it): AVX2 and FMA, fp32 by default

It reaches Kev's kernel build (extra `-mno-*` flags, a build of their own) and whether
`dtype="auto"` may pick bfloat16 (`dtype_choice`: only with native bf16, and only where measured
faster). torch's own kernels choose their instructions when torch loads, from
`ATEN_CPU_CAPABILITY` and `ONEDNN_MAX_CPU_ISA`; `python -m kev_engine.platforms.cpu.isa ISA -- COMMAND`
runs COMMAND with all three set (`make test-isa ISA=...`).
"""

from __future__ import annotations

import os
import sys

ENV_VAR = "KEV_CPU_ISA"
ISAS = ("native", "no-amx", "no-avx512")
_AMX = ("amx_tile", "amx_bf16", "amx_int8")
# what each level removes: from the compiler (-mno-avx512f takes every AVX-512 extension with it)
# and from the CPU's flags as Kev reads them
COMPILER_FLAGS = {
    "native": (),
    "no-amx": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
    "no-avx512": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512f"),
}
# torch's own dispatch (read once when torch loads: set before starting Python)
TORCH_ENV = {
    "native": {},
    "no-amx": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "no-avx512": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def resolve(value: str | None = None) -> str:
    """The level asked for (argument, else `KEV_CPU_ISA`, else "native"), checked."""
    isa = value if value is not None else (os.environ.get(ENV_VAR) or "native")
    if isa not in ISAS:
        raise ValueError(f"{ENV_VAR}={isa!r} is not allowed; use one of {', '.join(ISAS)}")
    return isa


def flags_line() -> str:
    """/proc/cpuinfo's line of CPU flags ("flags" on x86, "Features" on Arm) as it is, or ""."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _proc_flags() -> list[str]:
    return flags_line().split()


def cpu_flags(isa: str | None = None) -> frozenset[str]:
    """This CPU's flags less what `isa` turns off."""
    isa = resolve(isa)
    flags = set(_proc_flags())
    if isa in ("no-amx", "no-avx512"):
        flags -= set(_AMX)
    if isa == "no-avx512":
        flags = {f for f in flags if not f.startswith("avx512")}
    return frozenset(flags)


def compiler_flags(isa: str | None = None) -> tuple[str, ...]:
    return COMPILER_FLAGS[resolve(isa)]


def native_bf16(isa: str | None = None) -> bool:
    """Whether this CPU (as `isa` leaves it) multiplies bfloat16 natively: AMX-BF16 or AVX512-BF16."""
    flags = cpu_flags(isa)
    return "amx_bf16" in flags or "avx512_bf16" in flags


def environment(isa: str) -> dict[str, str]:
    """What a process needs in its environment to run as `isa`: Kev's level and torch's."""
    return {ENV_VAR: resolve(isa), **TORCH_ENV[isa]}


def main(argv: list[str]) -> int:
    """`python -m kev_engine.platforms.cpu.isa ISA -- COMMAND ...`: COMMAND as a CPU at that level runs it."""
    if len(argv) < 3 or argv[1] != "--":
        isas = ",".join(ISAS)
        print(f"usage: python -m kev_engine.platforms.cpu.isa {{{isas}}} -- COMMAND [ARGS ...]", file=sys.stderr)
        return 2
    try:
        env = environment(argv[0])
    except ValueError as exc:
        print(f"kev_engine.platforms.cpu.isa: {exc}", file=sys.stderr)
        return 2
    print("kev_engine.platforms.cpu.isa: " + " ".join(f"{k}={v}" for k, v in env.items()), file=sys.stderr, flush=True)
    os.execvpe(argv[2], argv[2:], {**os.environ, **env})
    return 127  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
