"""``knnssd serve``: an OpenAI-compatible HTTP server (FastAPI) over the running batch (``Batcher``).

The routes are module-level (``router``) and read the running batch from the app's state (``ServerState``);
``create_app`` puts them together. A request to ``/v1/*`` passes the key check (``access``), the body bound
(``connections.BoundedBody``), then its route; completions are answered by ``completions.Completions``, errors
in OpenAI's shape by ``errors``. ``run`` serves the app with uvicorn until SIGTERM, and follows the alias for a
new champion (``champion``).
"""
from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from knnssd.serving import errors
from knnssd.serving.access import CHALLENGE, RequireKey
from knnssd.serving.batcher import Batcher
from knnssd.serving.completions import Completions
from knnssd.serving.connections import BoundedBody, ConnectionCap, with_head_deadline
from knnssd.serving.metrics import ServerMetrics
from knnssd.serving.openai_protocol import ApiError, ChatRequest, CompletionRequest, error_body
from knnssd.serving.serve_config import ServeConfig

MAX_BODY = 16 << 20  # bytes: far more text than a context holds, which a prompt must fit (else a 400)


@dataclass(frozen=True)
class ServerState:
    """What the routes read from ``app.state.knnssd``: the running batch, its metrics, what serve was asked
    for, and the answerer of completions."""

    batcher: Batcher
    metrics: ServerMetrics
    config: ServeConfig
    completions: Completions


def _state(request: Request) -> ServerState:
    return request.app.state.knnssd


router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' checks
async def health(request: Request):
    s = _state(request)
    if not s.batcher.alive:
        return JSONResponse(error_body("the batch's thread has stopped", "server_error"), status_code=503)
    return {"status": "ok", "model": s.config.served, "bank_version": s.batcher.version}


def _card(s: ServerState) -> dict:
    batcher = s.batcher
    return {"id": s.config.served, "object": "model", "created": 0, "owned_by": "knnssd",
            "knnssd": {"bank_version": batcher.version, "source": s.config.model_uri,
                       "base_model": batcher.gen.bank.model,
                       "clusters": [c.label for c in batcher.gen.bank.clusters], "slots": batcher.slots,
                       "exact": bool(batcher.plan and batcher.plan.exact),
                       "static_slots": bool(batcher.plan and batcher.plan.decodes_on is not None)},
            "max_model_len": batcher.limits.positions}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [_card(_state(request))]}


@router.get("/v1/models/{model:path}")  # the client's models.retrieve
async def model(model: str, request: Request):
    s = _state(request)
    s.completions.check_served(model)
    return _card(s)


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(_state(request).metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _state(request).completions.answer(body, body.text(), False, request)


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request):
    s = _state(request)
    prompt = await asyncio.to_thread(body.render, s.batcher.gen.lm.tokenizer)
    return await s.completions.answer(body, prompt, True, request)


def _add_middleware(app: FastAPI, config: ServeConfig, answer_error, stopping, connections: set | None) -> None:
    """The checks a request passes before its route, outermost last: the body's bound and pace, the API key
    (before the body is read), and the connection cap (before the key: a flood of connections needs none)."""
    too_large = ApiError(413, f"the body is larger than {MAX_BODY >> 20} MiB", type="too_large")
    too_slow = ApiError(408, f"the body stopped arriving for {config.head_timeout_s:g} s (--head-timeout)",
                        type="timeout")
    app.add_middleware(BoundedBody, most=MAX_BODY, too_large=lambda: answer_error(too_large), stopping=stopping,
                       idle_s=config.head_timeout_s, too_slow=lambda: answer_error(too_slow))

    def refuse(missing: bool):
        why = ("no API key given: send the header Authorization: Bearer <key>" if missing
               else "the API key given is not one this server takes")
        return answer_error(ApiError(401, why, code="invalid_api_key", headers=CHALLENGE))

    app.add_middleware(RequireKey, keys=config.keys, refuse=refuse, metrics_open=config.metrics_open)

    def busy(n: int):
        return answer_error(ApiError(503, f"the server has {n} open connections, more than its cap "
                                          f"(--max-connections {config.max_connections}); retry later",
                                     type="server_busy", headers={"Retry-After": "1"}))

    if connections is not None:
        app.add_middleware(ConnectionCap, counted=connections, most=config.max_connections, busy=busy)


def create_app(batcher: Batcher, metrics: ServerMetrics, config: ServeConfig, stopping=lambda: False,
               connections: set | None = None) -> FastAPI:
    """The server's app over ``batcher``, as ``config`` says; ``stopping``: whether the server is shutting down
    (a request cancelled then is told so, not cut off); ``connections``: the open ones, counted by the server's
    protocol (``connections.with_head_deadline``), for ``config.max_connections`` (None: no cap)."""
    app = FastAPI(title="knnssd", docs_url=None, redoc_url=None, openapi_url=None)  # no routes beyond the API's
    metrics.queue.set_function(lambda: batcher.queued)
    metrics.active.set_function(lambda: batcher.active)
    answer_error = errors.answerer(metrics)
    errors.add_handlers(app, answer_error)
    answers = Completions(batcher, metrics, config.served, config.request_timeout_s, config.caps, answer_error,
                          stopping)
    app.state.knnssd = ServerState(batcher, metrics, config, answers)
    app.include_router(router)
    _add_middleware(app, config, answer_error, stopping, connections)
    return app


def run(batcher: Batcher, config: ServeConfig) -> None:
    """Serve until SIGTERM or Ctrl-C: then stop accepting, let requests in flight finish within
    ``config.grace_s``, cancel the rest, and return. A connection whose request head takes longer than
    ``config.head_timeout_s`` is closed (``connections.with_head_deadline``), and past ``config.max_connections``
    open connections a request gets a 503 (``connections.ConnectionCap``)."""
    import signal

    import uvicorn

    from knnssd.serving.champion import ChampionWatch, follows_alias

    metrics = ServerMetrics()
    batcher.observer = metrics
    metrics.served.info({"model_uri": config.model_uri, "bank_version": str(batcher.version)})
    server: uvicorn.Server | None = None
    connections: set = set()
    app = create_app(batcher, metrics, config, lambda: server is not None and server.should_exit, connections)
    watch = None
    if config.reload_s > 0 and follows_alias(config.model_uri):
        def swapped(version: str) -> None:
            metrics.served.info({"model_uri": config.model_uri, "bank_version": version})
            print(f"knnssd: {config.model_uri} is now version {version}: new requests route with its bank",
                  file=sys.stderr, flush=True)

        watch = ChampionWatch(batcher, config.model_uri, config.tracking_uri, config.reload_s, swapped).start()
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                           access_log=False, timeout_graceful_shutdown=config.grace_s,
                                           lifespan="off", http=with_head_deadline(config.head_timeout_s, connections)))
    # uvicorn raises the signal that stopped it again once it has shut down: a handler of our own makes
    # that a normal end (exit 0) instead of the process's death by SIGTERM
    before = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        if watch is not None:
            watch.stop()
        batcher.close()
