"""`kev serve`'s /metrics on loopback with a tiny random-weight model: the exposition text is
well formed (each family declared, counters named `_total`, prometheus_client's parser reads it),
the engine's question counter counts what it took, a Ray fleet's snapshots add up, and every
metric the README names under /metrics is there."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import tiny_model
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from server_util import serving

from kev_engine import Engine, Histogram
from kev_integrations.server import ServerConfig, build_app
from kev_integrations.server.metrics import Metrics, fleet_stats

MODEL = "tiny"
README = Path(__file__).resolve().parent.parent / "README.md"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_NAME = re.compile(r"`(kev_[a-z0-9_]+)`")


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name=MODEL)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with serving(build_app(engine, ServerConfig(max_tokens_limit=16), model_name=MODEL)) as base:
        yield base


def scrape(url: str) -> str:
    response = httpx.get(url + "/metrics", timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return response.text


def families(text: str) -> dict[str, str]:
    """Each metric family's declared type, checking the text as Prometheus reads it: every sample
    after its family's HELP and TYPE lines (a histogram's series named by its suffixes)."""
    declared: dict[str, str] = {}
    helped: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name not in declared, f"{name} is declared twice"
            declared[name] = kind
        elif line:
            name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)  # type: ignore[union-attr]
            base = next((name.removesuffix(s) for s in HISTOGRAM_SUFFIXES
                         if declared.get(name.removesuffix(s)) == "histogram"), name)
            assert base in declared and base in helped, f"{line!r} comes before its family's HELP and TYPE"
            float(line.rsplit(" ", 1)[1])  # the value is a number (+Inf included)
    return declared


def value(text: str, name: str) -> float:
    """The value of an unlabelled sample `name`."""
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found is not None, f"{name} is not in /metrics"
    return float(found.group(1))


def readme_metric_names() -> set[str]:
    """The `kev_*` names in the README's paragraphs that speak of /metrics."""
    paragraphs = README.read_text(encoding="utf-8").split("\n\n")
    return {name for p in paragraphs if "/metrics" in p for name in METRIC_NAME.findall(p)}


def test_the_text_is_well_formed_and_counters_are_named_total(url: str) -> None:
    declared = families(scrape(url))
    counters = [name for name, kind in declared.items() if kind == "counter"]
    assert "kev_requests_total" in counters and "kev_http_requests_total" in counters
    assert all(name.endswith("_total") for name in counters), counters
    parsed = {family.name: family.type for family in text_string_to_metric_families(scrape(url))}
    assert parsed["kev_requests"] == "counter" and parsed["kev_pass_duration_seconds"] == "histogram"
    assert len(parsed) == len(declared)


def test_kev_requests_total_counts_the_questions_the_engine_took(url: str, engine: Engine) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    before = value(scrape(url), "kev_requests_total")
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, n=2)
    client.completions.create(model=MODEL, prompt=["Once upon a time", "The capital of France is"], max_tokens=2)
    with pytest.raises(openai.BadRequestError):  # refused before the engine: not a question it took
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    after = scrape(url)
    # a chat of two samples is one question, a list of two prompts two
    assert value(after, "kev_requests_total") - before == 3
    assert value(after, "kev_requests_total") == engine.stats()["requests"]
    assert "# TYPE kev_requests_total counter" in after


def test_every_metric_the_readme_names_under_metrics_is_there(url: str) -> None:
    names = readme_metric_names()
    assert names, "the README names no metric beside /metrics: the scan found nothing"
    missing = sorted(names - set(families(scrape(url))))
    assert not missing, f"the README names {missing} as /metrics' but the server has no such metric"


def test_a_fleets_snapshots_add_up_and_describe_it_by_its_first_engine(engine: Engine) -> None:
    one = engine.stats()
    waits = Histogram()
    waits.observe(0.02)
    waits.observe(3.0)
    other = dict(one, requests=one["requests"] + 3, paused_seconds=one["paused_seconds"] + 0.25, running=2,
                 dtype="float16", queue_seconds=waits.snapshot())
    served = [Metrics(), Metrics()]
    served[0].observe("/v1/completions", 200, 0.3)
    served[1].observe("/v1/completions", 200, 0.7)
    served[1].observe("/v1/completions", 400)
    text = Metrics.merged([m.snapshot() for m in served]).render(fleet_stats([one, other])).decode()
    families(text)
    assert value(text, "kev_requests_total") == 2 * one["requests"] + 3
    assert value(text, "kev_pass_paused_seconds_total") == pytest.approx(2 * one["paused_seconds"] + 0.25)
    assert value(text, "kev_running_requests") == one["running"] + 2
    assert value(text, "kev_queue_delay_seconds_count") == one["queue_seconds"]["count"] + 2
    assert f'kev_engine_info{{batch_invariant="{str(one["batch_invariant"]).lower()}",dtype="{one["dtype"]}"}} 1.0' \
        in text  # the first engine's, not the other's float16
    assert 'kev_http_requests_total{endpoint="/v1/completions",status="200"} 2.0' in text
    assert 'kev_http_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert value(text, "kev_request_latency_seconds_count") == 2
