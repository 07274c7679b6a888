"""The README's examples: the Python ones run as written, and what is not run is held against the code.

The convention (stated at the top of README.md too): every ```python block runs, top to bottom,
in ONE namespace, like a notebook, from the repository root (the examples name
`examples/adapters/...`). A block may use what an earlier block defined. A block right after an
HTML comment `<!-- not run: REASON -->` is skipped; that is for what CI cannot have (a running
server, a GPU, a hub download), and the reason must be given. Shell blocks are not run.

What is not run is still held against the code (issue 57: a server snippet loaded an adapter
"json" and then asked for model "sql"): every python block parses; every `kev ...` line of a
shell block parses with the `kev` command's own argparse parser; every `KEV_*` name in the file
is a string constant of the packages; the keyword arguments of `Engine(...)`,
`Engine.from_pretrained(...)`, `SamplingParams(...)`, `ChatKev(...)`, `KevLLM(...)` and `Kev(...)`
in python blocks are in their signatures; and within one section (a `#` heading and what follows
it up to the next), once a block has loaded adapters (`--adapter NAME=PATH`, `adapters={NAME: ...}`,
`load_adapter("NAME", ...)`), a string `model=`, `adapter=` or `adapters=[...]` in that block or a
later one of the section must name one of them.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kev_engine import Engine, SamplingParams
from kev_engine.tools.cli import build_parser
from kev_integrations.cli import SERVE
from kev_integrations.langchain import ChatKev, KevLLM
from kev_integrations.llamaindex import Kev

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*\Z", re.S)
HEADING = re.compile(r"^#+ .*$", re.M)
MAX_SKIPPED = 3  # the exceptions stay few


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    code: str
    skip_reason: str | None
    lang: str = "python"
    section: str = ""  # the last heading above it


def fenced_blocks(text: str) -> list[Block]:
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        skip = NOT_RUN.search(before)
        headings = HEADING.findall(FENCE.sub("", before))  # a shell block's `# comment` is no heading
        blocks.append(Block(before.count("\n") + 1, match.group(2), skip.group(1) if skip else None,
                            match.group(1), headings[-1] if headings else ""))
    return blocks


def python_blocks(text: str) -> list[Block]:
    return [block for block in fenced_blocks(text) if block.lang == "python"]


def test_the_convention_is_read_as_written() -> None:
    text = "a\n<!-- not run: needs a server -->\n```python\nx = 1\n```\n\n```python\ny = x\n```\n"
    blocks = python_blocks(text)
    assert [(b.line, b.code, b.skip_reason) for b in blocks] == [
        (3, "x = 1\n", "needs a server"),
        (7, "y = x\n", None),
    ]


def test_readme_skips_few_blocks_each_with_a_reason() -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    skipped = [b for b in blocks if b.skip_reason is not None]
    assert len(blocks) - len(skipped) >= 5, "the README's examples were not found"
    assert len(skipped) <= MAX_SKIPPED, [b.line for b in skipped]
    assert all(b.skip_reason for b in skipped)


def run_blocks(text: str, namespace: dict[str, Any]) -> int:
    """Run `text`'s python blocks in order in `namespace`; how many ran. A raising block fails
    with an AssertionError naming its line."""
    ran = 0
    for block in python_blocks(text):
        if block.skip_reason is not None:
            continue
        try:
            exec(compile(block.code, f"README.md:{block.line}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"the README's python block at line {block.line} raised {exc!r}") from exc
        ran += 1
    return ran


def test_a_raising_block_fails_naming_its_line() -> None:
    text = "```python\nx = 1\n```\n<!-- not run: skipped -->\n```python\nraise OSError\n```\n```python\nx / 0\n```\n"
    with pytest.raises(AssertionError, match="line 8 raised ZeroDivisionError"):
        run_blocks(text, {})


def test_readme_examples_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block that is not marked runs without raising, from the repository root."""
    monkeypatch.chdir(README.parent)
    namespace: dict[str, Any] = {"__name__": "readme"}
    try:
        assert run_blocks(README.read_text(encoding="utf-8"), namespace) >= 5
    finally:
        if "engine" in namespace:  # the README's own Engine; the integrations' shared one stays
            namespace["engine"].close()


# ---- what is not run, held against the code ------------------------------------------------------

# the callables whose keywords python blocks are checked against; from_pretrained passes its
# **engine_kwargs on to Engine's settings, so it takes its own keywords and Engine's keyword-only
# ones (a callable whose own **kwargs go nowhere known is left unchecked)
SIGNATURES: dict[str, tuple[Any, ...]] = {
    "Engine": (Engine,), "Engine.from_pretrained": (Engine.from_pretrained, Engine),
    "SamplingParams": (SamplingParams,), "ChatKev": (ChatKev,), "KevLLM": (KevLLM,), "Kev": (Kev,),
}


