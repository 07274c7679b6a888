"""Constrained decoding in the engine: a grammar per question, in the same pack as free ones.

Every constrained reply must match its own constraint; free questions packed with them must
equal their solo runs token for token (they pay nothing and see nothing); a constrained
question must equal its solo constrained run (greedy, and seeded sampling); bad constraints
fail alone with a message naming what was wrong.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
from conftest import FAMILIES, QUESTIONS, chat, tiny_model
from pydantic import BaseModel, Field

from kev_engine import ConstraintError, Engine, InvalidRequestError, SamplingParams


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    capital: bool


class Verdict(BaseModel):
    answer: Literal["yes", "no", "unknown"]
    confidence: int = Field(ge=0, le=100)


class Person(BaseModel):
    name: str = Field(max_length=40)
    born: int = Field(ge=1000, le=2100)


CONSTRAINED = [
    (chat("Describe Paris as JSON with name, country and whether it is a capital."),
     SamplingParams(json_schema=City, max_tokens=64), City),  # a pydantic class
    (chat("Is water wet? Answer in JSON."),
     SamplingParams(json_schema=Verdict.model_json_schema(), max_tokens=64), Verdict),  # a dict
    (chat("Who wrote Hamlet? Give name and birth year as JSON."),
     SamplingParams(json_schema=json.dumps(Person.model_json_schema()), max_tokens=64), Person),  # JSON text
]
FREE = [
    (chat("What is the capital of Italy?"), SamplingParams(max_tokens=16)),
    (chat("Write a haiku about rain."), SamplingParams(max_tokens=16)),
]


def test_a_pack_of_schemas_and_free_questions(embedded_engine: Engine) -> None:
    prompts = [p for p, _, _ in CONSTRAINED] + [p for p, _ in FREE]
    settings = [s for _, s, _ in CONSTRAINED] + [s for _, s in FREE]
    before = embedded_engine.stats()["prefill_passes"]
    packed = embedded_engine.generate(prompts, settings)
    assert embedded_engine.stats()["prefill_passes"] == before + 1  # one pack, constrained or not
    for (prompt, sampling, model), reply in zip(CONSTRAINED, packed):
        assert reply.finish_reason == "stop", reply
        model.model_validate_json(reply.text)  # parses and validates against its own schema
        assert embedded_engine.generate([prompt], sampling)[0].token_ids == reply.token_ids
    for (prompt, sampling), reply in zip(FREE, packed[len(CONSTRAINED):]):
        assert embedded_engine.generate([prompt], sampling)[0].token_ids == reply.token_ids


def test_free_replies_are_untouched_by_constrained_pack_mates(embedded_engine: Engine) -> None:
    """Perturbation: adding constrained neighbours changes nothing for a free question."""
    prompt, sampling = FREE[0]
    alone = embedded_engine.generate([prompt], sampling)[0]
    with_neighbours = embedded_engine.generate(
        [CONSTRAINED[0][0], prompt, CONSTRAINED[1][0]], [CONSTRAINED[0][1], sampling, CONSTRAINED[1][1]]
    )[1]
    assert with_neighbours.token_ids == alone.token_ids
    unconstrained = embedded_engine.generate([CONSTRAINED[0][0]], SamplingParams(max_tokens=64))[0]
    assert not unconstrained.text.startswith("{")  # the grammar, not the prompt, made the JSON


def test_regex_and_choice(embedded_engine: Engine) -> None:
    regex = r"\d{3}-\d{4}"
    replies = embedded_engine.generate(
        [chat("Give me a phone number."), chat("Is the sky blue? yes or no"), chat("Pick a colour.")],
        [SamplingParams(regex=regex), SamplingParams(choice=["yes", "no"]),
         SamplingParams(choice=["dark red", "light blue", "green"])],
    )
    assert re.fullmatch(regex, replies[0].text), replies[0]
    assert replies[1].text in ("yes", "no") and replies[1].finish_reason == "stop"
    assert replies[2].text in ("dark red", "light blue", "green")


def test_seeded_sampling_under_a_constraint_is_independent_of_pack_mates(embedded_engine: Engine) -> None:
    seeded = SamplingParams(json_schema=Verdict, temperature=1.0, top_p=0.95, seed=7, max_tokens=64)
    prompt = CONSTRAINED[1][0]
    alone = embedded_engine.generate([prompt], seeded)[0]
    packed = embedded_engine.generate(
        [FREE[0][0], prompt, CONSTRAINED[2][0]],
        [SamplingParams(temperature=0.9, seed=1, max_tokens=16), seeded, CONSTRAINED[2][1]],
    )[1]
    assert packed.token_ids == alone.token_ids
    Verdict.model_validate_json(alone.text)


def test_stop_strings_and_streaming_keep_working(embedded_engine: Engine) -> None:
    sampling = SamplingParams(json_schema=City, max_tokens=64)
    whole = embedded_engine.generate([CONSTRAINED[0][0]], sampling)[0]
    assert "".join(embedded_engine.stream(CONSTRAINED[0][0], sampling)) == whole.text
    cut = embedded_engine.generate([CONSTRAINED[0][0]], SamplingParams(json_schema=City, stop=['"country"']))[0]
    assert whole.text.startswith(cut.text) and '"country"' not in cut.text and cut.finish_reason == "stop"


def test_max_tokens_mid_object_ends_with_length(embedded_engine: Engine) -> None:
    reply = embedded_engine.generate([CONSTRAINED[0][0]], SamplingParams(json_schema=City, max_tokens=5))[0]
    assert reply.finish_reason == "length" and reply.completion_tokens == 5
    with pytest.raises(ValueError):
        json.loads(reply.text)


def test_bad_constraints_fail_alone_with_clear_errors(embedded_engine: Engine) -> None:
    bad = [
        (SamplingParams(json_schema={"type": "bogus"}), 'Unsupported type "bogus"'),
        (SamplingParams(regex="(unclosed"), "regex could not be compiled"),
        (SamplingParams(grammar="root ::= missing_rule"), "grammar could not be compiled"),
        (SamplingParams(json_schema={"type": "string", "minLength": 5, "maxLength": 2}), "minLength 5"),
    ]
    replies = embedded_engine.generate(
        [chat("x")] * len(bad) + [FREE[0][0]], [s for s, _ in bad] + [FREE[0][1]], return_exceptions=True
    )
    for (_, words), reply in zip(bad, replies):
        assert isinstance(reply, ConstraintError) and words in str(reply), reply
        assert "/project/" not in str(reply)  # xgrammar's source location is not the user's business
    assert replies[-1].token_ids == embedded_engine.generate([FREE[0][0]], FREE[0][1])[0].token_ids
    with pytest.raises(ConstraintError, match="bogus"):  # without return_exceptions: raised before running
        embedded_engine.generate([chat("x")], SamplingParams(json_schema={"type": "bogus"}))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(json_schema={"type": "object"}, regex="a"), "at most one of"),
        (dict(choice=[]), "choice=[]"),
        (dict(choice=["a", 3]), "choice="),
        (dict(regex=""), "regex=''"),
        (dict(json_schema="{not json"), "json_schema is not valid JSON"),
        (dict(json_schema=[1, 2]), "json_schema=[1, 2]"),
        (dict(json_object="yes"), "json_object='yes'"),
        (dict(structural_tag=5), "structural_tag=5"),
    ],
)
def test_bad_constraint_settings_name_the_value(kwargs, named) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(named)):
        SamplingParams(**kwargs)


def test_constraints_are_stored_canonically_and_cached(embedded_engine: Engine) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    as_dict, as_text = SamplingParams(json_schema=schema), SamplingParams(json_schema=json.dumps(schema, indent=2))
    assert as_dict.constraint == as_text.constraint == ("json_schema", json.dumps(schema, separators=(",", ":")))
    assert json.loads(SamplingParams(json_schema=City).json_schema) == City.model_json_schema()
    stats = embedded_engine.stats()
    embedded_engine.generate([chat("a"), chat("b")], [SamplingParams(json_schema=schema, max_tokens=4),
                                                      SamplingParams(json_schema=json.dumps(schema), max_tokens=4)])
    after = embedded_engine.stats()
    assert after["grammar_compiles"] - stats["grammar_compiles"] <= 1  # the same constraint compiles once
    assert after["grammar_cache_hits"] - stats["grammar_cache_hits"] >= 1


def test_json_object_mode_replies_with_an_object(embedded_engine: Engine) -> None:
    prompt = chat("Return a JSON object with the keys name and age for a 30 year old called Bob.")
    reply = embedded_engine.generate([prompt], SamplingParams(json_object=True, max_tokens=64))[0]
    assert reply.finish_reason == "stop" and isinstance(json.loads(reply.text), dict)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_constrained_rows_on_each_family_equal_their_solo_runs(tokenizer, family: str) -> None:
    """Random-weight models: the mask, not the model, makes the reply match; packing changes nothing."""
    engine = Engine(tiny_model(family, tokenizer), tokenizer, name=family)
    try:
        settings = [SamplingParams(regex=r"[a-z]{2,6}( [a-z]{2,6}){0,2}", max_tokens=24),
                    SamplingParams(max_tokens=6),
                    SamplingParams(choice=["alpha", "beta", "gamma"], temperature=1.0, seed=3)]
        prompts = [QUESTIONS[0], QUESTIONS[1], QUESTIONS[3]]
        packed = engine.generate(prompts, settings)
        solo = [engine.generate([p], s)[0] for p, s in zip(prompts, settings)]
        assert [r.token_ids for r in packed] == [r.token_ids for r in solo]
        if packed[0].finish_reason == "stop":
            assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){0,2}", packed[0].text)
        else:  # cut by max_tokens: still a prefix the regex allows
            assert re.fullmatch(r"[a-z ]*", packed[0].text)
        assert packed[2].text in ("alpha", "beta", "gamma")
    finally:
        engine.close()


def test_constrained_questions_with_adapters_equal_their_solo_runs(tokenizer, tmp_path) -> None:
    from conftest import make_adapter

    base = tiny_model("qwen2", tokenizer)
    folder = make_adapter(base, tmp_path / "a", seed=1)
    engine = Engine(base, tokenizer, name="qwen2")
    try:
        engine.load_adapter("a", str(folder))
        choose = SamplingParams(choice=["red", "green", "blue"])
        packed = engine.generate([QUESTIONS[0], QUESTIONS[0]], [choose, choose], adapters=["a", None])
        assert packed[0].token_ids == engine.generate([QUESTIONS[0]], choose, adapters="a")[0].token_ids
        assert packed[1].token_ids == engine.generate([QUESTIONS[0]], choose)[0].token_ids
        assert all(r.text in ("red", "green", "blue") for r in packed)
    finally:
        engine.close()


def test_the_grammar_cache_is_bounded_in_bytes_and_kept_apart_by_salt(tokenizer) -> None:
    from kev_engine.sample.grammar import Grammars

    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    first = grammars.compile(("regex", "[a-z]{1,8}"))
    size = first.memory_size_bytes  # xgrammar's own measure of what the cache holds
    assert size > 0 and grammars.cached_bytes == size
    grammars.max_bytes = 2 * size + size // 2  # room for two grammars of about this size
    for pattern in ("[a-z]{1,9}", "[a-z]{1,10}", "[a-z]{1,11}"):
        grammars.compile(("regex", pattern))
        assert grammars.cached_bytes <= grammars.max_bytes
    assert not grammars.is_cached(("regex", "[a-z]{1,8}"))  # least recently used: out first
    assert grammars.is_cached(("regex", "[a-z]{1,11}"))
    # another salt is another entry: whether a grammar compiles at once must not tell one tenant
    # what another has used
    assert not grammars.is_cached(("regex", "[a-z]{1,11}"), salt="tenant-b")
    compiles = grammars.compiles
    grammars.compile(("regex", "[a-z]{1,11}"), salt="tenant-b")
    assert grammars.compiles == compiles + 1 and grammars.is_cached(("regex", "[a-z]{1,11}"), salt="tenant-b")
    grammars.max_bytes = 1  # smaller than any grammar: the newest is kept all the same, alone
    grammars.compile(("regex", "[0-9]+"))
    assert grammars.is_cached(("regex", "[0-9]+")) and grammars.cached_bytes == grammars.compile(
        ("regex", "[0-9]+")).memory_size_bytes


def test_compile_grammar_fills_the_cache_that_submitting_reads(tiny_engine: Engine) -> None:
    sampling = SamplingParams(choice=["red", "blue"], cache_salt="t")
    assert not tiny_engine.has_grammar(sampling) and tiny_engine.has_grammar(SamplingParams())
    tiny_engine.compile_grammar(sampling)
    before = tiny_engine.stats()
    assert tiny_engine.has_grammar(sampling) and not tiny_engine.has_grammar(SamplingParams(choice=["red", "blue"]))
    assert tiny_engine.generate(["Pick a colour:"], sampling)[0].text in ("red", "blue")
    after = tiny_engine.stats()
    assert (after["grammar_compiles"], after["grammar_cache_hits"]) == (before["grammar_compiles"],
                                                                      before["grammar_cache_hits"] + 1)
    with pytest.raises(ConstraintError, match="bogus"):
        tiny_engine.compile_grammar(SamplingParams(json_schema={"type": "bogus"}))
