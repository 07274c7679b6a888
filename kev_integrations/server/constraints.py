"""The constraint on a reply: OpenAI's ``response_format`` and vLLM's guided fields → the engine's one.

Where this sits: `protocol` reads every body field that can constrain a reply through here, for
both endpoints, and gets back one of the engine's constraint settings (`SamplingParams`'
json_schema, json_object, regex, choice, grammar or structural_tag) and the field it came from,
which errors then name.

- ``response_format``: OpenAI's types text, json_object and json_schema; vLLM's structural_tag;
  Kev's regex, choice and grammar (``{"type": "regex", "regex": "..."}``).
- vLLM's guided fields: ``guided_json`` (a schema, or its JSON text), ``guided_regex``,
  ``guided_choice`` (a list of strings), ``guided_grammar`` (xgrammar's EBNF, the GBNF dialect
  with a ``root`` rule: vLLM also converts Lark grammars for xgrammar, Kev does not).
- vLLM's ``structured_outputs`` object: one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object`` (true) and ``structural_tag``, with the guided fields' meanings.

A reply takes one constraint: two of them (two fields, or two keys of ``structured_outputs``)
are a 400 naming both, never one quietly winning over the other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .errors import bad_request

GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
"""vLLM's guided body fields → the engine setting each becomes."""
STRUCTURED_OUTPUT_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                          "json_object": "json_object", "structural_tag": "structural_tag"}
"""The keys of vLLM's ``structured_outputs`` → the engine setting each becomes."""
CONSTRAINT_FIELDS = {"response_format", "structured_outputs", *GUIDED_FIELDS}
"""Every body field that constrains the reply."""


def reply_constraint(body: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The engine constraint `body` asks for (``{setting: value}``, empty for none) and the field
    it came from (None for none)."""
    found: list[tuple[str, dict[str, Any]]] = []  # (the client's field, the engine's setting)
    response_format = _response_format(body.get("response_format"))
    if response_format:
        found.append(("response_format", response_format))
    for name, setting in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, {setting: _value(name, setting, body[name])}))
    found += _structured_outputs(body.get("structured_outputs"))
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]} both constrain the reply; a reply takes one "
                          "constraint, give only one of them", param=found[1][0])
    return (found[0][1], found[0][0]) if found else ({}, None)


def _response_format(response_format: Any) -> dict[str, Any]:
    """OpenAI's `response_format` → the engine's constraint setting (empty for plain text)."""
    if response_format is None:
        return {}
    if not isinstance(response_format, Mapping) or "type" not in response_format:
        raise bad_request(f"response_format={response_format!r} is not allowed; use {{'type': ...}}",
                          param="response_format")
    kind = response_format["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise bad_request("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                              param="response_format")
        return {"json_schema": dict(spec["schema"])}
    if kind == "structural_tag":  # vLLM's extension: the whole object is xgrammar's structural tag
        return {"structural_tag": dict(response_format)}
    if kind in ("regex", "choice", "grammar"):  # Kev's extensions: {"type": "regex", "regex": "..."}
        return {kind: response_format.get(kind)}
    raise bad_request(
        f"response_format type {kind!r} is not supported; use text, json_object, json_schema, regex, choice, "
        "grammar or structural_tag", param="response_format",
    )


def _structured_outputs(value: Any) -> list[tuple[str, dict[str, Any]]]:
    """vLLM's ``structured_outputs`` → one (field, setting) per key that asks for a constraint."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise bad_request(f"structured_outputs={value!r} is not allowed; use an object with one of "
                          f"{sorted(STRUCTURED_OUTPUT_KEYS)}", param="structured_outputs")
    found = []
    for key, given in value.items():
        name = f"structured_outputs.{key}"
        if key not in STRUCTURED_OUTPUT_KEYS:
            if given in (None, False):  # vLLM's options at their "off" value change nothing
                continue
            raise bad_request(f"{name}={given!r} is not supported by Kev; structured_outputs takes one of "
                              f"{sorted(STRUCTURED_OUTPUT_KEYS)}", param=name)
        if given is None or (key == "json_object" and given is False):
            continue
        found.append((name, {STRUCTURED_OUTPUT_KEYS[key]: _value(name, STRUCTURED_OUTPUT_KEYS[key], given)}))
    return found


def _value(name: str, setting: str, value: Any) -> Any:
    """One guided value checked in the words of the field it came in (`name`): the engine's own
    checks would name its setting instead ("json_schema" where the client sent guided_json)."""
    if setting == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"{name} is not valid JSON ({exc}): {value[:200]!r}", param=name) from None
        if not isinstance(value, Mapping):
            raise bad_request(f"{name}={value!r} is not allowed; use a JSON schema (an object) or its JSON text",
                              param=name)
        return dict(value)
    if setting == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{name}={value!r} is not allowed; use a non-empty list of non-empty strings",
                              param=name)
        return value
    if setting == "json_object":
        if value is not True:
            raise bad_request(f"{name}={value!r} is not allowed; use true (or leave it out)", param=name)
        return True
    if setting == "structural_tag":  # vLLM sends the tag as JSON text; the engine takes either form
        return value
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name}={value!r} is not allowed; use a non-empty string", param=name)
    return value