def keywords(functions: tuple[Any, ...]) -> set[str] | None:
    first, *then = [list(inspect.signature(function).parameters.values()) for function in functions]
    if any(p.kind is p.VAR_KEYWORD for p in (then or [first])[-1]):
        return None
    return ({p.name for p in first if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            | {p.name for parameters in then for p in parameters if p.kind is p.KEYWORD_ONLY})


def package_strings() -> set[str]:
    """Every string constant of kev_engine's and kev_integrations' sources (docstrings only contain names)."""
    paths = [*ROOT.glob("kev_engine/**/*.py"), *ROOT.glob("kev_integrations/**/*.py")]
    return {node.value for path in paths for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def parsed(block: Block) -> ast.Module | SyntaxError | None:
    """A python block's tree, or why it does not parse; None for other blocks."""
    try:
        return ast.parse(block.code) if block.lang == "python" else None
    except SyntaxError as exc:
        return exc


def calls(block: Block) -> Iterator[tuple[str, ast.Call]]:
    """(the called name as written, the call) for every call of a python block that parses."""
    tree = parsed(block)
    for node in ast.walk(tree) if isinstance(tree, ast.Module) else ():
        if isinstance(node, ast.Call):
            yield ast.unparse(node.func), node


def strings(node: ast.expr) -> list[str]:
    """A string literal, or the string literals of a list or tuple literal."""
    items = node.elts if isinstance(node, ast.List | ast.Tuple) else [node]
    return [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]


def kev_commands(block: Block) -> Iterator[list[str]]:
    """The arguments of every `kev ...` line of a shell block."""
    for line in block.code.splitlines() if block.lang == "bash" else ():
        if line.startswith("kev "):
            yield shlex.split(line, comments=True)[1:]


def syntax_errors(blocks: list[Block]) -> Iterator[str]:
    for block in blocks:
        if isinstance(error := parsed(block), SyntaxError):
            yield f"block at line {block.line}: python does not parse ({error.msg}, its line {error.lineno})"


def bad_kev_commands(blocks: list[Block]) -> Iterator[str]:
    parser = build_parser(extra=(SERVE,))  # the installed `kev`'s parser, `kev serve` included
    for block in blocks:
        for argv in kev_commands(block):
            said = io.StringIO()
            try:
                with contextlib.redirect_stderr(said):
                    parser.parse_args(argv)
            except SystemExit:
                error = said.getvalue().strip().splitlines()[-1]
                yield f"block at line {block.line}: `kev {shlex.join(argv)}`: {error}"


def unknown_keywords(blocks: list[Block]) -> Iterator[str]:
    for block in blocks:
        for name, call in calls(block):
            accepted = keywords(SIGNATURES[name]) if name in SIGNATURES else None
            for keyword in call.keywords:
                if accepted is not None and keyword.arg is not None and keyword.arg not in accepted:
                    yield f"block at line {block.line}: {name}() takes no keyword {keyword.arg!r}"


def unloaded_adapters(blocks: list[Block]) -> Iterator[str]:
    """Within a section, once adapters are loaded, a string `model=`/`adapter=`/`adapters=[...]` must name one."""
    section, loaded = None, set[str]()
    for block in blocks:
        if block.section != section:
            section, loaded = block.section, set()
        loaded |= set(re.findall(r"--adapter[= ]([\w.-]+)=", block.code)) if block.lang == "bash" else set()
        picked = []
        for name, call in calls(block):
            if name.endswith("load_adapter") and call.args:
                loaded |= set(strings(call.args[0]))
            for keyword in call.keywords:
                if keyword.arg == "adapters" and isinstance(keyword.value, ast.Dict):
                    loaded |= {key for node in keyword.value.keys if node is not None for key in strings(node)}
                elif keyword.arg in ("model", "adapter", "adapters"):
                    picked += strings(keyword.value)
        for name in picked:
            if loaded and name not in loaded:
                yield f"block at line {block.line}: {name!r} is not an adapter loaded in {section!r}: {sorted(loaded)}"


def unknown_env_vars(text: str) -> Iterator[str]:
    known = package_strings()
    for match in re.finditer(r"\bKEV_[A-Z0-9_]+", text):
        if match.group() not in known:
            yield f"line {text.count(chr(10), 0, match.start()) + 1}: {match.group()} is read nowhere in the packages"


def mismatches(text: str) -> list[str]:
    blocks = fenced_blocks(text)
    return [*syntax_errors(blocks), *bad_kev_commands(blocks), *unknown_keywords(blocks), *unloaded_adapters(blocks),
            *unknown_env_vars(text)]


BAD = """# Kev

## Server

```bash
kev serve --adapter json=examples/adapters/json --api-key "$KEY"
# kev: ready
kev serve --adaptr x=y
kev srve
```

```python
client.chat.completions.create(model="sql", messages=[])
```

## CLI

```python
engine = Engine.from_pretrained(source="x", max_num_seqs=4)
ChatKev(model="sql", max_new_tokens=8)
```

```python
def broken(:
```

Set KEV_NO_SUCH_SETTING=1.
"""


def test_each_mismatch_is_named_with_its_line() -> None:
    found = mismatches(BAD)
    srve = found.pop(2)  # argparse lists the commands after this
    assert srve.startswith("block at line 5: `kev srve`: kev: error: argument command: invalid choice: 'srve'")
    assert found == [
        "block at line 23: python does not parse (invalid syntax, its line 1)",
        "block at line 5: `kev serve --adaptr x=y`: kev: error: unrecognized arguments: --adaptr x=y",
        "block at line 18: Engine.from_pretrained() takes no keyword 'source'",
        "block at line 18: ChatKev() takes no keyword 'max_new_tokens'",
        "block at line 12: 'sql' is not an adapter loaded in '## Server': ['json']",  # model="sql" in CLI: none loaded
        "line 27: KEV_NO_SUCH_SETTING is read nowhere in the packages",
    ]


def test_what_the_readme_does_not_run_matches_the_code() -> None:
    text = README.read_text(encoding="utf-8")
    assert sum(1 for block in fenced_blocks(text) for _ in kev_commands(block)) >= 5, "no `kev` lines found"
    found = mismatches(text)
    assert not found, "\n".join(found)
