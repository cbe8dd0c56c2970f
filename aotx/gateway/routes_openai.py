"""The standard (OpenAI-compatible) routes: models and chat completions.

A standard request is a device request like any other (one per choice); the gateway
follows it to the end and decodes its bytes as UTF-8, incrementally for streams
(gateway/choices.py).  A standard stream whose client disconnects is cancelled on the
device.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from . import schemas as S
from .errors import guard_only
from .render import dumps, json_response, openai_model
from .requests import ChatRequest
from .service import Caller, Gateway, Principal, Service

router = APIRouter(tags=["standard"], redirect_slashes=False)


@router.get("/v1/models", response_model=S.OpenAIModelList)
async def list_models(principal: Principal = Caller) -> Response:
    # The models the caller may use (models_body). The guard answers every request to this
    # path; this declaration is its OpenAPI entry.
    raise guard_only("GET /v1/models")


async def models_body(g: Gateway, principal: Principal) -> bytes:
    """The model list ``principal`` may see (GET /v1/models, answered by the guard)."""
    await g.ensure_ready()
    return dumps({"object": "list", "data": [openai_model(m, g.model_state(m.alias))
                                             for m in g.visible_models(principal)]})


@router.get("/v1/models/{model_id:path}", response_model=S.OpenAIModel)
async def get_model(model_id: str, principal: Principal = Caller,
                    g: Gateway = Service) -> Response:
    await g.ensure_ready()
    m = g.model_for(model_id, principal)
    return json_response(openai_model(m, g.model_state(m.alias)))


@router.post("/v1/chat/completions", response_model=S.ChatCompletion,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "the completion, or with stream: true an SSE "
                                             "stream of chat.completion.chunk objects"}})
async def chat_completions(body: ChatRequest, principal: Principal = Caller) -> Response:
    # A chat completion, or its stream (choices.completion). The guard answers every
    # request to this path; this declaration is its OpenAPI entry.
    raise guard_only("POST /v1/chat/completions")
