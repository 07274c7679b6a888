"""Third-party clients built on the OpenAI SDK against `kev serve` on the embedded model.

instructor extracts a pydantic model in its two OpenAI modes, each through a different server
feature: TOOLS forces a call of one tool (``tools`` + ``tool_choice`` naming it) and parses the
call's arguments; JSON_SCHEMA sends ``response_format: {"type": "json_schema"}`` and parses the
message content. With ``max_retries=0`` instructor makes one request and raises on a reply it
cannot validate, so a reply the server shapes wrongly fails here instead of being retried away.
The prompt states the facts: the small model only has to copy them, the constraint does the rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import instructor
import openai
import pytest
from pydantic import BaseModel
from server_util import serving

from kev_engine import Engine
from kev_integrations.server import ServerConfig, build_app

KEY = "k"
MODEL = "smollm2"
MESSAGES = [{"role": "user", "content": "Paris is a city in France. Extract the city and its country."}]


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def url(embedded_engine: Engine) -> Iterator[str]:
    with serving(build_app(embedded_engine, ServerConfig(api_keys=(KEY,)), model_name=MODEL)) as base:
        yield base


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA], ids=lambda m: m.name)
def test_instructor_extracts_a_pydantic_model(url: str, mode: instructor.Mode) -> None:
    client = instructor.from_openai(openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120),
                                    mode=mode)
    city, completion = client.chat.completions.create_with_completion(
        model=MODEL, messages=MESSAGES, response_model=City, max_retries=0, max_tokens=64, temperature=0)
    assert isinstance(city, City) and city.name.strip() and city.country.strip()
    choice = completion.choices[0]
    if mode is instructor.Mode.TOOLS:  # the forced call, and nothing else, carries the model
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [call.function.name for call in choice.message.tool_calls] == ["City"]
        assert json.loads(choice.message.tool_calls[0].function.arguments) == city.model_dump()
    else:  # the content is the schema's JSON, ended by the grammar, not cut by max_tokens
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert json.loads(choice.message.content) == city.model_dump()
