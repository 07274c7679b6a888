"""LangChain's standard suites for `ChatKev`: unit tests, and integration tests on the embedded
SmolLM2-135M-Instruct.

The unit suite's flags say what ChatKev implements (tools, structured output, JSON mode through
the chat template). The integration suite's flags say what the model under test can do: the
135M model does not follow the tool-call or JSON formats (measured: every tool-calling and
structured-output standard test fails on its replies), so those flags are off there; the
plumbing is tested with scripted replies in `test_langchain_unit.py`. Images, audio and PDFs
are not supported (text models only), so the suite skips those tests by its own flags."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from kev_integrations.langchain import ChatKev

pytestmark = pytest.mark.asyncio  # the suites' async tests (pytest-asyncio strict mode)


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
        return True  # as an instruction in the prompt, not constrained decoding

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True  # as an instruction in the prompt, not constrained decoding

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": [], "stream": []}  # no cache/reasoning/audio token breakdowns

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # Kev refuses unknown constructor arguments (a dropped `num_predict` would silently run
        # 256 tokens), and a hosted model's client settings mean nothing in-process.
        params = super().standard_chat_model_params  # type: ignore[misc]
        for name in ("max_retries", "api_key", "base_url"):
            params.pop(name, None)
        return params


class TestChatKevUnit(KevFlags, ChatModelUnitTests):
    pass


class TestChatKevIntegration(KevFlags, ChatModelIntegrationTests):
    # the embedded 135M model cannot produce tool calls or schema-following JSON (see the docstring)
    has_tool_calling = False
    has_tool_choice = False
    has_structured_output = False
    supports_json_mode = False

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"max_tokens": 16}  # short answers keep the suite quick on a CPU
