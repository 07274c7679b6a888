"""`make gpu-wheels`' choice of wheels, without a network: requirements followed through each wheel's
metadata, markers read for the GPU machine (CPython 3.12, Linux x86-64, no extras), stopping at
what the machine has, and two askers of one package reconciled or refused by name.

`download` is replaced by a small index of fake wheels (a METADATA file in a zip, as pip writes
them); everything else is the script's own code. The real run, sized against the carry limit, is
in docs/benchmarks.md.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_wheels  # noqa: E402

INDEX = {  # name: {version: Requires-Dist lines}
    "xgrammar": {"0.2.9": ["pydantic", "torch>=1.10", "numpy", "pytest; extra == 'test'",
                           "mlx-lm; platform_system == 'Darwin'"]},
    "pydantic": {"2.1": ["pydantic-core==2.5", "annotated-types>=0.6", "typing-extensions"]},
    "pydantic-core": {"2.5": [], "2.6": []},
    "annotated-types": {"0.8": []},
    "gguf": {"0.19": ["numpy", "requests", "tomli; python_version < '3.11'"]},
    "requests": {"2.34": ["urllib3<3,>=1.21"]},
    "urllib3": {"2.8": [], "1.26": []},
    "tomli": {"2.0": []},
    "pytest": {"9.2": ["pluggy<2,>=1.6", "colorama; sys_platform == 'win32'"]},
    "pluggy": {"1.7": []},
    "middle": {"1.0": ["old-client"]},
    "old-client": {"1.0": ["urllib3<2"]},
}


def fake_wheel(folder: Path, name: str, version: str) -> Path:
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in INDEX[name][version])]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


@pytest.fixture
def index(monkeypatch) -> list[str]:
    """Each download asked for, answered with the newest fake version its specifier allows."""
    asked: list[str] = []

    def download(requirement: str, into: Path) -> Path:
        asked.append(requirement)
        parsed = Requirement(requirement)
        versions = [v for v in INDEX[parsed.name] if parsed.specifier.contains(v)]
        assert versions, f"nothing in the fake index satisfies {requirement}"
        return fake_wheel(into, parsed.name, max(versions, key=lambda v: tuple(map(int, v.split(".")))))

    monkeypatch.setattr(gpu_wheels, "download", download)
    return asked


def names(wheels: list[Path]) -> list[str]:
    return sorted(w.name.split("-")[0] for w in wheels)


def test_follows_requirements_to_what_the_machine_has(tmp_path, index) -> None:
    roots = [Requirement("xgrammar>=0.2.8,<0.3"), Requirement("gguf>=0.10"), Requirement("pytest>=8")]
    present = {"torch", "numpy", "typing-extensions"}
    wheels = gpu_wheels.missing_wheels(roots, present, tmp_path)
    assert names(wheels) == ["annotated_types", "gguf", "pluggy", "pydantic", "pydantic_core", "pytest",
                             "requests", "urllib3", "xgrammar"]
    # markers for CPython 3.12 on Linux: no test extra, no macOS, no Windows, no Python < 3.11
    assert not {"mlx-lm", "colorama", "tomli"} & {Requirement(r).name for r in index}
    assert "pydantic-core==2.5" in index and "xgrammar<0.3,>=0.2.8" in index  # the asker's pins travel


def test_two_askers_of_one_package_are_reconciled_or_refused(tmp_path, index) -> None:
    wheels = gpu_wheels.missing_wheels([Requirement("urllib3<2"), Requirement("requests")], set(), tmp_path)
    assert [w.name for w in wheels if w.name.startswith("urllib3")] == ["urllib3-1.26-py3-none-any.whl"]
    # requests takes urllib3 2.8 before a deeper package asks for < 2: refused by name, not installed broken
    with pytest.raises(RuntimeError, match=r"urllib3-2.8-py3-none-any.whl does not satisfy urllib3.*<2.*asked by two"):
        gpu_wheels.missing_wheels([Requirement("requests"), Requirement("middle")], set(), tmp_path / "again")


def test_the_machine_has_its_packages_and_what_they_require_directly() -> None:
    have = gpu_wheels.machine_has(("torch", "transformers"))
    assert {"torch", "transformers", "typing-extensions", "huggingface-hub", "tokenizers"} <= have
    assert "pytest" not in have and "xgrammar" not in have
    assert gpu_wheels.applies(Requirement("tomli; python_version < '3.11'")) is False
    assert gpu_wheels.applies(Requirement("triton; platform_system == 'Linux' and platform_machine == 'x86_64'"))
    assert SpecifierSet(">=0.2.8,<0.3").contains(gpu_wheels.wheel_version(Path("xgrammar-0.2.9-cp312-x.whl")))
