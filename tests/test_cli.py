"""The `kev` command line, run in-process on a tiny random-weight engine."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
from conftest import chat, make_adapter, tiny_model
from PIL import Image
from test_visualize import find_mask

from kev_engine import Engine, SamplingParams
from kev_engine.platforms.cpu import kernels
from kev_engine.tools import cli
from kev_engine.tools import visualize as vis
from kev_engine.tools.verify import verify


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch, tiny_engine: Engine) -> list[tuple[Any, dict[str, Any]]]:
    """Make `Engine.from_pretrained` hand out the tiny engine; record how it was called."""
    calls: list[tuple[Any, dict[str, Any]]] = []

    def fake_from_pretrained(model: Any = None, **kwargs: Any) -> Engine:
        calls.append((model, kwargs))
        return tiny_engine

    monkeypatch.setattr(Engine, "from_pretrained", fake_from_pretrained)
    return calls


def write_jsonl(path, lines: list[Any]) -> str:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def output_rows(capsys: pytest.CaptureFixture[str]) -> tuple[list[dict[str, Any]], str]:
    captured = capsys.readouterr()
    return [json.loads(line) for line in captured.out.splitlines()], captured.err


def test_jsonl_in_jsonl_out_in_order(loads, capsys, tmp_path, tokenizer) -> None:
    lines = [
        {"question": "What is the capital of France?", "id": "paris"},
        {"question": "Who wrote Hamlet?", "context": "Hamlet is a play by Shakespeare.", "max_tokens": 3},
        "",  # blank lines are skipped
        {"messages": [{"role": "user", "content": "Name a prime number."}], "temperature": 0.9, "seed": 7},
    ]
    path = write_jsonl(tmp_path / "q.jsonl", lines)
    code = cli.main(["generate", "--file", path, "--max-tokens", "6", "--model", "m", "--device", "cpu"])
    rows, err = output_rows(capsys)
    assert code == 0
    assert loads == [("m", {"device": "cpu", "dtype": None, "max_model_len": None, "model_impl": None,
                            "speculative": None, "weights": None, "draft_model": None})]
    assert [r["id"] for r in rows] == ["paris", 1, 2]  # default id: position among the questions
    assert all(r["completion_tokens"] <= n for r, n in zip(rows, [6, 3, 6]))
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)
    assert "stats" in err and "forward_passes" in err

    # the same questions asked of the engine directly (same weights) give the same answers
    prompts = [chat(lines[0]["question"]), chat(lines[1]["question"], lines[1]["context"]), lines[3]["messages"]]
    settings = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=3),
                SamplingParams(max_tokens=6, temperature=0.9, seed=7)]
    with Engine(tiny_model("llama", tokenizer), tokenizer) as direct:
        expected = direct.generate(prompts, settings)
    assert [r["text"] for r in rows] == [c.text for c in expected]
    assert [r["prompt_tokens"] for r in rows] == [c.prompt_tokens for c in expected]


def test_a_refused_question_fails_alone(loads, capsys, tmp_path) -> None:
    lines = [
        {"question": "first", "max_tokens": 2},
        {"question": "second", "temperature": -1},
        {"question": "third", "temprature": 0.5},
        {"question": ""},
        {"question": "fifth", "max_tokens": 2},
    ]
    code = cli.main(["generate", "--file", write_jsonl(tmp_path / "q.jsonl", lines)])
    rows, _ = output_rows(capsys)
    assert code == 1
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4]
    assert "temperature=-1" in rows[1]["error"]
    assert "temprature" in rows[2]["error"]
    assert "empty" in rows[3]["error"]  # refused by the engine, not the CLI
    assert {"text", "finish_reason"} <= rows[0].keys() and {"text", "finish_reason"} <= rows[4].keys()


def test_bad_json_names_the_line_and_loads_nothing(loads, capsys, tmp_path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "fine"}, '{"question": "oops",}'])
    assert cli.main(["generate", "--file", path]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "not valid JSON" in err
    path = write_jsonl(tmp_path / "list.jsonl", ['["not", "an", "object"]'])
    assert cli.main(["generate", "--file", path]) == 2
    assert "line 1: expected a JSON object, got list" in capsys.readouterr().err
    assert loads == []  # usage errors are caught before the model loads


@pytest.mark.parametrize(
    "argv",
    [["generate"], ["generate", "hi", "--temperature", "-1"], ["generate", "hi", "--max-tokens", "x"],
     ["generate", "--file", "/no/such/file.jsonl"], ["show-pack", "hi"], ["frobnicate"]],
)
def test_usage_errors_exit_2(loads, capsys, argv: list[str]) -> None:
    assert cli.main(argv) == 2
    assert capsys.readouterr().err
    assert loads == []


def test_arguments_stdin_system_and_raw(loads, capsys, monkeypatch, tiny_engine: Engine) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO('{"question": "from stdin"}\n'))
    argv = ["generate", "one", "--file", "-", "--system", "Be brief.", "--max-tokens", "2", "--stop", "."]
    assert cli.main(argv) == 0
    rows, _ = output_rows(capsys)
    system = {"role": "system", "content": "Be brief."}
    assert [r["prompt_tokens"] for r in rows] == [
        len(tiny_engine.encode([system, {"role": "user", "content": q}])) for q in ("one", "from stdin")
    ]


def test_raw_sends_plain_text(loads, capsys, tiny_engine: Engine) -> None:
    assert cli.main(["generate", "Once upon a time", "--raw", "--max-tokens", "2"]) == 0
    rows, _ = output_rows(capsys)
    assert rows[0]["prompt_tokens"] == len(tiny_engine.encode("Once upon a time"))


def test_show_pack_draws_the_mask_and_prints_the_table(loads, capsys, tmp_path, tiny_engine: Engine) -> None:
    out = tmp_path / "pack.png"
    questions = ["What is the capital of France?", "Why is the sky blue? " * 5, "Name a prime."]
    assert cli.main(["show-pack", *questions, "--out", str(out), "--max-pixels", "600"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == list(vis.COLUMNS)
    table = [dict(zip(vis.COLUMNS, line.split())) for line in lines[1:]]
    lengths = [len(tiny_engine.encode(chat(q))) for q in questions]
    assert [int(r["tokens"]) for r in table] == lengths
    assert [int(r["start"]) for r in table] == [0, lengths[0], lengths[0] + lengths[1]]

    num_tokens = sum(lengths)
    side = min(600, max(num_tokens, vis.MIN_SIDE))
    _, left, top = find_mask(out, side)
    pixels = np.asarray(Image.open(out).convert("RGB"))  # [H, W, 3]

    def colour(query: float, key: float) -> tuple[int, ...]:
        scale = side / num_tokens
        return tuple(pixels[top + int(query * scale), left + int(key * scale)])

    assert colour(lengths[0] + lengths[1] / 2, lengths[0] / 2) == vis.BACKGROUND  # off-diagonal block
    assert colour(lengths[0] * 0.9, lengths[0] * 0.1) == vis.PALETTE[0]  # inside question 0's triangle
    assert colour(lengths[0] * 0.1, lengths[0] * 0.9) == vis.BACKGROUND  # its future: masked


def test_show_pack_refuses_a_bad_question(loads, capsys, tmp_path) -> None:
    out = tmp_path / "pack.png"
    assert cli.main(["show-pack", "fine", "   ", "--out", str(out), "--raw"]) == 1
    assert "question 1" in capsys.readouterr().err
    assert not out.exists()


def test_show_pack_labels_ids_and_shows_shared_prefixes_per_adapter(loads, capsys, tmp_path, sql_adapter) -> None:
    doc = "The Harbour Museum opened in 1998 in a former customs house and holds a lighthouse lens. " * 3
    questions = ["When?", "What?", "Where?"]
    lines = [{"id": f"museum-{i}", "question": q, "context": doc} for i, q in enumerate(questions, 1)]
    lines += [{"id": "museum-sql", "question": "When?", "context": doc, "adapter": "sql"},
              {"question": "Name a prime."}]
    path = write_jsonl(tmp_path / "doc_qa.jsonl", lines)
    out = tmp_path / "pack.png"
    assert cli.main(["show-pack", "--file", path, "--adapter", f"sql={sql_adapter}", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    lines_out = captured.out.splitlines()
    assert lines_out[0].split() == list(vis.COLUMNS)
    table = [dict(zip(vis.COLUMNS, line.split())) for line in lines_out[1:]]
    assert [r["id"] for r in table] == ["museum-1", "museum-2", "museum-3", "museum-sql", "4"]  # ids from the file
    assert [r["adapter"] for r in table] == ["base", "base", "base", "sql", "base"]
    shared = [int(r["shared_prefix"]) for r in table]
    assert shared[0] == 0 and shared[1] == shared[2] > 0  # the document is computed once
    assert shared[3] == 0 and shared[4] == 0  # another adapter never shares with the base model
    assert f"{sum(shared)} read from shared prefixes" in captured.err and out.exists()


def test_show_pack_refuses_an_unknown_adapter(loads, capsys, tmp_path) -> None:
    lines = [{"id": "a", "question": "hi"}, {"id": "b", "question": "x", "adapter": "nope"}]
    path = write_jsonl(tmp_path / "q.jsonl", lines)
    out = tmp_path / "pack.png"
    assert cli.main(["show-pack", "--file", path, "--out", str(out)]) == 1
    assert "question 'b': unknown adapter 'nope'; loaded: []" in capsys.readouterr().err
    assert not out.exists()


# ---- LoRA adapters: --adapter NAME=PATH, a line's "adapter", --use-adapter ---------------------


@pytest.fixture
def sql_adapter(tmp_path, tokenizer) -> str:
    """A PEFT adapter for the tiny llama the `loads` fixture hands out (same seed, same weights)."""
    return str(make_adapter(tiny_model("llama", tokenizer), tmp_path / "sql", seed=3, scale=0.5))


def direct_answers(tokenizer, adapter: str, prompts: list[Any], adapters: list[str | None]) -> list[str]:
    with Engine(tiny_model("llama", tokenizer), tokenizer) as direct:
        direct.load_adapter("sql", adapter)
        return [c.text for c in direct.generate(prompts, SamplingParams(max_tokens=6), adapters=adapters)]


def test_a_line_picks_its_adapter(loads, capsys, tmp_path, tokenizer, sql_adapter) -> None:
    lines = [{"question": "List the tables.", "adapter": "sql"}, {"question": "List the tables."},
             {"question": "List the tables.", "adapter": "nope"}]
    path = write_jsonl(tmp_path / "q.jsonl", lines)
    code = cli.main(["generate", "--file", path, "--adapter", f"sql={sql_adapter}", "--max-tokens", "6"])
    rows, _ = output_rows(capsys)
    assert code == 1  # the unknown adapter fails its own line only
    assert "unknown adapter 'nope'; loaded: ['sql']" in rows[2]["error"]
    expected = direct_answers(tokenizer, sql_adapter, [chat("List the tables.")] * 2, ["sql", None])
    assert [r["text"] for r in rows[:2]] == expected
    assert expected[0] != expected[1]  # the adapter really answers differently


def test_use_adapter_is_the_default_for_questions_naming_none(loads, capsys, tmp_path, tokenizer, sql_adapter) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "List the tables.", "adapter": None}])
    argv = ["generate", "List the tables.", "--file", path, "--adapter", f"sql={sql_adapter}", "--use-adapter", "sql",
            "--max-tokens", "6"]
    assert cli.main(argv) == 0
    rows, _ = output_rows(capsys)
    expected = direct_answers(tokenizer, sql_adapter, [chat("List the tables.")] * 2, ["sql", None])
    assert [r["text"] for r in rows] == expected  # the argument → sql; the line's null → the base model


@pytest.mark.parametrize("flags, named", [
    (["--adapter", "sqlpath"], "--adapter 'sqlpath' is not NAME=PATH"),
    (["--adapter", "=somewhere"], "--adapter '=somewhere' is not NAME=PATH"),
    (["--adapter", "sql="], "--adapter 'sql=' is not NAME=PATH"),
    (["--adapter", "sql=/no/such/adapter"], "folder '/no/such/adapter' does not exist"),
    (["--use-adapter", "sql"], "--use-adapter 'sql' is not loaded"),
])
def test_bad_adapter_flags_are_usage_errors(loads, capsys, flags, named) -> None:
    assert cli.main(["generate", "hi", *flags]) == 2
    assert named in capsys.readouterr().err
    assert loads == []  # refused before the model loads


def test_a_folder_that_is_no_adapter_exits_2(loads, capsys, tmp_path, sql_adapter) -> None:
    argv = ["generate", "hi", "--adapter", f"sql={sql_adapter}", "--adapter", f"other={tmp_path}"]
    assert cli.main(argv) == 2
    assert "adapter 'other': no adapter_config.json" in capsys.readouterr().err


def test_a_missing_model_folder_exits_2_without_the_network(capsys, tmp_path) -> None:
    missing = str(tmp_path / "no-such-model")
    assert cli.main(["generate", "hi", "--model", missing]) == 2
    assert f"model folder '{missing}' does not exist" in capsys.readouterr().err


def test_verify_reports_packed_equals_solo_with_shared_prefixes(tmp_path, capsys) -> None:
    doc = "The Harbor Museum opened in 1901 and holds 3,000 paintings of the sea and its ships. " * 6
    lines = [{"id": f"q{i}", "question": q, "context": doc} for i, q in enumerate(["When?", "How many?", "What?"])]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    assert cli.main(["verify", "--file", str(path), "--max-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == ["q0", "q1", "q2"] and all(r["ok"] and r["tokens_match"] for r in rows)
    assert rows[1]["shared_prefix_tokens"] > 0 and "3/3 prompts packed == solo" in err
    # the comparison asked, apart from its outcome: the CPU engine is batch-invariant, so bit for bit
    assert all(r["compare"] == "bitwise" and r["logits_match"] and "bitwise" not in r for r in rows)
    assert cli.main(["verify", "--file", str(path), "--max-tokens", "4", "--no-bitwise"]) == 0
    assert {json.loads(line)["compare"] for line in capsys.readouterr().out.splitlines()} == {"within rounding"}


class NudgedPacks:
    """An engine whose packed logits differ from solo by 1e-5, within fp32's rounding tolerance
    (1e-4) but not bitwise: the greedy tokens stay the same."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.model = engine, engine.model

    def generate_with_logits(self, prompts: list[Any], samplings: list[Any], adapters: list[Any]) -> list[Any]:
        out = self.engine.generate_with_logits(prompts, samplings, adapters)
        return out if len(prompts) == 1 else [(completion, logits + 1e-5) for completion, logits in out]


