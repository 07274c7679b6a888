"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Clients (the `openai` package, LangChain's `ChatOpenAI`, LlamaIndex's `OpenAILike`) read that
shape to raise their own typed errors, so every refusal the server makes goes through here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from kev_engine import EngineClosedError, InvalidRequestError, UnknownAdapterError


class APIError(Exception):
    """A request the server refuses; `param` names the offending field when there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str, served: list[str]) -> APIError:
    """A `model` this server does not serve: 404 ``model_not_found``, as OpenAI and vLLM answer
    (the `openai` client raises `NotFoundError`), on /v1/models/{id} and the generating endpoints alike."""
    return APIError(404, f"the model {model[:200]!r} does not exist here; served: {served}", param="model",
                    code="model_not_found")


def engine_error(exc: BaseException, index: int | None, fields: Mapping[str, str] | None = None) -> APIError:
    """A failed engine request as an HTTP error; the prompt's index is named for lists. `fields`:
    the client's name for what the engine's error is about (its `param`: "prompt" was `messages`,
    "json_schema" was `response_format`, "structural_tag" was `tools`)."""
    where = f"prompt {index}: " if index is not None else ""
    if isinstance(exc, InvalidRequestError):
        param = _client_field(exc.param, fields)
        return bad_request(where + _client_message(str(exc), param), param=param)
    if isinstance(exc, UnknownAdapterError):
        return bad_request(where + str(exc), param="model")
    if isinstance(exc, EngineClosedError):
        return APIError(503, where + str(exc), type="server_error")
    return APIError(500, f"{where}{type(exc).__name__}: {exc}", type="server_error")


def _client_field(param: str | None, fields: Mapping[str, str] | None) -> str | None:
    """The field a client sent for the engine's `param` (the same name where not mapped)."""
    return (fields or {}).get(param, param) if param is not None else None


def _client_message(message: str, field: str | None) -> str:
    """The engine's words in the client's terms: a tool-call constraint is the client's tools."""
    if field == "tools":
        return message.replace("the structural_tag constraint", "the tool-call constraint these tools make").replace(
            "structural_tag", "tool-call constraint")
    return message
