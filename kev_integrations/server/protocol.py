"""OpenAI request bodies → what the engine runs: prompts, one `SamplingParams`, an adapter.

Every field is read on purpose. Fields Kev implements map to sampling settings — OpenAI's
(``n``, ``logprobs``/``top_logprobs``, the penalties, ``logit_bias``...) and vLLM's extras
(``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``top_k``);
every field that constrains the reply (``response_format``, vLLM's ``guided_*`` and
``structured_outputs``) becomes one engine constraint in `constraints`. Fields it does not
implement are refused by name with a 400 unless they hold their no-op value (``best_of=1``,
``suffix=""``, chat's ``echo=false``): a client must never believe a setting took effect when it
did not. Unknown fields are refused the same way.

The two endpoints spell logprobs differently: chat takes ``logprobs: bool`` and
``top_logprobs: 0..20``; completions takes ``logprobs: int`` (the number of alternatives, 0 =
the chosen token's only). Completions also take token-id prompts (`token_prompts`) and
``echo`` (`echo`), with ``max_tokens: 0`` allowed there: only the prompt, and its logprobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kev_engine import MAX_TOP_LOGPROBS, SETTING_FIELDS, InvalidRequestError, SamplingParams

from ..tool_budget import check_forced_call_budget
from ..tool_format import tool_call_constraint, tool_choice_name
from .chat_prompt import chat_prompt
from .config import ServerConfig
from .constraints import CONSTRAINT_FIELDS, reply_constraint
from .errors import bad_request, engine_error, model_not_found
from .token_prompts import prompt_list

# fields accepted only at the value that means "off"
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}
CHAT_NO_OP_VALUES = {**NO_OP_VALUES, "echo": (None, False)}  # vLLM's chat echo (of the last message): not here
IDENTITY_FIELDS = {"user", "metadata", "store", "service_tier"}  # bookkeeping only, no effect on the answer
# body fields that are SamplingParams fields of the same name and meaning; OpenAI names and shapes
# the other three itself (max_completion_tokens, completions' `logprobs: k`)
SAMPLING_FIELDS = set(SETTING_FIELDS) - {"max_tokens", "logprobs", "top_logprobs"}
COMMON_FIELDS = ({"model", "stream", "stream_options", "adapter", "max_tokens", "max_completion_tokens",
                  "logprobs"} | CONSTRAINT_FIELDS | SAMPLING_FIELDS | IDENTITY_FIELDS)
CHAT_FIELDS = (COMMON_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs"}
               | set(CHAT_NO_OP_VALUES))
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"} | set(NO_OP_VALUES)


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
    forced_tool: str | None = None
    """The tool `tool_choice` names: a reply that max_tokens cut before its call was whole is a 400."""
    endpoint: str = ""
    fields: dict[str, str] = field(default_factory=dict)
    """The body field each engine argument came from, for errors' `param` (`errors.engine_error`)."""
    continuous_usage: bool = False
    """Every streamed chunk carries its choice's usage so far (vLLM's ``continuous_usage_stats``)."""
    show_logprobs: bool = True
    """False when the engine computes logprobs only to count streamed tokens (continuous usage)."""
    echo: bool = False
    """Completions: each choice's text (and logprobs) start with its prompt's."""
    prompt_logprobs: int | None = None
    """With echo and logprobs: alternatives per prompt token (the prompt's logprobs are computed)."""
    generate: bool = True
    """False for ``max_tokens: 0`` with echo: nothing is generated, `sampling.max_tokens` is unused."""


