"""The sampling settings are declared once (`kev_engine.SETTINGS`): the declaration's bounds are the
edges `SamplingParams` checks, and LangChain's and LlamaIndex's fields are that declaration — type,
default, bounds, description. Each check has a control showing it can fail."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from kev_engine import SETTING_FIELDS, SETTINGS, InvalidRequestError, SamplingParams
from kev_integrations.langchain import ChatKev, KevLLM
from kev_integrations.llamaindex import Kev

INTEGRATIONS = Path(__file__).resolve().parent.parent / "kev_integrations"
DECLARED = {setting.name: setting for setting in SETTINGS}
LLAMAINDEX_VALUED = ("top_p", "top_k", "max_tokens")  # LlamaIndex's fields holding the engine's default
PHRASES = {"ge": "greater than or equal to", "gt": "greater than", "le": "less than or equal to"}
FAR = {int: 10**9, float: 1e300}


def step(value: float, kind: Any, direction: int) -> float:
    """The next value of `kind` past `value` in `direction` (+1 up, -1 down)."""
    return value + direction if kind is int else math.nextafter(value, direction * math.inf)


def accepted(name: str, value: Any) -> bool:
    """Whether `SamplingParams` takes `value` for `name`; a refusal must name the value."""
    companions: dict[str, Any] = {"logprobs": True} if name == "top_logprobs" else {}
    if name == "min_tokens":
        companions["max_tokens"] = max(1, value)  # min_tokens may not pass max_tokens
    try:
        SamplingParams(**{name: value}, **companions)
    except InvalidRequestError as exc:
        assert f"{name}={value!r} is not allowed" in str(exc)
        return False
    return True


def disagreements(setting: Any) -> list[str]:
    """Where `setting`'s bounds and `SamplingParams`' checks differ: a `ge`/`le` bound is taken and the
    next value past it refused, a `gt` bound refused and the next value past it taken, and a side
    with no bound takes a far value."""
    found = []
    kind = setting.annotation
    for key, bound in setting.bounds.items():
        outward = 1 if key == "le" else -1
        inside = bound if key != "gt" else step(bound, kind, 1)
        outside = step(bound, kind, outward) if key != "gt" else bound
        if not accepted(setting.name, inside):
            found.append(f"{setting.name}={inside!r} is within {key}={bound} but refused")
        if accepted(setting.name, outside):
            found.append(f"{setting.name}={outside!r} is past {key}={bound} but taken")
    if kind in FAR:
        if "le" not in setting.bounds and not accepted(setting.name, FAR[kind]):
            found.append(f"{setting.name} declares no upper bound but refuses {FAR[kind]!r}")
        if not {"ge", "gt"} & set(setting.bounds) and not accepted(setting.name, -FAR[kind]):
            found.append(f"{setting.name} declares no lower bound but refuses {-FAR[kind]!r}")
    return found


def bounds_of(info: Any) -> dict[str, Any]:
    return {key: getattr(m, key) for m in info.metadata for key in PHRASES if getattr(m, key, None) is not None}


def mismatches(model: type[BaseModel], settings: Iterable[Any], valued: Collection[str] = ()) -> list[str]:
    """How `model`'s fields differ from the declared `settings`: type, default, bounds, description.
    A setting in `valued` holds the engine's default; any other is optional, None by default."""
    found = []
    for setting in settings:
        info = model.model_fields[setting.name]
        optional = setting.name not in valued
        want = {"annotation": setting.annotation | None if optional else setting.annotation,
                "default": None if optional else setting.default,
                "bounds": setting.bounds, "description": setting.description}
        have = {"annotation": info.annotation, "default": info.default, "bounds": bounds_of(info),
                "description": info.description}
        found += [f"{setting.name}.{key}: {have[key]!r} != {want[key]!r}" for key in want if have[key] != want[key]]
    return found


def test_the_declaration_names_every_setting_once_with_the_engines_defaults() -> None:
    assert [setting.name for setting in SETTINGS] == list(SETTING_FIELDS)
    assert {name: DECLARED[name].default for name in SETTING_FIELDS} == {
        name: getattr(SamplingParams(), name) for name in SETTING_FIELDS}


