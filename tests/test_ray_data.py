"""Ray Data: `KevPredictor` answers every row as `Engine.generate` does, one packed call per batch.

The Ray tests share one job (2 actors, 16 rows in batches of 4: mixed good rows, an all-bad
batch, bad rows among good ones, adapter rows), since starting the actors is the slow part. The
reference is the same tiny model in this process, all good rows in one `generate` call: greedy
and seeded answers do not depend on what they are packed with. The tests without Ray feed the
predictor batches exactly as Ray's Arrow → numpy / pandas conversion makes them.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from conftest import chat, make_adapter, save_tiny_model, tiny_model
from ray.data.block import BlockAccessor

from kev_engine import Completion, Engine, SamplingParams
from kev_integrations.ray import KevPredictor

SETTINGS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop")
DEFAULTS = {"max_tokens": 8}  # the predictor's sampling=: a row's own columns override it
JOB_TIMEOUT_S = 240
ROWS: list[dict[str, Any]] = [
    # batch 0: good, prompt and chat mixed
    {"id": 0, "prompt": "Once upon a time", "max_tokens": 6},
    {"id": 1, "messages": chat("What is the capital of France?")},
    {"id": 2, "prompt": "The weather today", "stop": ["e", "a"]},
    {"id": 3, "messages": chat("Name a prime number."), "seed": 7, "temperature": 0.8, "top_p": 0.9, "top_k": 50},
    # batch 1: every row refused
    {"id": 4},
    {"id": 5, "prompt": "x", "top_p": 3.0},
    {"id": 6, "prompt": "x", "adapter": "nope"},
    {"id": 7, "prompt": "x", "max_tokens": 0},
    # batch 2: adapters, and a bad row among good ones
    {"id": 8, "prompt": "Once upon a time", "adapter": "a1", "max_tokens": 6},
    {"id": 9, "messages": chat("What is the capital of France?"), "adapter": "a1"},
    {"id": 10, "prompt": "x", "messages": chat("x")},
    {"id": 11, "prompt": "Tell me a story", "seed": 3, "temperature": 1.0},
    # batch 3
    {"id": 12, "messages": chat("Who wrote Hamlet?"), "max_tokens": 1},
    {"id": 13, "prompt": "x", "top_k": -1},
    {"id": 14, "prompt": "Count to ten", "stop": ["zzzz"]},
    {"id": 15, "messages": chat("Why is the sky blue?"), "seed": 11, "temperature": 0.7, "adapter": "a1"},
]
ERRORS = {  # id → what its error must name
    4: "neither of 'prompt' and 'messages'",
    5: "top_p=3.0 is not allowed",
    6: "unknown adapter 'nope'",
    7: "max_tokens=0 is not allowed",
    10: "both of 'prompt' and 'messages'",
    13: "top_k=-1 is not allowed",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    return make_adapter(tiny_model("llama", tokenizer), tmp_path_factory.mktemp("a1"), seed=1)


@pytest.fixture(scope="module")
def reference(model_dir: Path, adapter_dir: Path) -> Engine:
    engine = Engine.from_pretrained(str(model_dir), adapters={"a1": str(adapter_dir)})
    yield engine
    engine.close()


def expected(reference: Engine, rows: list[dict[str, Any]]) -> dict[int, Completion]:
    """The answers `Engine.generate` gives the good rows, in one call, keyed by id."""
    good = [row for row in rows if row["id"] not in ERRORS]
    settings = [SamplingParams(**{**DEFAULTS, **{k: row[k] for k in SETTINGS if k in row}}) for row in good]
    answers = reference.generate(
        [row.get("prompt") or row["messages"] for row in good], settings, adapters=[row.get("adapter") for row in good]
    )
    return {row["id"]: answer for row, answer in zip(good, answers)}


def check_rows(rows: list[dict[str, Any]], sent: list[dict[str, Any]], want: dict[int, Completion]) -> None:
    """Every row sent came back once; a good row equals its reference answer, a bad one has its error."""
    assert sorted(int(row["id"]) for row in rows) == [row["id"] for row in sent]
    for row in rows:
        i = int(row["id"])
        if i in ERRORS:
            assert ERRORS[i] in row["error"], (i, row["error"])
            got = (row["text"], row["finish_reason"], row["prompt_tokens"], row["completion_tokens"])
            assert got == ("", "error", 0, 0), i
            continue
        answer = want[i]
        assert row["error"] is None, (i, row["error"])
        got = (row["text"], row["finish_reason"], row["prompt_tokens"], row["completion_tokens"])
        assert got == (answer.text, answer.finish_reason, answer.prompt_tokens, answer.completion_tokens), i
        # how much depends on what the actor's engine saw before; never the last prompt token (its
        # logits start the answer)
        assert 0 <= row["cached_tokens"] < row["prompt_tokens"], i


def batch_of(rows: list[dict[str, Any]], batch_format: str = "numpy") -> Any:
    """A batch exactly as Ray hands it to a map_batches actor (Arrow block → numpy dict / pandas)."""
    keys = sorted({key for row in rows for key in row})  # from_pylist takes its schema from the first row
    table = pa.Table.from_pylist([{key: row.get(key) for key in keys} for row in rows])
    return BlockAccessor.for_block(table).to_batch_format(batch_format)


def bounded(run: Callable[[], Any], timeout: float) -> Any:
    """`run()` in a daemon thread, failing the test if it takes longer than `timeout` seconds."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the Ray Data job took longer than {timeout} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


