"""The layout's contracts: integrations use the engine's public surface only, and only `platforms/`
knows which device or kernel runs. Each check has a control showing it can fail."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kev_engine

ROOT = Path(__file__).resolve().parent.parent
ENGINE, INTEGRATIONS = ROOT / "kev_engine", ROOT / "kev_integrations"
# a branch on the device or on which backend/kernel runs: the platform's question, asked nowhere else
DEVICE_BRANCH = re.compile(
    r"device\.type|\.is_cuda\b|torch\.cuda\.|device_type|isinstance\([^)]*(Backend|Platform)\b"
    r"|[=!]= *['\"](cuda|cpu|mps|xpu)['\"]|['\"](cuda|cpu|mps|xpu)['\"] *[=!]="
    r"|(backend|attention|platform)\.name *[=!]="
)
STAGES = ("inputs", "core", "model", "models", "adapters", "sample", "outputs", "platforms", "tools")


def engine_imports(source: str) -> list[str]:
    """Every `kev_engine...` module an integration file imports, with the names it takes from `kev_engine`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kev_engine"):
            if node.module != "kev_engine":
                found.append(node.module)
            else:
                found += [f"kev_engine.{a.name}" for a in node.names if a.name not in kev_engine.__all__]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("kev_engine")]
    return found


def device_branches(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines()
            if DEVICE_BRANCH.search(line.split("#")[0]) and not line.lstrip().startswith(('"', "'"))]


def test_the_integrations_import_only_the_engines_public_surface() -> None:
    private = {str(path.relative_to(ROOT)): found for path in INTEGRATIONS.rglob("*.py")
               if (found := engine_imports(path.read_text()))}
    assert private == {}
    # control: what the check catches
    assert engine_imports("from kev_engine.core.request import resolve_future") == ["kev_engine.core.request"]
    assert engine_imports("import kev_engine.model.loader") == ["kev_engine.model.loader"]
    assert engine_imports("from kev_engine import Engine, _private") == ["kev_engine._private"]
    assert engine_imports("from kev_engine import Engine, cli") == []


def test_every_public_name_is_there() -> None:
    missing = [name for name in kev_engine.__all__ if getattr(kev_engine, name, None) is None]
    assert missing == []


def test_only_the_platforms_branch_on_the_device_or_the_backend() -> None:
    outside = {str(path.relative_to(ROOT)): found for path in ENGINE.rglob("*.py")
               if "platforms" not in path.relative_to(ENGINE).parts and (found := device_branches(path.read_text()))}
    outside |= {str(path.relative_to(ROOT)): found for path in INTEGRATIONS.rglob("*.py")
                if (found := device_branches(path.read_text()))}
    assert outside == {}
    # control: the branches this layout moved into platforms/ are caught
    for branch in ('if device.type == "cuda":', "if cuda_graphs and isinstance(backend, CudaBackend):",
                   'if getattr(kernels, "device_type", None) == "cuda":', "torch.cuda.set_device(device)",
                   'if self._backend.name == "exact":', 'if resolved.type == "cuda" and resolved.index is None:'):
        assert device_branches(branch), branch
    assert device_branches((ENGINE / "platforms" / "cuda" / "platform.py").read_text())  # where they live now


def test_the_folders_are_the_stages_and_each_says_which() -> None:
    packages = sorted(p.parent.name for p in ENGINE.glob("*/__init__.py"))
    assert packages == sorted(STAGES)
    for stage in STAGES:
        doc = ast.get_docstring(ast.parse((ENGINE / stage / "__init__.py").read_text()))
        assert doc and len(doc) > 80, stage
    loose = sorted(p.name for p in ENGINE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "engine.py", "engine_like.py", "errors.py", "stepper.py"]


def test_the_former_names_are_gone(tokenizer) -> None:
    """`decode_kernel=`, `Engine.decode_attention` and `kev verify --exact` were renamed before any
    release (`cpu_kernels=`, `Engine.attention`, `--bitwise`): the old names are errors, not aliases."""
    from conftest import tiny_model

    from kev_engine import Engine
    from kev_engine.tools.cli import build_parser

    with pytest.raises(TypeError, match="decode_kernel"):
        Engine(tiny_model("llama", tokenizer), tokenizer, decode_kernel="torch")
    assert not hasattr(Engine, "decode_attention")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["verify", "--exact"])
    assert build_parser().parse_args(["verify", "--file", "x.jsonl", "--no-bitwise"]).bitwise is False
