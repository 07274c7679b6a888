"""`Engine.from_pretrained`'s arguments: the model is `model=`, as in `ChatKev`, LlamaIndex's `Kev`,
`kev --model` and vLLM's `LLM(model=...)` (issue 57), and Engine's settings are checked before
the slow load."""

from __future__ import annotations

import re
from typing import Any

import pytest
from conftest import save_tiny_model

from kev_engine import Engine, SamplingParams, loader


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer))


@pytest.mark.parametrize("by", ["keyword", "position"])
def test_the_model_is_given_by_keyword_or_position(model_dir: str, by: str) -> None:
    args, kwargs = ((), {"model": model_dir}) if by == "keyword" else ((model_dir,), {})
    with Engine.from_pretrained(*args, dtype="float32", max_num_seqs=4, **kwargs) as engine:
        assert engine.name == "model"  # the folder's name: that folder was loaded
        [answer] = engine.generate(["Hello"], SamplingParams(max_tokens=2))
        assert answer.completion_tokens >= 1


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"tokenizer": object()}, "sets tokenizer= itself"),
    ({"name": "mine"}, "sets name= itself"),
    ({"source": "x"}, "['source']"),
    ({"max_num_seq": 4}, "['max_num_seq']"),
])
def test_a_keyword_engine_would_refuse_is_named_before_the_load(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], named: str
) -> None:
    loads: list[Any] = []
    monkeypatch.setattr(loader, "load", lambda *args: loads.append(args))
    with pytest.raises(TypeError, match=re.escape(named)):
        Engine.from_pretrained(**kwargs)
    assert loads == []
