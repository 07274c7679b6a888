"""The README's Python examples run as written.

The convention (stated at the top of README.md too): every ```python block runs, top to bottom,
in ONE namespace, like a notebook, from the repository root (the examples name
`examples/adapters/...`). A block may use what an earlier block defined. A block right after an
HTML comment `<!-- not run: REASON -->` is skipped; that is for what CI cannot have (a running
server, a GPU, a hub download), and the reason must be given. Shell blocks are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*\Z", re.S)
MAX_SKIPPED = 3  # the exceptions stay few


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    code: str
    skip_reason: str | None


def python_blocks(text: str) -> list[Block]:
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        skip = NOT_RUN.search(before)
        blocks.append(Block(before.count("\n") + 1, match.group(1), skip.group(1) if skip else None))
    return blocks


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
