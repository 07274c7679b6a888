"""`make gpu-wheels`: what the GPU machine lacks for `make gpu-check`, in one folder it can carry.

The GPU machine has Python 3.12 and its own CUDA torch, Triton, transformers, peft, accelerate,
safetensors, ninja, pillow and numpy (`IMAGE`), reaches no network, and takes at most 64 MiB with
the working tree. Run this where there is a network; it writes `--out` (default gpu-carry/):
  wheels/       exactly the wheels missing there, for CPython 3.12 on manylinux x86-64: Kev's own
                requirements (as installed here by `make setup`) and pytest, with their requirements followed
                through each wheel's metadata — stopping at what the machine has (`IMAGE` and
                what those require directly, read from this environment's installed metadata);
  model-files/  the embedded model's config and tokenizer files, no weights (`random_models`
                builds models from them on the GPU);
  MANIFEST.json every file with its size, and the total with the tracked tree.
It prints the same list and fails when the total passes the limit. `make gpu-check` installs the
wheels with `--no-index --no-deps` into a venv over the machine's own packages.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_models import copy_model_files  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 64 * 2**20  # what one device call carries: the working tree and these files together
IMAGE = ("torch", "triton", "transformers", "peft", "accelerate", "safetensors", "ninja", "pillow", "numpy")
EXTRA_ROOTS = ("pytest>=8",)  # the check runs the CUDA tests
TARGET = {  # the GPU machine, for markers and for pip's choice of wheels
    "python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "extra": "",
}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64")


def requirements_of_kev() -> list[Requirement]:
    """Kev's runtime requirements (no extras), from its installed metadata (`make setup`)."""
    return [r for r in map(Requirement, metadata.requires("kev-llm") or []) if applies(r)]


def machine_has(names: tuple[str, ...]) -> set[str]:
    """`names` and what they require directly, from this environment's installed metadata: the GPU
    machine imports them, so it has those too. Deeper requirements change with versions (this
    environment's transformers need not be the machine's), so whatever else a carried wheel needs
    is carried as well."""
    have = {canonicalize_name(n) for n in names}
    for name in names:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        have |= {canonicalize_name(r.name) for r in map(Requirement, requires) if applies(r)}
    return have


def applies(requirement: Requirement) -> bool:
    """Whether a requirement holds on the GPU machine (no extras asked for)."""
    return requirement.marker is None or Marker(str(requirement.marker)).evaluate(dict(TARGET))


def download(requirement: str, into: Path) -> Path:
    """One wheel for the GPU machine, no dependencies; the path of the file pip wrote."""
    before = set(into.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--implementation", "cp", "--python-version", TARGET["python_version"],
               "--abi", "cp312", "--abi", "abi3", "--abi", "none", *[f"--platform={p}" for p in PLATFORMS],
               "--platform=any", "-d", str(into), requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download {requirement!r} failed: {done.stderr.strip()[-1500:]}")
    new = set(into.glob("*.whl")) - before
    name = canonicalize_name(Requirement(requirement).name)
    found = new or {p for p in into.glob("*.whl") if canonicalize_name(p.name.split("-")[0]) == name}
    if len(found) != 1:
        raise RuntimeError(f"pip download {requirement!r} left {sorted(p.name for p in found)} in {into}")
    return found.pop()


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        message = Parser().parsestr(archive.read(name).decode())
    return [Requirement(text) for text in message.get_all("Requires-Dist") or []]


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def missing_wheels(roots: list[Requirement], present: set[str], into: Path) -> list[Path]:
    """Every wheel `roots` need that is not `present`, followed through their metadata."""
    into.mkdir(parents=True, exist_ok=True)
    specifiers: dict[str, SpecifierSet] = {}
    wheels: dict[str, Path] = {}
    queue = [r for r in roots if applies(r)]
    while queue:
        requirement = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name in present:
            continue
        specifiers[name] = specifiers.get(name, SpecifierSet()) & requirement.specifier
        if name in wheels:
            if not specifiers[name].contains(wheel_version(wheels[name]), prereleases=True):
                raise RuntimeError(f"{wheels[name].name} does not satisfy {name}{specifiers[name]} "
                                   "(asked by two packages differently); pin it in EXTRA_ROOTS")
            continue
        wheels[name] = download(f"{name}{specifiers[name]}", into)
        queue.extend(r for r in wheel_requirements(wheels[name]) if applies(r))
    return sorted(wheels.values())


def tracked_bytes() -> int:
    """The working tree's tracked files, as the device call carries them."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    return sum((ROOT / n).stat().st_size for n in names.stdout.split("\0") if n and (ROOT / n).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-carry")
    parser.add_argument("--model-files", type=Path, default=None,
                        help="a model folder to take config and tokenizer files from (default: the embedded model)")
    args = parser.parse_args(argv)
    wheels_dir = args.out / "wheels"
    for stale in wheels_dir.glob("*.whl"):
        stale.unlink()
    present = machine_has(IMAGE)
    wheels = missing_wheels(requirements_of_kev() + [Requirement(r) for r in EXTRA_ROOTS], present, wheels_dir)
    source = args.model_files
    if source is None:
        from kev_engine import loader

        source = loader.converted_gguf_dir(loader.embedded_gguf())
    files = copy_model_files(Path(source), args.out / "model-files")
    entries = [{"path": str(p.relative_to(args.out)), "bytes": p.stat().st_size} for p in [*wheels, *files]]
    carried = sum(e["bytes"] for e in entries)
    tree = tracked_bytes()
    manifest = {"for": "CPython 3.12, manylinux x86-64", "machine_has": list(IMAGE), "files": entries,
                "carried_bytes": carried, "tree_bytes": tree, "total_bytes": carried + tree,
                "limit_bytes": LIMIT_BYTES}
    (args.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for entry in entries:
        print(f"{entry['bytes'] / 2**20:8.2f} MiB  {entry['path']}")
    print(f"{carried / 2**20:8.2f} MiB  carried ({len(wheels)} wheels, {len(files)} model files)")
    print(f"{tree / 2**20:8.2f} MiB  tracked tree")
    print(f"{(carried + tree) / 2**20:8.2f} MiB  together, of {LIMIT_BYTES / 2**20:.0f} MiB")
    if carried + tree > LIMIT_BYTES:
        print(f"gpu-wheels: {carried + tree} bytes is over the {LIMIT_BYTES}-byte carry limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
