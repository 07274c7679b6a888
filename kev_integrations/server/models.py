"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served model and each adapter, as OpenAI's model objects.

A client names an adapter as its `model` (vLLM's convention), so each loaded adapter is a model
here, its `parent` the served model; an id served by neither is a 404 with OpenAI's
``model_not_found`` code, which the `openai` client raises as `NotFoundError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .errors import model_not_found
from .state import ServerState


def model_card(model_id: str, served: str) -> dict[str, Any]:
    """OpenAI's model object of `model_id`, the `served` model or one of its adapters."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "kev", "root": served,
            "parent": None if model_id == served else served}


def add_model_routes(app: FastAPI, state: ServerState,
                     check_key: Callable[[Request, tuple[str, ...], str], object]) -> None:
    def ids(request: Request) -> list[str]:
        check_key(request, state.config.api_keys, "/v1")
        return [state.model_name, *state.adapter_names()]

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(i, state.model_name) for i in ids(request)]})

    @app.get("/v1/models/{model_id:path}")  # :path, as a served name may hold slashes ("org/model")
    async def model(request: Request, model_id: str) -> JSONResponse:
        served = ids(request)
        if model_id not in served:
            raise model_not_found(model_id, served)
        return JSONResponse(model_card(model_id, state.model_name))
