"""LangChain's standard suites for `ChatKev`: unit tests, and integration tests on the embedded
SmolLM2-135M-Instruct.

Tool calling, tool_choice, structured output and JSON mode are on in both suites: the engine
constrains every reply to the tool-call format or the schema, so even the 135M model's replies
parse. What the model picks (values, a joke that ends) is still its own; a test failing for
that reason alone is marked xfail below with what the model did. Images, audio and PDFs are
not supported (text models only), so the suite skips those tests by its own flags."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
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

    # What the 135M model does, greedily, on these three: every reply parses; its content fails.
    @pytest.mark.xfail(reason="model capability: asked for a joke's setup with no punchline, SmolLM2-135M "
                              "loops inside the setup string ('The cat was a cat, and it was a cat, ...') "
                              "until max_tokens, so the reply is cut (finish_reason='length')")
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(reason="model capability: json_mode allows any JSON object (as OpenAI's does); asked "
                              "for 'setup' and 'punchline' keys, SmolLM2-135M closes the object after 'setup' "
                              "(the json_schema method, which enforces the keys, passes the joke tests)")
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(reason="model capability: with tool_choice='auto' (the test binds no choice) SmolLM2-135M "
                              "answers 'What is the weather in San Francisco, CA?' in prose instead of calling "
                              "get_weather; forced choices ('any', a name) pass test_tool_calling/test_tool_choice")
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)
