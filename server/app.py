"""The Starlette app: routes, lifespan, auth, limits, and the one place APIError becomes HTTP.

    app = create_app(service, api_key="...", engine_loader=lambda: Engine.start(...), on_fatal=stop)

Routes: GET /health (/ping), /version, /metrics (public); GET /v1/models, /v1/models/{id}; the routes
of server.openai_chat and server.completions; and those of server.anthropic_messages and
server.openai_responses when they import (each API module exposes `routes(service) -> list[Route]`).

The front door (pure ASGI middleware, outermost but for Starlette's error middleware) gives every
response `x-request-id` and `request-id`, sets server.service.current_request, and refuses before any
route runs: oversized headers (431), malformed or repeated X-Tandem-Client (400 invalid_client_label),
a missing or wrong key (401; `Authorization: Bearer` or `x-api-key`), a declared body over the limit
(413; a chunked body is counted as it is read). Errors take the route family's shape (server.errors):
Anthropic for /v1/messages*, OpenAI for everything else; never a 422.

Lifespan: with `engine_loader`, the engine starts in a background thread after the HTTP server is up
(/health answers 503 "Loading model" meanwhile). A watchdog polls engine health; when the engine
fails, requests are refused, /health turns 503, and `on_fatal(reason)` is called once in-flight
requests have had `fatal_grace_s` to send their errors (`tandem serve` then exits non-zero). On
shutdown the service drains and the engine is shut down (its rank processes with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hmac
import logging
import re
import secrets
import threading
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.disconnect import ClientGone
from server.errors import error_response
from server.service import APIError, RequestContext, Service, current_request

log = logging.getLogger(__name__)

PUBLIC_PATHS = ("/health", "/ping", "/version", "/metrics")
CLIENT_LABEL = re.compile(r"[A-Za-z0-9._:/@+\-]{1,64}")
OPTIONAL_MODULES = ("server.anthropic_messages", "server.openai_responses")
API_OF_PATH = (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"), ("/v1/messages", "messages"),
               ("/v1/responses", "responses"), ("/v1/models", "models"))


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, "too_large", f"the request body exceeds the limit of {limit} bytes")


def api_of(path: str) -> str:
    for prefix, name in API_OF_PATH:
        if path.startswith(prefix):
            return name
    return "other"


# ---- the front door -------------------------------------------------------------------------------

class FrontDoor:
    """Request ids, client labels, auth and size limits (see the module doc)."""

    def __init__(self, app, service: Service, api_key: str | None, max_body_bytes: int, max_header_bytes: int,
                 body_timeout_s: float = 30.0):
        self.app, self.service, self.api_key = app, service, api_key
        self.max_body, self.max_headers, self.body_timeout = max_body_bytes, max_header_bytes, body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = "req_" + secrets.token_hex(12)
        path = scope.get("path", "")
        if len(path) > 1 and path.endswith("/"):
            # "/v1/chat/completions/" is served as "/v1/chat/completions": the router would answer a
            # 307 redirect, which some clients do not follow for a POST (or follow without the body)
            path = path.rstrip("/") or "/"
            scope = dict(scope, path=path)
            if isinstance(scope.get("raw_path"), bytes):
                scope["raw_path"] = scope["raw_path"].rstrip(b"/") or b"/"
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        labels = [v for k, v in headers if k == b"x-tandem-client"]
        label = labels[0].decode("latin-1") if len(labels) == 1 else None
        token = current_request.set(RequestContext(rid, client=label, path=path))

        async def send_with_ids(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode()),
                                      (b"request-id", rid.encode())]
            await send(message)

        try:
            err = self._refusal(scope, headers, labels, label, path)
            if err is not None:
                self.service.record_rejected(err, api_of(path))
                await error_response(err, path, rid)(scope, receive, send_with_ids)
                return
            seen, body_done = 0, False

            async def counted_receive():
                nonlocal seen, body_done
                if body_done:                    # after the body: a disconnect, however long it takes
                    message = await receive()
                else:                            # a body shorter than its Content-Length must not hold a slot
                    try:
                        message = await asyncio.wait_for(receive(), self.body_timeout)
                    except asyncio.TimeoutError:
                        raise APIError(408, "timeout", f"the request body did not arrive within "
                                       f"{self.body_timeout:g} s (is Content-Length larger than the body?)",
                                       code="request_timeout") from None
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > self.max_body:
                        raise BodyTooLarge(self.max_body)
                    body_done = not message.get("more_body", False)
                else:
                    body_done = True
                return message

            await self.app(scope, counted_receive, send_with_ids)
        finally:
            current_request.reset(token)

    def _refusal(self, scope, headers, labels, label, path) -> APIError | None:
        if sum(len(k) + len(v) + 4 for k, v in headers) > self.max_headers:
            return APIError(431, "too_large", f"the request headers exceed the limit of {self.max_headers} bytes",
                            code="request_header_fields_too_large")
        if len(labels) > 1 or (labels and not CLIENT_LABEL.fullmatch(label or "")):
            why = "is repeated" if len(labels) > 1 else "must be 1-64 characters of A-Za-z0-9._:/@+-"
            return APIError(400, "invalid_request", f"the X-Tandem-Client header {why}", param="X-Tandem-Client",
                            code="invalid_client_label")
        if self.api_key is not None and path not in PUBLIC_PATHS and not self._authorized(headers):
            return APIError(401, "authentication", "Incorrect or missing API key. Send it as 'Authorization: "
                            "Bearer KEY' or 'x-api-key: KEY'.", headers={"www-authenticate": "Bearer"})
        for k, v in headers:
            if k == b"content-length":
                try:
                    size = int(v)
                except ValueError:
                    return APIError(400, "invalid_request", "the Content-Length header is not a number")
                if size > self.max_body:
                    return BodyTooLarge(self.max_body)
        return None

    def _authorized(self, headers) -> bool:
        want = self.api_key.encode()
        for k, v in headers:
            if k == b"authorization" and v[:7].lower() == b"bearer " and hmac.compare_digest(v[7:].strip(), want):
                return True
            if k == b"x-api-key" and hmac.compare_digest(v.strip(), want):
                return True
        return False


# ---- plain routes -----------------------------------------------------------------------------------

def _rfc3339(ts: int) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def model_card(service: Service, model_id: str) -> dict[str, Any]:
    """One model, with the OpenAI fields and the Anthropic ones (api.md §3)."""
    return {"id": model_id, "object": "model", "created": service.created, "owned_by": "tandem",
            "max_model_len": service.max_context, "type": "model", "display_name": model_id,
            "created_at": _rfc3339(service.created), "max_input_tokens": service.max_context - 1,
            "max_tokens": service.max_context - 1}


def _plain_routes(service: Service, metrics) -> list[Route]:
    async def health(request: Request) -> Response:
        ok, message = service.health()
        if ok:
            return JSONResponse({"status": "ok"})
        body = {"error": {"code": 503, "message": message, "type": "unavailable_error"}}
        loading = service.loading()
        if loading is not None:
            body["loading"] = loading
        return JSONResponse(body, status_code=503)

    async def version(request: Request) -> Response:
        try:
            from importlib.metadata import version as v
            ver = v("tandem")
        except Exception:
            ver = "0.1.0"
        return JSONResponse({"version": ver})

    async def prometheus(request: Request) -> Response:
        if metrics is None:
            return Response("", media_type="text/plain")
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    async def models(request: Request) -> Response:
        data = [model_card(service, m) for m in service.model_ids()]
        return JSONResponse({"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"],
                             "last_id": data[-1]["id"]})

    async def model(request: Request) -> Response:
        name = request.path_params["model_id"]
        if name not in service.model_ids() and not service.accept_any_model:
            raise APIError(404, "not_found", f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")
        return JSONResponse(model_card(service, name))

    return [Route("/health", health, methods=["GET"]), Route("/ping", health, methods=["GET"]),
            Route("/version", version, methods=["GET"]), Route("/metrics", prometheus, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{model_id:path}", model, methods=["GET"])]


def _api_routes(service: Service) -> list[Route]:
    import importlib

    from server import completions, openai_chat

    out = openai_chat.routes(service) + completions.routes(service)
    for name in OPTIONAL_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                log.exception("cannot import %s; its routes are not served", name)
            continue
        except Exception:
            log.exception("cannot import %s; its routes are not served", name)
            continue
        out += module.routes(service)
    return out


# ---- errors -----------------------------------------------------------------------------------------

def _handlers(service: Service) -> dict:
    def rid() -> str | None:
        ctx = current_request.get()
        return ctx.request_id if ctx else None

    async def on_api_error(request: Request, exc: APIError) -> Response:
        service.record_rejected(exc, api_of(request.url.path))
        return error_response(exc, request.url.path, rid())

    async def on_http_exception(request: Request, exc: HTTPException) -> Response:
        path = request.url.path
        if exc.status_code == 404:
            err = APIError(404, "not_found", f"no route for {request.method} {path}", code="not_found")
        elif exc.status_code == 405:
            err = APIError(405, "method_not_allowed", f"{request.method} is not allowed on {path}",
                           headers=dict(exc.headers or {}))
        else:
            err = APIError(exc.status_code, "invalid_request", str(exc.detail))
        service.record_rejected(err, api_of(path))
        return error_response(err, path, rid())

    async def on_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)

    async def on_bug(request: Request, exc: Exception) -> Response:
        err = APIError(500, "internal", f"internal error: {type(exc).__name__}", should_retry=False)
        service.record_rejected(err, api_of(request.url.path))
        return error_response(err, request.url.path, rid())

    return {APIError: on_api_error, HTTPException: on_http_exception, ClientGone: on_gone,
            ClientDisconnect: on_gone, Exception: on_bug}


# ---- the app ----------------------------------------------------------------------------------------

def create_app(service: Service, api_key: str | None = None, *, engine_loader: Callable[[], Any] | None = None,
               on_fatal: Callable[[str], None] | None = None, metrics=None,
               max_body_bytes: int = 16 * 2**20, max_header_bytes: int = 32 * 2**10,
               watch_interval_s: float = 0.2, fatal_grace_s: float = 2.0,
               throughput_interval_s: float = 10.0, attachments: tuple = (), drain_timeout_s: float = 0.0,
               body_timeout_s: float = 30.0) -> Starlette:
    """The HTTP app for `service`. metrics (GET /metrics) defaults to service.metrics, else a new Metrics
    that the service then reports to. attachments: other frontends sharing the loop (e.g. a
    server.zmq_api.ZmqServer): start() runs in the lifespan's startup (an exception fails the startup),
    at shutdown `await drain(drain_timeout_s)` where they have it (their requests in flight may finish,
    as HTTP ones may during uvicorn's graceful shutdown), then `await aclose()`, before the engine stops.
    The watchdog keeps watching the engine through the drain."""
    metrics = metrics if metrics is not None else service.metrics
    if metrics is None:
        from server.metrics import Metrics

        metrics = Metrics(service.model_id, getattr(service, "stats", None), lambda: getattr(service, "in_flight", 0))
        service.metrics = metrics

    @contextlib.asynccontextmanager
    async def lifespan(app):
        fatal_fired = threading.Event()

        def fatal(reason: str) -> None:
            if not fatal_fired.is_set():
                fatal_fired.set()
                if on_fatal is not None:
                    on_fatal(reason)

        loader = None
        if engine_loader is not None and service.engine is None:
            loader = threading.Thread(target=_load, args=(service, engine_loader), name="tandem-engine-loader",
                                      daemon=True)
            loader.start()
        watchdog = asyncio.create_task(_watch(service, watch_interval_s, fatal_grace_s, fatal))
        if service.request_log is not None:
            service.request_log.start_throughput(service.stats, throughput_interval_s)
        started = []
        try:
            for a in attachments:
                a.start()
                started.append(a)
            yield
        finally:
            service.begin_drain()
            for a in started:
                if hasattr(a, "drain"):
                    await a.drain(drain_timeout_s)
            watchdog.cancel()
            _check_engine(service)                  # a failure in the watchdog's last interval counts too
            if service.state == "failed":
                fatal(service.failure or "engine failure")
            for a in started:
                await a.aclose()
            if loader is not None:
                await asyncio.to_thread(loader.join, 5.0)
            await asyncio.to_thread(service.shutdown)

    app = Starlette(routes=_plain_routes(service, metrics) + _api_routes(service), lifespan=lifespan,
                    exception_handlers=_handlers(service))
    app.add_middleware(FrontDoor, service=service, api_key=api_key, max_body_bytes=max_body_bytes,
                       max_header_bytes=max_header_bytes, body_timeout_s=body_timeout_s)
    return app


def _load(service: Service, engine_loader: Callable[[], Any]) -> None:
    """Loader thread: start the engine and hand it to the service (or shut it down if we are leaving)."""
    t0 = time.monotonic()
    try:
        engine = engine_loader()
    except BaseException as e:      # noqa: BLE001 - any failure to start is fatal and must be reported
        reason = str(e) or type(e).__name__        # MemoryError() says nothing by itself
        log.error("the engine failed to start: %s", reason)
        service.fail(f"the engine failed to start: {reason}")
        return
    if not service.attach_engine(engine):
        engine.shutdown()
        return
    log.info("engine ready in %.1f s", time.monotonic() - t0)


def _check_engine(service: Service) -> None:
    """Mark the service failed if its engine reports unhealthy (also while requests drain: a rank may die
    then, and that is a failure, not a clean stop)."""
    if service.state in ("ready", "draining"):
        stats = service.stats()
        if stats and not stats.get("healthy", True):
            service.fail(stats.get("failure") or "the engine reported unhealthy")


async def _watch(service: Service, interval_s: float, grace_s: float, fatal: Callable[[str], None]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        _check_engine(service)
        if service.state == "failed":
            deadline = time.monotonic() + grace_s
            while service.in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            fatal(service.failure or "engine failure")
            return
