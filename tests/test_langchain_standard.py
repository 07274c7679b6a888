"""LangChain's standard suites for `ChatKev`: unit tests, and integration tests on the embedded
SmolLM2-135M-Instruct.

Tool calling, tool_choice, structured output and JSON mode are on in both suites: the engine
constrains every reply to the tool-call format or the schema, so even the 135M model's replies
parse. What the model picks (values, a joke that ends) is still its own; a test failing for
that reason alone is marked xfail below with what the model did. Images, audio and PDFs are
not supported (text models only), so the suite skips those tests by its own flags."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from kev_integrations.langchain import ChatKev

pytestmark = pytest.mark.asyncio  # the suites' async tests (pytest-asyncio strict mode)


class ModelCapability(Exception):
    """A standard test failed the way its xfail reason says the small model fails it."""


OPTIONAL_PARAM = ("model capability: asked for a joke's setup with no punchline, SmolLM2-135M may loop inside the "
                  "setup string ('The cat was a cat, and it was a cat, ...') until max_tokens, so the reply is cut")
JSON_MODE = ("model capability: json_mode allows any JSON object (as OpenAI's does); asked for 'setup' and "
             "'punchline' keys, SmolLM2-135M may close the object after 'setup', or loop inside the setup string "
             "('The cat was a cat, and the cat was a cat, ...', seen in bf16 on an AMX Xeon) until max_tokens, so "
             "the reply is cut (the json_schema method, which enforces the keys, passes the joke tests)")
AGENT_LOOP = ("model capability: with tool_choice='auto' (the test binds no choice) SmolLM2-135M may answer 'What is "
              "the weather in San Francisco, CA?' in prose instead of calling get_weather; forced choices ('any', a "
              "name) pass test_tool_calling/test_tool_choice")


class KevFlags:
    """What ChatKev supports: text chat, tools and structured output through the chat template."""

    @property
    def chat_model_class(self) -> type[ChatKev]:
        return ChatKev

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine per model: switch models by building another ChatKev

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True  # "any"/"required"/a name force a call by constrained decoding

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True  # the reply is constrained to a JSON object

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": [], "stream": []}  # no cache/reasoning/audio token breakdowns

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # Kev refuses unknown constructor arguments (a dropped `num_predict` would silently run
        # 256 tokens); max_retries is refused without base_url (in-process nothing can be retried),
        # and the suite's api_key/base_url would point this in-process model at a made-up server.
        params = super().standard_chat_model_params  # type: ignore[misc]
        for name in ("max_retries", "api_key", "base_url"):
            params.pop(name, None)
        return params


class TestChatKevUnit(KevFlags, ChatModelUnitTests):
    pass


class TestChatKevIntegration(KevFlags, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"max_tokens": 64}  # room for a constrained JSON joke; still quick on a CPU

    # What the 135M model says on these three decides only between pass and xfail: its greedy
    # tokens move with the CPU's vector width and dtype, so the same test may pass on one machine
    # and not on another. Each xfails only on its documented sign (`model_capability` turns that
    # one failure into a ModelCapability, the only exception the non-strict xfail accepts);
    # anything else fails.
    @pytest.mark.xfail(reason=OPTIONAL_PARAM, raises=ModelCapability, strict=False)
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        with model_capability(OPTIONAL_PARAM, lambda exc: "finish_reason='length'" in str(exc)):
            super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(reason=JSON_MODE, raises=ModelCapability, strict=False)
    def test_json_mode(self, model: BaseChatModel) -> None:
        with model_capability(JSON_MODE, lambda exc: _missing_punchline(exc) or "finish_reason='length'" in str(exc)):
            super().test_json_mode(model)

    @pytest.mark.xfail(reason=AGENT_LOOP, raises=ModelCapability, strict=False)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        with model_capability(AGENT_LOOP, lambda exc: isinstance(exc, AssertionError) and "tool_call" in
                              _failing_line(exc)):
            super().test_agent_loop(model)


@contextlib.contextmanager
def model_capability(reason: str, sign: Callable[[BaseException], bool]) -> Iterator[None]:
    """Raise ModelCapability when the test fails the way `reason` describes (`sign` of its
    exception), else let it pass or fail: a plumbing error never hides behind what the model chose
    to say."""
    try:
        yield
    except Exception as exc:
        if not sign(exc):
            raise
        raise ModelCapability(f"model capability: {reason}") from exc


def _failing_line(exc: BaseException) -> str:
    """The source line that raised (an assert's own text, which pytest's message may not repeat)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return (frames[-1].line or "") if frames else ""


def _missing_punchline(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, AssertionError) and "punchline" in text or (
        "Field required" in text and "punchline" in text)


def test_a_capability_xfail_never_hides_another_failure() -> None:
    """The control: only the documented sign xfails; any other exception still fails the test."""
    with pytest.raises(TypeError):
        with model_capability("cut replies", lambda exc: "finish_reason='length'" in str(exc)):
            raise TypeError("ChatKev.invoke() got an unexpected keyword argument")
    with pytest.raises(ModelCapability, match="model capability: cut replies"):
        with model_capability("cut replies", lambda exc: "finish_reason='length'" in str(exc)):
            raise ValueError("the reply was cut by max_tokens (finish_reason='length')")
