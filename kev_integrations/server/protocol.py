"""OpenAI request bodies → what the engine runs: prompts, one `SamplingParams`, an adapter.

Every field is read on purpose. Fields Kev implements map to sampling settings — OpenAI's
(``n``, ``logprobs``/``top_logprobs``, the penalties, ``logit_bias``...) and vLLM's extras
(``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``top_k``);
fields it does not implement are refused by name with a 400 unless they hold their no-op value
(``best_of=1``, ``echo=false``): a client must never believe a setting took effect when it did
not. Unknown fields are refused the same way.

The two endpoints spell logprobs differently: chat takes ``logprobs: bool`` and
``top_logprobs: 0..20``; completions takes ``logprobs: int`` (the number of alternatives, 0 =
the chosen token's only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kev_engine import InvalidRequestError, SamplingParams
from kev_engine.params import MAX_TOP_LOGPROBS, SETTING_FIELDS

from ..tool_format import tool_call_constraint
from .chat_prompt import chat_prompt
from .config import ServerConfig
from .errors import bad_request, engine_error

# fields accepted only at the value that means "off"
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}
IDENTITY_FIELDS = {"user", "metadata", "store", "service_tier"}  # bookkeeping only, no effect on the answer
# body fields that are SamplingParams fields of the same name and meaning; OpenAI names and shapes
# the other three itself (max_completion_tokens, completions' `logprobs: k`)
SAMPLING_FIELDS = set(SETTING_FIELDS) - {"max_tokens", "logprobs", "top_logprobs"}
COMMON_FIELDS = ({"model", "stream", "stream_options", "adapter", "response_format", "max_tokens",
                  "max_completion_tokens", "logprobs"} | SAMPLING_FIELDS)
CHAT_FIELDS = (COMMON_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs"}
               | set(NO_OP_VALUES) | IDENTITY_FIELDS)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"} | set(NO_OP_VALUES) | IDENTITY_FIELDS


@dataclass
class EngineCall:
    """One HTTP request as engine work: `prompts` share `sampling` and `adapter`."""

    prompts: list[Any]
    sampling: SamplingParams
    adapter: str | None
    model: str
    stream: bool = False
    include_usage: bool = False
    tool_names: list[str] = field(default_factory=list)
    endpoint: str = ""
    fields: dict[str, str] = field(default_factory=dict)
    """The body field each engine argument came from, for errors' `param` (`errors.engine_error`)."""


def _check_fields(body: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unsupported field(s) {unknown}; Kev accepts {sorted(allowed)}", param=unknown[0])
    for name, values in NO_OP_VALUES.items():
        if name in body and body[name] not in values:
            raise bad_request(
                f"{name}={body[name]!r} is not supported by Kev; leave it out (or use {values[-1]!r})", param=name
            )


def _model_and_adapter(body: Mapping[str, Any], base_model: str, adapters: list[str]) -> tuple[str, str | None]:
    """`model` names the base model or an adapter (vLLM's convention); `adapter` may name one too."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(f"model={model!r} is required; use one of {[base_model, *adapters]}", param="model")
    adapter = body.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or adapter not in adapters):
        raise bad_request(f"adapter={adapter!r} is not loaded; loaded adapters: {adapters}", param="adapter")
    if model in adapters:
        if adapter is not None and adapter != model:
            raise bad_request(f"model={model!r} and adapter={adapter!r} name different adapters", param="adapter")
        return model, model
    if model != base_model:
        raise bad_request(f"model={model!r} is not served here; use one of {[base_model, *adapters]}", param="model")
    return model, adapter


def _constraint(response_format: Any) -> dict[str, Any]:
    """OpenAI's `response_format` → the engine's constraint fields."""
    if response_format is None:
        return {}
    if not isinstance(response_format, Mapping) or "type" not in response_format:
        raise bad_request(f"response_format={response_format!r} is not allowed; use {{'type': ...}}",
                          param="response_format")
    kind = response_format["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise bad_request("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                              param="response_format")
        return {"json_schema": dict(spec["schema"])}
    if kind == "structural_tag":  # vLLM's extension: the whole object is xgrammar's structural tag
        return {"structural_tag": dict(response_format)}
    if kind in ("regex", "choice", "grammar"):  # Kev's extensions: {"type": "regex", "regex": "..."}
        return {kind: response_format.get(kind)}
    raise bad_request(
        f"response_format type {kind!r} is not supported; use text, json_object, json_schema, regex, choice, "
        "grammar or structural_tag", param="response_format",
    )


def _chat_logprobs(body: Mapping[str, Any]) -> dict[str, Any]:
    """Chat's ``logprobs: bool`` and ``top_logprobs: int`` → the engine's settings of those names."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request(f"logprobs={logprobs!r} is not allowed; use true or false", param="logprobs")
    if top is not None and not logprobs:
        raise bad_request(f"top_logprobs={top!r} needs logprobs=true", param="top_logprobs")
    return {"logprobs": logprobs, "top_logprobs": top}


def _completion_logprobs(body: Mapping[str, Any]) -> dict[str, Any]:
    """Completions' ``logprobs: int`` (alternatives per token, 0 = the chosen token's only)."""
    logprobs = body.get("logprobs")
    if logprobs is None:
        return {}
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs={logprobs!r} is not allowed; on /v1/completions use an integer in "
                          f"[0, {MAX_TOP_LOGPROBS}] (alternatives per token)", param="logprobs")
    return {"logprobs": True, "top_logprobs": logprobs}


