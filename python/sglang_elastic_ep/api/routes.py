"""FastAPI routes of the orchestrator contract (see docs/api.md).

``build_router(control_plane)`` returns an ``APIRouter``; ``mount_elastic_ep(app, ...)`` puts
it on SGLang's app in place of upstream's ``/scale_elastic_ep`` and ``/is_scaling_elastic_ep``
and marks every endpoint ``AuthLevel.ADMIN_OPTIONAL`` for SGLang's API key middleware.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError

from sglang_elastic_ep.api.auth import ApiKeyCheck, sglang_admin_auth
from sglang_elastic_ep.api.control_plane import ControlPlane
from sglang_elastic_ep.core.api_models import (
    ID_PATTERN,
    ErrorResponse,
    ScaleRequest,
    describe_validation_error,
)
from sglang_elastic_ep.core.events import format_sse, format_sse_comment, parse_last_event_id

SCALE_PATH = "/scale_elastic_ep"
IS_SCALING_PATH = "/is_scaling_elastic_ep"
STATUS_PATH = "/elastic_ep/status"
EVENTS_PATH = "/elastic_ep/events"
HEALTH_PATH = "/elastic_ep/health"
PATHS = (SCALE_PATH, IS_SCALING_PATH, STATUS_PATH, EVENTS_PATH, HEALTH_PATH)

MAX_BODY_BYTES = 64 * 1024
_EXAMPLE = '{"new_ep_size": 4, "operation_id": "<uuid>"}'
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class _BodyTooLarge(Exception):
    def __init__(self, size: int | None) -> None:
        self.size = size


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"field '{key}' appears twice; send it once")
        out[key] = value
    return out


def _peek_operation_id(raw: Any) -> str | None:
    """The body's operation_id if it is a well-formed id, so even refusals can echo it."""
    if isinstance(raw, dict):
        value = raw.get("operation_id")
        if isinstance(value, str) and re.fullmatch(ID_PATTERN, value):
            return value
    return None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _BodyTooLarge(int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge(None)
        chunks.append(chunk)
    return b"".join(chunks)


def _flag(value: str | None, name: str, default: bool) -> bool:
    if value is None or value == "":
        return default
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name} must be true or false (got {value!r})")


