"""The layout's contracts: integrations use the engine's public surface only, only `platforms/`
knows which device or kernel runs, and imports go one way, from the flow's later stages to its
earlier ones. Each check has a control showing it can fail."""

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
# the engine's stages in import order: each may import those before it, never one after it. A request's
# types come first (adapters and inputs, then core's requests and plans), the model's pass data before
# the families that compute it and the platforms that run them, then sampling and the outputs
STAGES = ("adapters", "inputs", "core", "model", "models", "platforms", "sample", "outputs", "tools")
ENGINE_LEVELS = {
    "errors": 0, "results": 0,  # plain types every stage may import
    **{stage: i + 1 for i, stage in enumerate(STAGES[:-1])},
    # the top modules that compose the stages, then the command over them, then the package's surface
    "engine": 9, "engine_like": 9, "stepper": 9, "runner": 9, "loader": 9, "draft_model": 9,
    "tools": 10, "__init__": 11, "__main__": 11,
}
# kev_integrations: its top modules are shared helpers, the front ends over them, Ray over the server, the command
INTEGRATION_LEVELS = {"langchain": 1, "llamaindex": 1, "server": 1, "ray": 2, "cli": 3, "__main__": 4, "__init__": 4}


def imported_modules(source: str, package: list[str]) -> list[str]:
    """Every module a file in `package` (its dotted parts) imports, relative imports resolved;
    function-local and TYPE_CHECKING imports count too (a cycle hidden in a function is one)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            found += [f"{module}.{a.name}" for a in node.names] if node.module is None or module in (
                "kev_engine", "kev_integrations") else [module]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def engine_imports(source: str) -> list[str]:
    """Every `kev_engine...` module an integration file imports, with the names it takes from
    `kev_engine` that are not its public surface (`__all__`)."""
    return [module for module in imported_modules(source, ["kev_integrations"])
            if module == "kev_engine" or (module.startswith("kev_engine.")
                                          and module.removeprefix("kev_engine.") not in kev_engine.__all__)]


def wrong_way(root: Path, levels: dict[str, int], source: str, path: Path) -> list[str]:
    """The imports of `path` (under `root`) against `levels`: a part (a top folder, or a top module by
    its name; one not named is level 0) imports only parts of a lower level, or top modules of its own
    level where it is one (a folder's imports of its own files are its own)."""
    rel = path.relative_to(root).parts
    part = rel[0].removesuffix(".py")
    wrong = []
    for module in imported_modules(source, [root.name, *rel[:-1]]):
        names = module.split(".")
        if names[0] != root.name or len(names) < 2 or names[1] == part:
            continue
        mine, theirs = levels.get(part, 0), levels.get(names[1], 0)
        if theirs > mine or (theirs == mine and ((root / part).is_dir() or (root / names[1]).is_dir())):
            wrong.append(f"{part} -> {names[1]}")
    return wrong


def device_branches(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines()
            if DEVICE_BRANCH.search(line.split("#")[0]) and not line.lstrip().startswith(('"', "'"))]


def test_the_integrations_import_only_the_engines_public_surface() -> None:
    private = {str(path.relative_to(ROOT)): found for path in INTEGRATIONS.rglob("*.py")
               if (found := engine_imports(path.read_text()))}
    assert private == {}
    # control: what the check catches
    assert engine_imports("from kev_engine.core.request import resolve_future") == ["kev_engine.core.request"]
    assert engine_imports("import kev_engine.loader") == ["kev_engine.loader"]
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
    assert loose == ["__init__.py", "__main__.py", "draft_model.py", "engine.py", "engine_like.py", "errors.py",
                     "loader.py", "results.py", "runner.py", "stepper.py"]


def test_imports_go_one_way_through_the_engines_stages() -> None:
    parts = {p.name.removesuffix(".py") for p in ENGINE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts == set(ENGINE_LEVELS) | {"tools"}
    wrong = {str(path.relative_to(ROOT)): found for path in ENGINE.rglob("*.py")
             if (found := wrong_way(ENGINE, ENGINE_LEVELS, path.read_text(), path))}
    assert wrong == {}
    assert not any("kev_integrations" in module for path in ENGINE.rglob("*.py")
                   for module in imported_modules(path.read_text(), ["kev_engine"]))
    # control: the cycles this layout removed are caught, as is a composing module imported by a stage
    sample, core, model = ENGINE / "sample" / "sample.py", ENGINE / "core" / "request.py", ENGINE / "model" / "a.py"
    assert wrong_way(ENGINE, ENGINE_LEVELS, "from ..outputs.delivery import Mailbox", core) == ["core -> outputs"]
    assert wrong_way(ENGINE, ENGINE_LEVELS, "from ..platforms.torch_ops import TorchBackend", model) == [
        "model -> platforms"]
    assert wrong_way(ENGINE, ENGINE_LEVELS, "def f():\n    from ..runner import ModelRunner", sample) == [
        "sample -> runner"]
    assert wrong_way(ENGINE, ENGINE_LEVELS, "from . import penalties", sample) == []
    assert wrong_way(ENGINE, ENGINE_LEVELS, "from ..core.request import Request", sample) == []
    assert wrong_way(ENGINE, ENGINE_LEVELS, "from .. import errors\nfrom ..results import Completion", sample) == []


def test_imports_go_one_way_through_the_integrations() -> None:
    wrong = {str(path.relative_to(ROOT)): found for path in INTEGRATIONS.rglob("*.py")
             if (found := wrong_way(INTEGRATIONS, INTEGRATION_LEVELS, path.read_text(), path))}
    assert wrong == {}
    # control: a front end importing another, the server importing Ray, a shared helper importing a front end
    server, shared = INTEGRATIONS / "server" / "run.py", INTEGRATIONS / "shared.py"
    levels = INTEGRATION_LEVELS
    assert wrong_way(INTEGRATIONS, levels, "from kev_integrations.ray.run import serve_on_ray", server) == [
        "server -> ray"]
    assert wrong_way(INTEGRATIONS, levels, "from ..langchain import ChatKev", server) == ["server -> langchain"]
    assert wrong_way(INTEGRATIONS, levels, "from .server.app import build_app", shared) == ["shared -> server"]
    assert wrong_way(INTEGRATIONS, levels, "from .remote import RemoteEngine", shared) == []


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
