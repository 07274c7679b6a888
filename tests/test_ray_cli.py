"""`kev serve --ray`: the CLI joins a Ray cluster, serves the OpenAI API from Serve replicas,
and exits 0 on SIGTERM after deleting its application. Runs as a real subprocess (signals and
all) against this session's local Ray; every wait is bounded and the process is always stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import httpx
import pytest
from conftest import save_tiny_model
from server_util import free_port, wait_for

from kev_engine import Engine, SamplingParams


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.ray
def test_kev_serve_ray_serves_and_stops_on_sigterm(ray_cluster: Any, tmp_path: Any, tokenizer: Any) -> None:
    from ray import serve

    model_dir = str(save_tiny_model(tmp_path / "model", tokenizer))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kev_integrations", "serve", "--ray", "--replicas", "1", "--model", model_dir,
               "--port", str(port), "--ray-address", ray_cluster.get_runtime_context().gcs_address]
    process = subprocess.Popen(command, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: process.poll() is not None or _healthy(url), 240, "kev serve --ray to answer /health")
        assert process.poll() is None, process.communicate()[0][-3000:]
        body = {"model": model_dir, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
                "temperature": 0}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        with Engine.from_pretrained(model_dir) as engine:
            expected = engine.generate([body["messages"]], SamplingParams(temperature=0, max_tokens=6))[0].text
        assert reply.json()["choices"][0]["message"]["content"] == expected

        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output[-3000:]
        assert not _healthy(url)  # its application is gone with it ...
        assert "kev" not in serve.status().applications  # ... while Serve stays up on a cluster it joined
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)
        serve.shutdown()  # this session's cluster: the next tests start their own Serve


def test_replicas_without_ray_is_refused() -> None:
    result = subprocess.run([sys.executable, "-m", "kev_integrations", "serve", "--replicas", "2"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "--replicas 2 needs --ray" in result.stderr