# ---- through Ray Data: 2 actors ---------------------------------------------------------------


class WhichActor(KevPredictor):
    """KevPredictor plus the answering actor's process id: both actors must have served batches."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().__call__(batch)
        out["actor_pid"] = np.full(len(out["text"]), os.getpid())
        return out


@pytest.fixture(scope="module")
def ray_job(ray_cluster: Any, model_dir: Path, adapter_dir: Path) -> Any:
    """The 16 rows through 2 KevPredictor actors, materialized (every batch's block concatenated)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    saved = context.wait_for_min_actors_s
    context.wait_for_min_actors_s = JOB_TIMEOUT_S  # an actor that cannot start fails the job, not hangs it
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    try:
        ds = ray.data.from_items(ROWS, override_num_blocks=4)  # 4 blocks of 4 rows: one batch each
        answered = ds.map_batches(
            WhichActor,
            fn_constructor_kwargs={"model": str(model_dir), "adapters": {"a1": str(adapter_dir)}, "sampling": DEFAULTS},
            batch_size=4,
            # as KevPredictor's docs advise; `concurrency=2` is deprecated since Ray 2.51
            compute=ray.data.ActorPoolStrategy(size=2, max_tasks_in_flight_per_actor=1),
            num_cpus=0.5,  # 2 actors in the cluster's 2 CPUs, with room left for Ray Data's own tasks
        )
        return bounded(answered.materialize, JOB_TIMEOUT_S)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        context.wait_for_min_actors_s = saved


@pytest.mark.ray
def test_ray_data_two_actors_answer_every_row_as_generate_does(ray_job: Any, reference: Engine) -> None:
    rows = ray_job.take_all()
    check_rows(rows, ROWS, expected(reference, ROWS))
    by_id = {int(row["id"]): row for row in rows}
    assert by_id[2]["finish_reason"] == "stop" and by_id[0]["finish_reason"] == "length"  # both kinds seen
    assert list(by_id[1]["messages"]) == ROWS[1]["messages"]  # input columns kept
    assert len({row["actor_pid"] for row in rows}) == 2  # the pool waits for both actors, then shares the batches


@pytest.mark.ray
def test_ray_data_bad_rows_get_their_error_and_columns_keep_their_types(ray_job: Any) -> None:
    """Batch 1 is all refused: its columns must still concatenate with the answered batches'."""
    blocks = list(ray_job.iter_batches(batch_size=None, batch_format="pyarrow"))  # one table per output block
    assert sum(block.num_rows for block in blocks) == len(ROWS)
    for block in blocks:  # from_items gives each block the columns its own rows have
        types = dict(zip(block.schema.names, block.schema.types))
        assert types["text"] == types["finish_reason"] == pa.string()
        assert types["prompt_tokens"] == types["completion_tokens"] == types["cached_tokens"] == pa.int64()
        assert types["error"] in (pa.string(), pa.null())  # null: no row of the block failed
        for name in ("stop", "messages"):  # handed back as Arrow lists, not pickled Python objects
            assert name not in types or pa.types.is_list(types[name]) or types[name] == pa.null(), name
    frame = ray_job.to_pandas().set_index("id")  # concatenates every block
    assert set(frame.index[frame["error"].notna()]) == set(ERRORS)
    assert (frame.loc[[4, 5, 6, 7], "finish_reason"] == "error").all()


@pytest.mark.ray
def test_ray_data_adapter_column_routes_each_row(ray_job: Any, reference: Engine) -> None:
    by_id = {int(row["id"]): row for row in ray_job.take_all()}
    # the same prompt and settings, with and without the adapter: the adapter really changes the answer
    assert by_id[8]["text"] != by_id[0]["text"]
    want = expected(reference, ROWS)
    assert by_id[8]["text"] == want[8].text and by_id[15]["text"] == want[15].text


# ---- without Ray: the predictor on batches as Ray makes them ----------------------------------


@pytest.fixture(scope="module")
def predictor(model_dir: Path, adapter_dir: Path) -> KevPredictor:
    predictor = KevPredictor(str(model_dir), adapters={"a1": str(adapter_dir)}, sampling=DEFAULTS)
    yield predictor
    predictor.engine.close()


@pytest.fixture
def generate_calls(predictor: KevPredictor, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many prompts each `engine.generate` call of the predictor got."""
    calls: list[int] = []
    generate = predictor.engine.generate

    def spy(prompts: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(prompts))
        return generate(prompts, *args, **kwargs)

    monkeypatch.setattr(predictor.engine, "generate", spy)
    return calls


def rows_of(out: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    return [{name: column[i] for name, column in out.items()} for i in range(len(out["id"]))]


def test_one_batch_is_one_generate_call_and_one_pack(
    predictor: KevPredictor, generate_calls: list[int], reference: Engine
) -> None:
    rows = ROWS[8:16]  # adapters, bad rows, seeds, int columns with gaps (float64 with NaN)
    passes = predictor.engine.stats()["prefill_passes"]
    out = predictor(batch_of(rows))
    assert generate_calls == [len([r for r in rows if r["id"] not in ERRORS])]
    assert predictor.engine.stats()["prefill_passes"] == passes + 1  # all valid rows prefilled in one pass
    check_rows(rows_of(out), rows, expected(reference, rows))


def test_numpy_values_as_arrow_and_numpy_hand_them(predictor: KevPredictor, reference: Engine) -> None:
    """np.int64 / np.str_ / np.bool_ scalars, NaN and NA for unset, `stop` as a string or an array."""
    batch = {
        "id": np.arange(5),
        "prompt": np.array(["Once upon a time", "Tell me a story", "x", "x", "x"]),  # np.str_ elements
        "max_tokens": np.array([4, 5, 6, 7, 8]),  # np.int64
        "seed": np.array([np.nan, 3.0, np.nan, np.nan, np.nan]),
        "temperature": np.array([None, 1.0, "hot", None, None], dtype=object),
        "top_k": np.array([pd.NA, pd.NA, pd.NA, np.bool_(True), pd.NA], dtype=object),
        "stop": np.array(["e", np.array(["zz", "a"], dtype=object), None, None, ""], dtype=object),
    }
    out = predictor(batch)
    errors = list(out["error"])
    assert errors[:2] == [None, None]
    assert "temperature='hot' is not allowed" in errors[2]
    assert "top_k=True is not allowed" in errors[3]
    assert "stop='' is not allowed" in errors[4]
    want = reference.generate(
        ["Once upon a time", "Tell me a story"],
        [SamplingParams(max_tokens=4, stop=("e",)),
         SamplingParams(max_tokens=5, seed=3, temperature=1.0, stop=("zz", "a"))],
    )
    assert [out["text"][0], out["text"][1]] == [a.text for a in want]
    assert list(out["completion_tokens"][:2]) == [a.completion_tokens for a in want]


def test_pandas_batch_in_pandas_batch_out(predictor: KevPredictor, reference: Engine) -> None:
    rows = ROWS[:8]
    frame = batch_of(rows, "pandas")
    out = predictor(frame)
    assert isinstance(out, pd.DataFrame) and out.index.equals(frame.index)
    assert list(out.columns[: len(frame.columns)]) == list(frame.columns)  # input columns kept, in order
    check_rows(out.to_dict("records"), rows, expected(reference, rows))
    assert out["prompt_tokens"].dtype == np.int64 and out["error"].dtype == object


def test_all_bad_batch_runs_nothing_and_keeps_the_column_types(
    predictor: KevPredictor, generate_calls: list[int]
) -> None:
    passes = predictor.engine.stats()["forward_passes"]
    bad = predictor(batch_of(ROWS[4:8]))
    assert predictor.engine.stats()["forward_passes"] == passes  # nothing ran
    good = predictor(batch_of(ROWS[:2]))
    empty = predictor({"id": np.array([], dtype=np.int64), "prompt": np.array([], dtype=object)})
    assert generate_calls == [1, 2]  # the unknown adapter is refused by generate itself; the empty batch calls nothing
    assert len(empty["text"]) == 0
    for name in ("text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "error"):
        assert bad[name].dtype == good[name].dtype == empty[name].dtype, name
    bad_block, good_block = BlockAccessor.batch_to_block(bad), BlockAccessor.batch_to_block(good)
    for name in ("text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"):
        assert bad_block.schema.field(name).type == good_block.schema.field(name).type, name


def test_every_setting_but_constraints_is_a_column(predictor: KevPredictor, monkeypatch: pytest.MonkeyPatch) -> None:
    """The columns are SamplingParams' settings (cache_salt, penalties...), never its constraints."""
    seen: list[Any] = []
    generate = predictor.engine.generate

    def spy(prompts: Any, sampling: Any, *args: Any, **kwargs: Any) -> Any:
        seen.extend(sampling)
        return generate(prompts, sampling, *args, **kwargs)

    monkeypatch.setattr(predictor.engine, "generate", spy)
    out = predictor({"id": np.arange(2), "prompt": np.array(["Once upon a time", "x"]),
                     "cache_salt": np.array(["tenant-a", None], dtype=object),
                     "frequency_penalty": np.array([0.5, np.nan]), "min_tokens": np.array([2.0, np.nan]),
                     "regex": np.array(["[0-9]+", "[a-z]+"])})  # a dataset's own column: not a constraint
    assert list(out["error"]) == [None, None]
    assert seen == [SamplingParams(max_tokens=8, cache_salt="tenant-a", frequency_penalty=0.5, min_tokens=2),
                    SamplingParams(max_tokens=8)]
