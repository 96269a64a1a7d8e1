"""HTTP routes: thin wrappers over `serving_*` and the app state."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.errors import NotFoundError, ServiceUnavailableError
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SpeculationInfo
from server.serving import ServingContext
from server.serving_chat import create_chat_completion, render_chat
from server.serving_completions import create_completion, render_completion

router = APIRouter()


def _state(request: Request):
    return request.app.state.specd


def _loaded(request: Request) -> ServingContext:
    serving = _state(request).serving
    if serving is None:
        raise ServiceUnavailableError("the model is still loading", code="model_loading")
    return serving


def _serving(request: Request) -> ServingContext:
    """The serving context for a new generation request: loaded and not draining."""
    if _state(request).draining:
        raise ServiceUnavailableError("the server is shutting down", code="shutting_down")
    return _loaded(request)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the process serves HTTP, loaded or not; 503 once the engine loop has died."""
    if _state(request).engine_error is not None:  # why: in the server's log, not in a public reply
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once the engine runs, 503 while loading or draining."""
    state = _state(request)
    if state.engine_error is not None:
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    if state.serving is None or state.draining:
        reason = "draining" if state.draining else ("failed" if state.load_error else "loading")
        return JSONResponse({"status": reason}, status_code=503, headers={"Retry-After": "1"})
    # The model id may be a local path: only a caller holding a key (or any, on a keyless server) sees it.
    credentials = state.keys.current()
    authorization = (request.headers.get("authorization") or "").encode("latin-1")
    if credentials.required and credentials.tenant_for(authorization) is None:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "ready", "model": state.serving.model_id})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    if state.engine is not None:
        state.metrics.set_queue_state(state.engine.scheduler.queue_state())
    body, content_type = state.metrics.render(request.headers.get("accept"))
    return Response(body, media_type=content_type)


def _cards(request: Request) -> list[ModelCard]:
    serving = _loaded(request)
    created = int(_state(request).started)
    return [
        ModelCard(id=name, created=created, root=serving.model_id, max_model_len=serving.max_model_len)
        for name in serving.served_names
    ]


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=_cards(request))


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> ModelCard:
    for card in _cards(request):
        if card.id == model_id:
            return card
    raise NotFoundError(f"the model '{model_id}' does not exist", param="model", code="model_not_found")


@router.get("/v1/speculation")
async def speculation(request: Request) -> SpeculationInfo:
    state = _state(request)
    engine = state.engine
    if engine is None:
        raise ServiceUnavailableError("the model is still loading", code="model_loading")
    return SpeculationInfo(**engine.speculation_info())


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(_serving(request), body, request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(_serving(request), body, request)


# Rendering only: the token ids a request's prompt becomes here. Routers that route by prefix
# (vllm-router's cache_aware, llm-d's precise scorer) ask every replica for them.
@router.post("/v1/completions/render")
async def completions_render(body: CompletionRequest, request: Request) -> Response:
    return await render_completion(_serving(request), body, request)


@router.post("/v1/chat/completions/render")
async def chat_completions_render(body: ChatCompletionRequest, request: Request) -> Response:
    return await render_chat(_serving(request), body, request)