def _sampling(body: Mapping[str, Any], config: ServerConfig, extra: Mapping[str, Any],
              fields: Mapping[str, str] | None = None) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    values = {key: body.get(key) for key in SAMPLING_FIELDS}
    values["max_tokens"] = max_tokens
    values.update(extra)
    try:
        sampling = SamplingParams.from_dict(values)
    except InvalidRequestError as exc:
        message = str(exc)
        # the engine's messages open with the setting they refuse: "min_p=1.5 ...", "logit_bias[5]=..."
        exc.param = exc.param or next((key for key in values if message.startswith((f"{key}=", f"{key}[", f"{key} "))),
                                      next((key for key in values if f"{key}=" in message), None))
        raise engine_error(exc, None, fields) from None  # the client's field and words, as for the engine's refusals
    if sampling.max_tokens > config.max_tokens_limit:  # also when left out: the default may exceed the limit
        raise bad_request(f"max_tokens={sampling.max_tokens} is over this server's limit of "
                          f"{config.max_tokens_limit}", param="max_tokens")
    return sampling


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request(f"stream={stream!r} is not allowed; use true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad_request(f"stream_options={options!r} is not allowed; use {{'include_usage': true}}",
                          param="stream_options")
    return stream, bool(options.get("include_usage", False))


def parse_chat(body: Mapping[str, Any], config: ServerConfig, base_model: str, adapters: list[str],
               tokenizer: Any) -> EngineCall:
    """A /v1/chat/completions body → one chat prompt (tools rendered or described) and its settings."""
    _check_fields(body, CHAT_FIELDS)
    model, adapter = _model_and_adapter(body, base_model, adapters)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {'role', 'content'} objects", param="messages")
    tools = body.get("tools") or []
    tool_choice = body.get("tool_choice")
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {'type': 'function', 'function': {...}}", param="tools")
    if tool_choice is not None and not tools:
        raise bad_request("tool_choice was given without tools", param="tool_choice")
    extra = _constraint(body.get("response_format"))
    fields = {"prompt": "messages", **{kind: "response_format" for kind in extra}}
    if tools and extra:
        raise bad_request("give tools or response_format, not both", param="response_format")
    try:  # an unknown tool_choice name is refused by both, naming the bound tools
        prompt, names = chat_prompt(messages, tools, tool_choice, tokenizer)
        if names:
            fields["structural_tag"] = "tools"
            extra = {"structural_tag": tool_call_constraint(
                tools, tool_choice, tokenizer, parallel=body.get("parallel_tool_calls") is True,  # opt-in: see ChatKev
            )}
    except ValueError as exc:  # (APIError is not a ValueError: chat_prompt's own 400s pass through)
        raise bad_request(str(exc), param="tool_choice") from None
    except (AttributeError, TypeError, KeyError) as exc:  # a field of the wrong JSON type somewhere inside
        raise bad_request(f"messages, tools or tool_choice have an unexpected shape ({type(exc).__name__}: {exc}); "
                          "see the OpenAI chat completions format", param="messages") from None
    stream, include_usage = _stream_options(body)
    extra = {**extra, **_chat_logprobs(body)}
    return EngineCall([prompt], _sampling(body, config, extra, fields), adapter, model, stream, include_usage,
                      names if tool_choice != "none" else [], fields=fields)


def parse_completion(body: Mapping[str, Any], config: ServerConfig, base_model: str,
                     adapters: list[str]) -> EngineCall:
    """A /v1/completions body → its prompt(s) as raw text: a list is one pack."""
    _check_fields(body, COMPLETION_FIELDS)
    model, adapter = _model_and_adapter(body, base_model, adapters)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise bad_request("prompt must be a string or a non-empty list of strings (token-id prompts are not "
                          "supported)", param="prompt")
    if len(prompts) > config.max_prompts:
        raise bad_request(f"{len(prompts)} prompts in one request; this server takes at most {config.max_prompts}",
                          param="prompt")
    stream, include_usage = _stream_options(body)
    constraint = _constraint(body.get("response_format"))
    fields = {kind: "response_format" for kind in constraint}
    sampling = _sampling(body, config, {**constraint, **_completion_logprobs(body)}, fields)
    return EngineCall(prompts, sampling, adapter, model, stream, include_usage, fields=fields)