def test_a_verify_row_names_the_comparison_apart_from_its_outcome(tiny_engine: Engine) -> None:
    """A row's mode (`compare`) is never read as a result: asked bitwise, logits that differ by
    rounding fail `logits_match` and `ok`; asked within rounding, the same logits pass."""
    nudged = NudgedPacks(tiny_engine)
    prompts = ["The capital of France is", "Once upon a time"]
    exact = verify(nudged, prompts, [None, None], 3, bitwise=True)
    loose = verify(nudged, prompts, [None, None], 3, bitwise=False)
    assert [(r["compare"], r["tokens_match"], r["logits_match"], r["ok"]) for r in exact] == [
        ("bitwise", True, False, False)] * 2
    assert [(r["compare"], r["tokens_match"], r["logits_match"], r["ok"]) for r in loose] == [
        ("within rounding", True, True, True)] * 2
    assert all("bitwise" not in r for r in exact + loose)


def test_build_kernel_builds_or_says_why(capsys, monkeypatch) -> None:
    """`kev build-kernel` reports the built kernel (0), or the build's reason (1)."""
    assert cli.main(["build-kernel"]) == 0
    err = capsys.readouterr().err
    assert "Kev's CPU kernels are built (kev_exact_" in err and "kev_fast_" in err and "bfloat16:" in err
    monkeypatch.setattr(kernels, "_kernels", None)
    monkeypatch.setattr(kernels, "_failure", "Kev's CPU kernels could not be built (no g++)")
    assert cli.main(["build-kernel"]) == 1
    assert "kev: error: Kev's CPU kernels could not be built (no g++)" in capsys.readouterr().err


def test_the_engines_own_command_line_points_serve_to_the_installed_kev(capsys) -> None:
    assert cli.main(["serve", "--port", "0"]) == 2  # python -m kev_engine serve
    assert "run the installed `kev serve`" in capsys.readouterr().err


def test_speculative_reaches_the_engine_and_a_bad_one_is_refused(loads, capsys) -> None:
    assert cli.main(["generate", "Hi", "--max-tokens", "2", "--speculative", "off"]) == 0
    assert loads[-1][1]["speculative"] == "off"
    assert cli.main(["generate", "Hi", "--speculative", "eagle"]) == 2
    assert "invalid choice: 'eagle'" in capsys.readouterr().err


def test_a_draft_model_reaches_the_engine(loads) -> None:
    assert cli.main(["generate", "Hi", "--max-tokens", "2", "--speculative", "model", "--draft-model", "small"]) == 0
    assert (loads[-1][1]["speculative"], loads[-1][1]["draft_model"]) == ("model", "small")