def build_router(
    control_plane: ControlPlane,
    *,
    api_key_check: ApiKeyCheck | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    keepalive_s: float = 15.0,
    poll_interval_s: float = 0.1,
    sse_retry_ms: int = 2000,
) -> APIRouter:
    """Routes of the elastic EP API over ``control_plane``.

    ``api_key_check`` (see ``sglang_admin_auth``) runs first in every endpoint; None leaves
    them open. SSE streams poll the event log every ``poll_interval_s`` and send a comment
    after ``keepalive_s`` without events.
    """
    cp = control_plane
    router = APIRouter()

    def error(status: int, message: str, *, details: Iterable[str] = (), op: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        # Every answer names an operation id, refusals included (generated when the caller sent
        # none), so orchestrator logs and server logs can be joined on it.
        body = ErrorResponse(
            error=message, details=list(details), operation_id=op or uuid.uuid4().hex,
            instance_id=cp.instance_id,
        )
        return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)

    def denied(request: Request, *, write: bool) -> JSONResponse | None:
        if api_key_check is None:
            return None
        failure = api_key_check(request.headers.get("authorization"), write)
        if failure is None:
            return None
        return error(failure.status, failure.message, headers={"WWW-Authenticate": "Bearer"})

    @router.post(SCALE_PATH)
    async def scale_elastic_ep(request: Request) -> Response:
        """Scale to ``new_ep_size`` ranks (absolute); answers at once, progress via status."""
        if (refusal := denied(request, write=True)) is not None:
            return refusal
        try:
            body = await _read_body(request, max_body_bytes)
        except _BodyTooLarge as exc:
            size = f" ({exc.size} bytes)" if exc.size is not None else ""
            return error(
                413,
                f"request body{size} is over the {max_body_bytes}-byte limit; "
                f"send only the scale fields, e.g. {_EXAMPLE}",
            )
        try:
            raw = json.loads(body, object_pairs_hook=_no_duplicates)
        except _DuplicateKey as exc:
            return error(400, f"invalid scale request: {exc}", details=[str(exc)])
        except (ValueError, RecursionError) as exc:
            reason = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
            return error(
                400,
                f"request body is not valid JSON ({reason}); send a JSON object such as "
                f"{_EXAMPLE} with Content-Type: application/json",
            )
        op = _peek_operation_id(raw)
        try:
            scale_request = ScaleRequest.model_validate(raw)
        except ValidationError as exc:
            described = describe_validation_error(exc)
            return error(400, described.error, details=described.details, op=op)
        answer = await cp.request_scale(scale_request)
        response = answer.response
        if response.operation_id is None:
            response = response.model_copy(update={"operation_id": uuid.uuid4().hex})
        return JSONResponse(response.model_dump(mode="json"), status_code=answer.status)

    @router.delete(SCALE_PATH + "/{operation_id}")
    async def cancel_scale_elastic_ep(request: Request, operation_id: str) -> Response:
        """Call off a scale-up that has not committed (200 cancelled, 202 on its way, 404
        unknown, 409 committed or not cancellable); a repeat answers the same."""
        if (refusal := denied(request, write=True)) is not None:
            return refusal
        answer = await cp.cancel_operation(operation_id)
        return JSONResponse(answer.response.model_dump(mode="json"), status_code=answer.status)

    async def is_scaling_elastic_ep(request: Request) -> Response:
        """Upstream's shape (``is_scaling_elastic_ep``, sizes, ``scale_phase``) plus ours."""
        if (refusal := denied(request, write=False)) is not None:
            return refusal
        status = cp.status()
        current = status.current_operation
        return JSONResponse(
            {
                "is_scaling_elastic_ep": current is not None,
                "effective_ep_size": status.effective_ep_size,
                "pending_ep_size": status.pending_ep_size,
                "scale_phase": status.phase.value,
                "last_error": status.last_error,
                "phase": status.phase.value,
                "operation_id": current.operation_id if current else None,
                "instance_id": status.instance_id,
            }
        )

    # GET (upstream) and POST (the RFC): two routes, so OpenAPI operation ids stay unique.
    router.add_api_route(IS_SCALING_PATH, is_scaling_elastic_ep, methods=["GET"])
    router.add_api_route(
        IS_SCALING_PATH, is_scaling_elastic_ep, methods=["POST"], name="is_scaling_elastic_ep_post"
    )

    @router.get(STATUS_PATH)
    async def elastic_ep_status(request: Request) -> Response:
        if (refusal := denied(request, write=False)) is not None:
            return refusal
        return JSONResponse(cp.status().model_dump(mode="json"))

    @router.get(HEALTH_PATH)
    async def elastic_ep_health(request: Request) -> Response:
        if (refusal := denied(request, write=False)) is not None:
            return refusal
        return JSONResponse(cp.health().model_dump(mode="json"))

    @router.get(EVENTS_PATH)
    async def elastic_ep_events(request: Request) -> Response:
        """SSE stream; resume with ``Last-Event-ID``; ``?follow=false`` sends what is buffered."""
        if (refusal := denied(request, write=False)) is not None:
            return refusal
        try:
            follow = _flag(request.query_params.get("follow"), "follow", True)
        except ValueError as exc:
            return error(400, f"{exc}; use ?follow=false to read the backlog and close")
        header = request.headers.get("last-event-id")
        query = request.query_params.get("last_event_id")
        given = header if header not in (None, "") else query
        start: int | None = None
        if given not in (None, ""):
            start = parse_last_event_id(given)
            if start is None:
                return error(
                    400,
                    f"Last-Event-ID must be a non-negative integer event id (got {given!r}); "
                    "send the id: of the last event you processed, or omit it",
                )
        log = cp.events
        if start is None:
            # A new follower sees what happens from now on; a one-shot read gets the backlog.
            start = log.last_event_id if follow else 0

        async def frames() -> AsyncIterator[str]:
            cursor = start
            loop = asyncio.get_running_loop()
            yield f"retry: {sse_retry_ms}\n" + format_sse_comment(f"instance {cp.instance_id}")
            last_sent = loop.time()
            while True:
                batch = log.since(cursor)
                if batch.missed:
                    notice = {
                        "type": "missed",
                        "instance_id": cp.instance_id,
                        "last_event_id": batch.last_event_id,
                        "message": "events after your Last-Event-ID are no longer buffered "
                        "(or the server restarted): re-read GET /elastic_ep/status",
                    }
                    yield (
                        f"id: {batch.last_event_id}\nevent: missed\n"
                        f"data: {json.dumps(notice)}\n\n"
                    )
                for event in batch.events:
                    yield format_sse(event)
                if batch.events or batch.missed:
                    last_sent = loop.time()
                cursor = batch.last_event_id
                if not follow:
                    return
                if loop.time() - last_sent >= keepalive_s:
                    yield format_sse_comment("keepalive")
                    last_sent = loop.time()
                await asyncio.sleep(poll_interval_s)

        # Not sse-starlette's EventSourceResponse: importing it patches uvicorn's
        # Server.handle_exit for the whole process, and this runs inside SGLang's server.
        return StreamingResponse(
            frames(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return router


def mount(app: FastAPI, router: APIRouter, *, auth_level: object | None = None) -> None:
    """Add the routes of ``router`` to ``app`` ahead of every route already there.

    Starlette serves the first matching route, and SGLang has already included upstream's
    ``/scale_elastic_ep`` and ``/is_scaling_elastic_ep``, so ours go first and shadow them.
    They are added one by one as top-level routes, not with ``include_router``: FastAPI
    0.165 includes a router as one lazy ``_IncludedRouter`` entry whose ``matches()`` hides
    the endpoint, so SGLang's API key middleware could not read its auth level and would
    treat it as ``NORMAL``. ``auth_level`` (SGLang's ``AuthLevel.ADMIN_OPTIONAL``) is set as
    ``_auth_level`` on every endpoint, which is where that middleware looks.
    """
    routes = app.router.routes
    before = len(routes)
    for route in router.routes:
        if not isinstance(route, APIRoute):
            raise TypeError(f"unexpected route type {type(route).__name__} in the router")
        if auth_level is not None:
            route.endpoint._auth_level = auth_level  # type: ignore[attr-defined]
        app.router.add_api_route(
            route.path, route.endpoint, methods=sorted(route.methods), name=route.name
        )
    added = routes[before:]
    del routes[before:]
    routes[0:0] = added
    mark_changed = getattr(app.router, "_mark_routes_changed", None)
    if callable(mark_changed):
        mark_changed()


def mount_elastic_ep(
    app: FastAPI,
    control_plane: ControlPlane,
    *,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    **router_kwargs: Any,
) -> APIRouter:
    """Mount the elastic EP API on SGLang's ``app`` (call in the HTTP server process).

    Uses SGLang's own key settings (``server_args.api_key``/``admin_api_key``) for the
    endpoints' own check and marks them ``ADMIN_OPTIONAL`` for SGLang's middleware.
    """
    from sglang.srt.utils.auth import AuthLevel  # SGLang is loaded in this process anyway

    router = build_router(
        control_plane, api_key_check=sglang_admin_auth(api_key, admin_api_key), **router_kwargs
    )
    mount(app, router, auth_level=AuthLevel.ADMIN_OPTIONAL)
    return router


__all__ = [
    "EVENTS_PATH",
    "HEALTH_PATH",
    "IS_SCALING_PATH",
    "MAX_BODY_BYTES",
    "PATHS",
    "SCALE_PATH",
    "STATUS_PATH",
    "build_router",
    "mount",
    "mount_elastic_ep",
]
