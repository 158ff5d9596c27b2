"""What the server says about itself: the model list (``/v1/models``, OpenAI's "retrieve
model"), llama-server's ``/props``, health (``/health``, no API key needed) and Prometheus
metrics (``/metrics``).
The GET endpoints answer HEAD too (uptime checkers)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from specgguf.server.errors import APIError
from specgguf.server.metrics import Metrics
from specgguf.server.service import Service
from specgguf.version import __version__

router = APIRouter()


def _card(svc: Service) -> dict[str, Any]:
    """The target as OpenAI's model object, with the draft, drafter and context in ``meta``."""
    engine, settings = svc.engine, svc.settings
    d = engine.describe()
    meta = {
        "target": engine.target_model.path.name,
        "draft": engine.draft_model.path.name if engine.draft_model else None,
        "drafter": d["drafter"], "draft_max": d["draft_max"], "n_ctx": d["n_ctx"],
        "n_ctx_draft": d["n_ctx_draft"], "n_vocab": engine.target_model.n_vocab,
    }  # fmt: skip
    vision = engine.projector is not None
    return {
        "id": settings.model_id, "object": "model", "created": int(time.time()),
        "owned_by": "specgguf", "aliases": list(settings.model_aliases), "meta": meta,
        # (llama-server's: what a chat UI offers)
        "capabilities": ["completion", *(["multimodal"] if vision else [])],
    }  # fmt: skip


@router.api_route("/v1/models", methods=["GET", "HEAD"])
@router.api_route("/models", methods=["GET", "HEAD"], include_in_schema=False)
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_card(request.app.state.service)]}


@router.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
@router.api_route("/models/{model:path}", methods=["GET", "HEAD"], include_in_schema=False)
async def one_model(model: str, request: Request) -> dict[str, Any]:
    """OpenAI's "retrieve model": the target under any of its names; 404 otherwise
    (``/v1/models/``: the list)."""
    svc: Service = request.app.state.service
    if not model:
        return await models(request)
    if model not in svc.names:
        raise APIError(
            404, f"no model {model!r} here: this server serves {svc.settings.model_id!r}",
            type="not_found_error", param="model", code="model_not_found",
        )  # fmt: skip
    return _card(svc)


@router.api_route("/props", methods=["GET", "HEAD"])
async def props(request: Request) -> dict[str, Any]:
    """llama-server's ``/props``, the fields its web UI and clients read: the model, the
    sequences (``total_slots``), the context, and ``modalities`` (whether images and audio
    are read: ``--mmproj``)."""
    svc: Service = request.app.state.service
    engine = svc.engine
    proj = engine.projector
    return {
        "model_alias": svc.settings.model_id,
        "model_path": str(engine.target_model.path),
        "total_slots": engine.n_parallel,
        "default_generation_settings": {"n_ctx": engine.n_ctx},
        "modalities": {"vision": bool(proj and proj.vision), "audio": bool(proj and proj.audio)},
        "build_info": f"specgguf {__version__}",
    }


@router.api_route("/health", methods=["GET", "HEAD"])
@router.api_route("/v1/health", methods=["GET", "HEAD"], include_in_schema=False)
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.api_route("/metrics", methods=["GET", "HEAD"])
async def prometheus(request: Request) -> Response:
    metrics: Metrics = request.app.state.metrics
    return Response(metrics.render(), media_type=metrics.content_type)