def _check_fields(body: Mapping[str, Any], allowed: set[str], no_ops: Mapping[str, tuple[Any, ...]]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unsupported field(s) {unknown}; Kev accepts {sorted(allowed)}", param=unknown[0])
    for name, values in no_ops.items():
        if name in body and body[name] not in values:
            raise bad_request(
                f"{name}={body[name]!r} is not supported by Kev; leave it out (or use {values[-1]!r})", param=name
            )


def _model_and_adapter(body: Mapping[str, Any], base_model: str, adapters: list[str]) -> tuple[str, str | None]:
    """`model` names the base model or an adapter (vLLM's convention); `adapter` may name one too.
    A `model` served by neither is a 404 (`model_not_found`), as on /v1/models/{id}."""
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
        raise model_not_found(model, [base_model, *adapters])
    return model, adapter


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


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats); the usage options only take effect on a stream."""
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request(f"stream={stream!r} is not allowed; use true or false", param="stream")
    options = body.get("stream_options") or {}
    allowed = ("include_usage", "continuous_usage_stats")
    if not isinstance(options, Mapping) or set(options) - set(allowed):
        raise bad_request(f"stream_options={options!r} is not allowed; use {{'include_usage': true}} and/or "
                          "{'continuous_usage_stats': true}", param="stream_options")
    for name in allowed:
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise bad_request(f"stream_options.{name}={options[name]!r} is not allowed; use true or false",
                              param=f"stream_options.{name}")
    return stream, stream and bool(options.get("include_usage")), stream and bool(options.get("continuous_usage_stats"))


def _counted(logprobs: dict[str, Any], continuous: bool) -> tuple[dict[str, Any], bool]:
    """The logprobs settings, switched on where continuous usage counts streamed tokens by them
    (the engine reports no count per piece); and whether the client sees them."""
    if not continuous or logprobs.get("logprobs"):
        return logprobs, True
    return {**logprobs, "logprobs": True}, False


def parse_chat(body: Mapping[str, Any], config: ServerConfig, base_model: str, adapters: list[str],
               tokenizer: Any) -> EngineCall:
    """A /v1/chat/completions body → one chat prompt (tools rendered or described) and its settings."""
    _check_fields(body, CHAT_FIELDS, CHAT_NO_OP_VALUES)
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
    extra, source = reply_constraint(body)
    fields = {"prompt": "messages", **{kind: source for kind in extra if source}}
    if tools and source:  # tools constrain the reply to their calls: a second constraint would fight them
        raise bad_request(f"give tools or {source}, not both: both constrain the reply", param=source)
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
    stream, include_usage, continuous = _stream_options(body)
    logprobs, shown = _counted(_chat_logprobs(body), continuous)
    sampling = _sampling(body, config, {**extra, **logprobs}, fields)
    if names:
        _check_tool_budget(body, sampling.max_tokens, tools, tool_choice, tokenizer)
    return EngineCall([prompt], sampling, adapter, model, stream,
                      include_usage, names if tool_choice != "none" else [], fields=fields,
                      continuous_usage=continuous, show_logprobs=shown,
                      forced_tool=tool_choice_name(tool_choice, tools) if names else None)


def _check_tool_budget(body: Mapping[str, Any], max_tokens: int, tools: list[Any], tool_choice: Any,
                       tokenizer: Any) -> None:
    """A 400 naming the budget's field when it cannot hold the call `tool_choice` forces (`tool_budget`)."""
    try:
        check_forced_call_budget(max_tokens, tools, tool_choice, tokenizer,
                                 lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    except InvalidRequestError as exc:
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        raise bad_request(str(exc), param=field) from None


def parse_completion(body: Mapping[str, Any], config: ServerConfig, base_model: str,
                     adapters: list[str]) -> EngineCall:
    """A /v1/completions body → its prompts (text, or token ids that `token_prompts` turns into
    text once the tokenizer is at hand): a list is one pack."""
    _check_fields(body, COMPLETION_FIELDS, NO_OP_VALUES)
    model, adapter = _model_and_adapter(body, base_model, adapters)
    prompts = prompt_list(body.get("prompt"))
    if len(prompts) > config.max_prompts:
        raise bad_request(f"{len(prompts)} prompts in one request; this server takes at most {config.max_prompts}",
                          param="prompt")
    stream, include_usage, continuous = _stream_options(body)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise bad_request(f"echo={echo!r} is not allowed; use true or false", param="echo")
    if echo and stream:
        raise bad_request("echo=true is not supported with stream=true; ask without streaming (the reply then "
                          "starts with the prompt)", param="echo")
    asked = body.get("max_completion_tokens")
    asked = body.get("max_tokens") if asked is None else asked
    nothing = isinstance(asked, int) and not isinstance(asked, bool) and asked == 0
    if nothing and not echo:
        raise bad_request("max_tokens=0 asks for no tokens, which only echo=true answers (with the prompt, and "
                          "with logprobs its logprobs); use max_tokens >= 1 or echo=true", param="max_tokens")
    constraint, source = reply_constraint(body)
    fields = {kind: source for kind in constraint if source}
    logprobs, shown = _counted(_completion_logprobs(body), continuous)
    placeholder = {"max_tokens": 1} if nothing else {}  # checks the other settings; nothing is generated
    sampling = _sampling(body, config, {**constraint, **logprobs, **placeholder}, fields)
    top = logprobs.get("top_logprobs") if echo and logprobs else None
    return EngineCall(prompts, sampling, adapter, model, stream, include_usage, fields=fields,
                      continuous_usage=continuous, show_logprobs=shown, echo=echo, prompt_logprobs=top,
                      generate=not nothing)
