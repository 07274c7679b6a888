"""`make gpu-check`'s report, on CPU: its layout, its reading of the marked tests, its refusal without a GPU.

The report's CUDA parts are stubbed by marker, not faked: `gpu_check` runs `pytest -m cuda` on a
stand-in file of `cuda`-marked cases (one passes, one fails, one is named like the bitwise tests,
one unmarked case that must not run), and its benchmark runs for real on a tiny random model on
the CPU — so the report names the CPU as its device and has no GPU memory figure at all.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_check  # noqa: E402

STAND_IN = textwrap.dedent('''
    import pytest

    @pytest.mark.cuda
    def test_packed_equals_alone_stand_in():
        assert [1, 2] == [1, 2]

    @pytest.mark.cuda
    def test_a_failure_is_reported():
        assert 1 == 2, "the message the report keeps"

    def test_unmarked_never_runs():
        raise AssertionError("selected without the marker")
''')


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer) -> Path:
    """A tiny random model with a context long enough for DOC-QA's 1,400-token prompts."""
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", tokenizer, max_position_embeddings=4096).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_report_on_cpu(tmp_path, tiny_folder) -> None:
    stand_in = tmp_path / "test_stand_in.py"
    stand_in.write_text(STAND_IN)
    out = tmp_path / "report.json"
    code = gpu_check.main(["--device", "cpu", "--tests", str(stand_in), "--model", str(tiny_folder),
                           "--max-tokens", "3", "--limit", "2", "--dtype", "float32", "--out", str(out)])
    report = json.loads(out.read_text())
    gpu_check.check(report)
    assert code == 1 and report["ok"] is False  # a marked case failed
    tests = report["tests"]
    assert (tests["passed"], tests["failed"], tests["error"], tests["skipped"]) == (1, 1, 0, 0)
    failed = next(case for case in tests["cases"] if case["outcome"] == "failed")
    assert failed["name"].endswith("test_a_failure_is_reported") and "the message the report keeps" in failed["message"]
    assert not any("unmarked" in case["name"] for case in tests["cases"])
    environment = report["environment"]
    assert environment["device"] == "cpu" and environment["gpu"] is None and environment["torch"] == torch.__version__
    bench = report["benchmark"]
    assert set(bench["workloads"]) == {"rag16", "doc_qa", "rag64"} and bench["device"] == "cpu"
    for workload in bench["workloads"].values():
        assert workload["questions"] == 2
        for row in workload["systems"].values():
            assert row["peak_device_mib"] is None and row["wall_s"] > 0
            assert row["tokens_per_s"] == row["generated_tokens"] / row["wall_s"]
        # greedy on the same ids: transformers one at a time equals itself, and Kev equals it
        assert workload["systems"]["hf_serial"]["answers_equal_to_hf_serial"] == 2
        assert workload["systems"]["kev"]["answers_equal_to_hf_serial"] == 2
    targets = report["targets"]
    assert targets["packed_equals_alone_tests"] == [next(c["name"] for c in tests["cases"] if "packed" in c["name"])]
    assert targets["packed_equals_alone_bitwise"] is True
    assert targets["rag16_kev_speedup_vs_hf_serial"] == bench["workloads"]["rag16"]["kev_speedup_vs_hf_serial"]


def test_check_rejects_a_gpu_figure_on_a_cpu_report() -> None:
    row = {"wall_s": 1.0, "generated_tokens": 3, "tokens_per_s": 3.0, "peak_device_mib": 512.0,
           "answers_equal_to_hf_serial": 1}
    report = {"format": 1, "environment": {"device": "cpu"}, "tests": {}, "targets": {}, "ok": False,
              "duration_s": 1.0, "benchmark": {"workloads": {"rag16": {"systems": dict.fromkeys(
                  ("kev", "hf_serial", "hf_padded"), row)}}}}
    with pytest.raises(ValueError, match="rag16/kev: a peak GPU memory figure exactly when the device is a GPU"):
        gpu_check.check(report)
    del report["targets"]
    with pytest.raises(ValueError, match="the report has no 'targets'"):
        gpu_check.check(report)


def test_refuses_without_a_gpu(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    assert "gpu-check needs a CUDA GPU" in capsys.readouterr().err and not out.exists()