@pytest.mark.parametrize("name", [s.name for s in SETTINGS if s.bounds or s.annotation in FAR])
def test_the_declared_bounds_are_the_edges_sampling_params_checks(name: str) -> None:
    assert disagreements(DECLARED[name]) == []


def test_a_bound_that_drifted_from_the_checks_is_caught() -> None:
    """The control: a moved bound, a missing one and a made-up one each disagree."""
    assert disagreements(replace(DECLARED["presence_penalty"], le=3.0)) == [
        "presence_penalty=3.0 is within le=3.0 but refused"]
    assert disagreements(replace(DECLARED["max_tokens"], ge=None)) == [
        "max_tokens declares no lower bound but refuses -1000000000"]
    assert disagreements(replace(DECLARED["top_p"], gt=None, ge=0)) == ["top_p=0 is within ge=0 but refused"]
    assert disagreements(replace(DECLARED["temperature"], le=2)) == [
        "temperature=2.0000000000000004 is past le=2 but taken"]


@pytest.mark.parametrize(("model", "skip", "valued"), [
    (ChatKev, (), ()),
    (KevLLM, (), ()),
    (Kev, ("n",), LLAMAINDEX_VALUED),  # a LlamaIndex call answers once: no n
])
def test_each_front_ends_fields_are_the_declaration(model: type[BaseModel], skip: tuple[str, ...],
                                                    valued: tuple[str, ...]) -> None:
    offered = [s for s in SETTINGS if s.name not in skip]
    assert {s.name for s in SETTINGS if s.name in model.model_fields} == {s.name for s in offered}
    assert mismatches(model, offered, valued) == []


def test_a_field_that_drifted_from_the_declaration_is_caught() -> None:
    """The control: a hand-written field with its own bound and words, as the fields were before."""

    class Drifted(BaseModel):
        presence_penalty: float | None = Field(default=None, ge=-2, le=3, description="OpenAI's penalty.")
        top_p: float = Field(default=1.0, gt=0, le=1, description=DECLARED["top_p"].description)

    assert mismatches(Drifted, [DECLARED["presence_penalty"], DECLARED["top_p"]], valued=("top_p",)) == [
        "presence_penalty.bounds: {'ge': -2, 'le': 3} != {'ge': -2.0, 'le': 2.0}",
        f"presence_penalty.description: \"OpenAI's penalty.\" != {DECLARED['presence_penalty'].description!r}",
    ]
    assert mismatches(Drifted, [DECLARED["top_p"]]) == [  # optional, as LangChain's, it would default to None
        "top_p.annotation: <class 'float'> != float | None", "top_p.default: 1.0 != None"]


@pytest.mark.parametrize("model", [ChatKev, KevLLM, Kev])
def test_a_value_past_a_bound_is_refused_at_construction_naming_it(model: type[BaseModel]) -> None:
    for setting in SETTINGS:
        if setting.name not in model.model_fields:
            continue
        for key, bound in setting.bounds.items():
            value = step(bound, setting.annotation, 1 if key == "le" else -1) if key != "gt" else bound
            with pytest.raises(ValueError) as caught:
                model(**{setting.name: value})
            assert f"{setting.name}\n  Input should be {PHRASES[key]} " in str(caught.value)
            assert f"input_value={value!r}" in str(caught.value)


def test_the_setting_keys_are_defined_once() -> None:
    """Both front ends take their setting names from `init_args.SETTING_KEYS`."""
    definition = re.compile(r"^SETTING_KEYS\b[^=\n]*=", re.MULTILINE)
    defined = sorted(str(p.relative_to(INTEGRATIONS)) for p in INTEGRATIONS.rglob("*.py")
                     if definition.search(p.read_text()))
    assert defined == ["init_args.py"]
    assert definition.search('SETTING_KEYS = ("adapter", *(f.name for f in fields(SamplingParams)))')  # the control
