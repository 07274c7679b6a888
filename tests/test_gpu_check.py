"""`make gpu-check`'s report, on CPU: its layout, its reading of the marked tests, its refusal without a GPU.

The report's CUDA parts are stubbed by marker, not faked: `gpu_check` runs `pytest -m cuda` on a
stand-in file of `cuda`-marked cases (one passes, one fails, one is named like the bitwise tests,
one unmarked case that must not run), and its benchmark runs for real on a tiny random model it
builds on the CPU from config and tokenizer files, as it builds its 0.5B model on a GPU — so the
report names the CPU as its device and has no GPU memory figure at all. A benchmark that fails
still leaves a report, with the tests' results and what broke; `make gpu-check` on a machine
without a CUDA GPU stops before installing anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_check  # noqa: E402
import random_models  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

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
def model_files(tmp_path_factory, embedded_dir) -> Path:
    """The embedded model's config and tokenizer files, no weights: what `make gpu-wheels` carries."""
    return random_models.copy_model_files(Path(embedded_dir), tmp_path_factory.mktemp("files"))[0].parent


def stand_in_tests(tmp_path: Path) -> Path:
    stand_in = tmp_path / "test_stand_in.py"
    stand_in.write_text(STAND_IN)
    return stand_in


def test_report_on_cpu(tmp_path, model_files) -> None:
    out = tmp_path / "report.json"
    code = gpu_check.main(["--device", "cpu", "--tests", str(stand_in_tests(tmp_path)), "--model-files",
                           str(model_files), "--shape", "tiny", "--larger-shape", "tiny", "--max-tokens", "3",
                           "--limit", "2", "--dtype", "float32", "--out", str(out)])
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
    assert environment["varlen_attn_form"] == "paged" and environment["why_not_varlen"] is None  # this torch's
    assert report["benchmark_model"]["folder"] == "random tiny" and report["benchmark_error"] is None
    assert 0 < report["benchmark_model"]["parameters"] < 10**7
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
        assert 0 < workload["systems"]["kev"]["prefill_s"]
        assert "kev_varlen" not in workload["systems"]  # torch's varlen_attn beside it: on CUDA only
    targets = report["targets"]
    assert targets["packed_equals_alone_tests"] == [next(c["name"] for c in tests["cases"] if "packed" in c["name"])]
    assert targets["packed_equals_alone_bitwise"] is True
    assert targets["rag16_kev_speedup_vs_hf_serial"] == bench["workloads"]["rag16"]["kev_speedup_vs_hf_serial"]
    assert targets["rag16_kev_s"] == bench["workloads"]["rag16"]["systems"]["kev"]["wall_s"]
    assert targets["decode_step_16_rows_ms"] is None and targets["products_at_least_half_the_rate"] is None  # GPU only
    larger = report["larger_benchmark"]  # Kev alone, the second shape
    assert larger["shape"] == "tiny" and "error" not in larger
    assert {tuple(w["systems"]) for w in larger["benchmark"]["workloads"].values()} == {("kev",)}
    assert larger["benchmark"]["rates"] is None and "floor" not in larger["benchmark"]["workloads"]["rag16"]


def test_a_control_that_finds_no_difference_is_reported_apart_from_packed_equals_alone() -> None:
    """A `[control]` case that failed (it found no difference where it should) is not a bitwise
    test that failed: the bar says packed == alone held, the controls say theirs did not show."""
    cases = [{"name": "t::test_packed_equals_alone[invariant]", "outcome": "passed"},
             {"name": "t::test_packed_equals_alone[control]", "outcome": "failed"},
             {"name": "t::test_other", "outcome": "passed"}]
    found = gpu_check.targets({"cases": cases}, None)
    assert found["packed_equals_alone_bitwise"] is True
    assert found["packed_equals_alone_tests"] == ["t::test_packed_equals_alone[invariant]"]
    assert found["controls_found_a_difference"] is False
    assert found["control_tests"] == ["t::test_packed_equals_alone[control]"]
    cases[0]["outcome"] = "failed"  # control: a bitwise case that fails fails the bar
    assert gpu_check.targets({"cases": cases}, None)["packed_equals_alone_bitwise"] is False
    named = {"t::test_x_equal_alone[reordered-control]": True, "t::test_x_equal_alone[control-llama]": True,
             "t::test_x_equal_alone[invariant]": False, "t::test_uncontrolled_equal_alone": False,
             "t::test_x_equal_alone[controlled-run]": False}
    assert {name: gpu_check.is_control(name) for name in named} == named


def test_a_failed_benchmark_still_leaves_the_report(tmp_path, model_files) -> None:
    """A benchmark that breaks (here: a model shape that does not exist) costs only its own step."""
    out = tmp_path / "report.json"
    code = gpu_check.main(["--device", "cpu", "--tests", str(stand_in_tests(tmp_path)), "--model-files",
                           str(model_files), "--shape", "no-such-shape", "--out", str(out)])
    report = json.loads(out.read_text())
    gpu_check.check(report)
    assert code == 1 and report["ok"] is False and report["benchmark"] is None
    assert "shape='no-such-shape' is not allowed" in report["benchmark_error"]
    assert (report["tests"]["passed"], report["tests"]["failed"]) == (1, 1)


def test_refuses_without_model_files(tmp_path, capsys) -> None:
    assert gpu_check.main(["--device", "cpu", "--model-files", str(tmp_path), "--out", str(tmp_path / "r.json")]) == 2
    assert "run `make gpu-wheels`" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def test_make_gpu_check_stops_at_once_without_a_gpu(tmp_path) -> None:
    """On a machine whose torch sees no CUDA GPU: an error naming it, and no venv made."""
    venv = tmp_path / "venv-gpu"
    done = subprocess.run(["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}", f"GPU_VENV={venv}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "which sees no CUDA GPU (set GPU_PYTHON to a CUDA Python)" in done.stderr
    assert not venv.exists()


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
