"""``knnssd serve``: an OpenAI-compatible HTTP server (FastAPI) over the running batch (``Batcher``).

Life of a request: the body is checked whole (``openai_protocol``); the prompt (or the messages,
through the model's chat template) and its parameters are queued in the batch, which prefills it on
the next free slot and routes it; every step's verified tokens come back from the batch's thread to
the event loop, where ``TextStream`` turns them into text that is safe to send; a stream sends each
piece as a server-sent event at once, a whole answer waits for the last. A client that goes away,
or a request past ``request_timeout_s``, cancels its sequence, which leaves its slot at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from knnssd.engine.params import ContextTooLong, whole_prompt_ids
from knnssd.serving.access import CHALLENGE, Keys, RequireKey, key_name
from knnssd.serving.batcher import Batcher, QueueFull, StreamJob
from knnssd.serving.connections import with_head_deadline
from knnssd.serving.metrics import ServerMetrics
from knnssd.serving.quota import Caps, Lease, OverCap, Quotas
from knnssd.serving.openai_protocol import (CHAT_MAX_TOKENS, COMPLETION_MAX_TOKENS, FINISH, ApiError, ChatRequest,
                                            CompletionRequest, Reply, error_body, figures, usage)
from knnssd.serving.text_stream import TextStream

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25
SHUTDOWN = "the server is shutting down and its grace period is over; retry on another server or later"
MAX_BODY = 16 << 20  # bytes: far more text than a context holds, which a prompt must fit (else a 400)


class _Follow:
    """One request's events from the batch's thread, on the event loop: ("tokens", ids) per step, then
    ("done", Result or exception)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, kind: str, value) -> None:  # the batch's thread
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody reads any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))


def create_app(batcher: Batcher, served: str, metrics: ServerMetrics, request_timeout_s: float = 600.0,
               source: str = "", stopping=lambda: False, keys: Keys = Keys(), metrics_open: bool = False,
               caps: Caps = Caps()) -> FastAPI:
    """``served``: the model id clients name; ``source``: the model URI the bank came from; ``stopping``:
    whether the server is shutting down (a request cancelled then is told so, not cut off); ``keys``: the API
    keys ``/v1/*`` asks for (``access.RequireKey``; none: open), and ``/metrics`` from beyond loopback unless
    ``metrics_open``; ``caps``: each key's (``quota``)."""
    app = FastAPI(title="knnssd", docs_url=None, redoc_url=None)
    tokenizer = batcher.gen.lm.tokenizer
    metrics.queue.set_function(lambda: batcher.queued)
    metrics.active.set_function(lambda: batcher.active)
    quotas = Quotas(caps)

    def answer_error(e: ApiError) -> JSONResponse:
        metrics.requests.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    class Bounded:  # a plain ASGI layer (Starlette's middleware class hides a client's disconnect from handlers):
        # the body's size, and the end of requests cancelled at shutdown
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and scope["method"] == "POST":
                # the body is read here, up to the bound, whether or not a Content-Length announced it (a
                # chunked body has none); the rest is read and dropped, so a client still sending gets the 413
                chunks, size, more = [], 0, True
                while more:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client went away
                    more = message.get("more_body", False)
                    size += len(message.get("body", b""))
                    if size <= MAX_BODY:
                        chunks.append(message.get("body", b""))
                if size > MAX_BODY:
                    too_large = ApiError(413, f"the body is larger than {MAX_BODY >> 20} MiB", type="too_large")
                    return await answer_error(too_large)(scope, receive, send)
                replayed = False

                async def receive_body(receive=receive):
                    nonlocal replayed
                    if replayed:
                        return await receive()
                    replayed = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

                receive = receive_body
            try:
                await self.inner(scope, receive, send)
            except asyncio.CancelledError:
                if not stopping():
                    raise
                # past the grace period: the handler has told its client (an error event, or 503); ending here
                # keeps uvicorn from logging the cancellation as a failed application

    app.add_middleware(Bounded)

    def refuse(missing: bool):
        why = ("no API key given: send the header Authorization: Bearer <key>" if missing
               else "the API key given is not one this server takes")
        return answer_error(ApiError(401, why, code="invalid_api_key", headers=CHALLENGE))

    app.add_middleware(RequireKey, keys=keys, refuse=refuse, metrics_open=metrics_open)  # outermost: before the body

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return answer_error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):  # no such route or method, a body unparsed
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return answer_error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind,
                                     headers=getattr(e, "headers", None)))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return answer_error(ApiError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', '')})"))
        # pydantic names the member of a union that failed ('prompt.str', 'temperature.float'): not a parameter
        loc = [str(x) for x in first["loc"] if x != "body" and not (isinstance(x, str) and (
            x in ("str", "int", "float", "bool") or "[" in x))]
        param = ".".join(loc) or None
        msg = first["msg"].removeprefix("Value error, ")
        if param is None:  # the body itself: empty, a list, a string, a form
            return answer_error(ApiError(400, f"the body must be a JSON object ({msg.lower()})"))
        if first["type"] == "extra_forbidden":
            msg = f"unknown field '{param}'"
        elif first["type"] == "missing":
            msg = f"'{param}' is required"
        elif first["type"] != "value_error":
            msg = f"'{param}': {msg} (got {str(first.get('input'))[:60]!r})"
        return answer_error(ApiError(400, msg, param))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("request failed")
        return answer_error(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' checks
    async def health():
        if not batcher.alive:
            return JSONResponse(error_body("the batch's thread has stopped", "server_error"), status_code=503)
        return {"status": "ok", "model": served, "bank_version": batcher.version}

    def card() -> dict:
        return {"id": served, "object": "model", "created": 0, "owned_by": "knnssd",
                "knnssd": {"bank_version": batcher.version, "source": source, "base_model": batcher.gen.bank.model,
                           "clusters": [c.label for c in batcher.gen.bank.clusters], "slots": batcher.slots,
                           "exact": bool(batcher.plan and batcher.plan.exact),
                           "static_slots": bool(batcher.plan and batcher.plan.runs_on is not None)},
                "max_model_len": batcher.limits.positions}

    def check_served(model: str) -> None:
        if model != served:
            raise ApiError(404, f"model '{model}' is not served here; this server serves '{served}'", "model",
                           code="model_not_found")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")  # the client's models.retrieve
    async def model(model: str):
        check_served(model)
        return card()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(body, body.text(), False, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _generate(body, await asyncio.to_thread(body.render, tokenizer), True, request)

    def invalid(e: ValueError, body) -> ApiError:
        if isinstance(e, ContextTooLong):
            return ApiError(400, str(e), e.param, code="context_length_exceeded")
        word = str(e).split(" ", 1)[0]  # the parameter a check names first ("seed must be ...")
        return ApiError(400, str(e), word if word in type(body).model_fields else None)

    async def _generate(body, prompt: str, chat: bool, request: Request):
        check_served(body.model)
        try:
            params = dataclasses.replace(body.params(CHAT_MAX_TOKENS if chat else COMPLETION_MAX_TOKENS),
                                         max_prompt_tokens=batcher.prompt_tokens)
        except ValueError as e:
            raise invalid(e, body) from None
        try:  # before the request takes a slot or a place in the queue
            lease = quotas.take(getattr(request.state, "api_key", key_name(None)), params.max_new_tokens)
        except OverCap as e:
            raise ApiError(429, str(e), type=e.kind, code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        try:
            params, job, follow = await _submit(body, prompt, chat, params)
        except BaseException:
            lease.end(0)  # never queued: nothing used
            raise
        reply = Reply(chat, served)
        text = TextStream(tokenizer, params.stop)
        if body.stream:
            return _Stream(_stream(job, follow, text, reply, body.include_usage, lease), (job, lease))
        return await _whole(job, follow, text, reply, request, lease)

    async def _submit(body, prompt: str, chat: bool, params) -> tuple:
        """(params, job, follow): the request queued, its prompt tokenized off the event loop, which serves the
        others meanwhile (a long prompt takes a while)."""
        follow = _Follow()

        def submit():
            # as OpenAI's API: the whole prompt, or a 400 (the CLI's policy of keeping a long prompt's last
            # tokens would drop a chat's system and user turns unseen)
            ids, fitted = whole_prompt_ids(tokenizer, prompt, params, batcher.limits,
                                           fit=body.max_tokens is None, where="messages" if chat else "prompt")
            return fitted, batcher.submit_ids(ids, False, fitted, lambda t: follow.put("tokens", t),
                                              lambda r: follow.put("done", r))

        submitting = asyncio.ensure_future(asyncio.to_thread(submit))
        try:
            fitted, job = await asyncio.shield(submitting)
        except asyncio.CancelledError:  # the client went away while its prompt was tokenized: drop its job
            submitting.add_done_callback(_drop_job)
            raise
        except ValueError as e:
            raise invalid(e, body) from None
        except QueueFull as e:
            raise ApiError(503, f"the server is busy ({e}); retry later", type="server_busy",
                           headers={"Retry-After": "1"}) from None
        return fitted, job, follow

    async def _events(job: StreamJob, follow: _Follow) -> AsyncIterator[tuple[str, object]]:
        """The request's events until it ends; a timeout cancels it (and ends with ("timeout", None))."""
        deadline = job.t_submit + request_timeout_s
        first = last = None
        while True:
            left = deadline - time.perf_counter()
            try:
                kind, value = await asyncio.wait_for(follow.queue.get(), min(max(left, 0.0), DISCONNECT_POLL_S))
            except asyncio.TimeoutError:
                if left <= 0:
                    job.cancelled = True
                    yield "timeout", None
                    return
                yield "idle", None
                continue
            now = time.perf_counter()
            if kind == "tokens":
                if first is None:
                    first = now
                    metrics.ttft_s.observe(now - job.t_submit)
                else:
                    for _ in value:  # a step's tokens arrive together: each waited its share
                        metrics.itl_s.observe((now - last) / len(value))
                last = now
            yield kind, value
            if kind == "done":
                return

    def _finished(result, lease: Lease) -> tuple[str, dict]:
        metrics.prompt_tokens.inc(result.prompt_tokens)
        metrics.completion_tokens.inc(len(result.tokens))
        lease.end(result.prompt_tokens + len(result.tokens))  # its charge: what it used, not its max_tokens
        return FINISH.get(result.stats.stop, "stop"), usage(result.prompt_tokens, len(result.tokens))

    async def _whole(job: StreamJob, follow: _Follow, text: TextStream, reply: Reply, request: Request,
                     lease: Lease):
        checked = time.perf_counter()
        try:
            async for kind, value in _events(job, follow):
                now = time.perf_counter()
                if now - checked >= DISCONNECT_POLL_S:  # tokens may arrive every step: look between them too
                    checked = now
                    if await request.is_disconnected():
                        job.cancelled = True  # its slot is freed at the next step
                        metrics.requests.labels("499").inc()
                        return Response(status_code=499)
                if kind == "tokens":
                    text.feed(value)
                elif kind == "timeout":
                    raise ApiError(504, f"the request took longer than {request_timeout_s:g} s and was cancelled",
                                   type="timeout")
                elif kind == "done":
                    if isinstance(value, BaseException):
                        raise ApiError(500, f"generation failed: {value}", type="server_error")
                    finish, use = _finished(value, lease)
                    metrics.requests.labels("200").inc()
                    return reply.whole(text.text, finish, figures(value, batcher.version), use)
        except asyncio.CancelledError:
            job.cancelled = True
            if not stopping():
                raise
            return answer_error(ApiError(503, SHUTDOWN, type="server_shutdown"))  # past the grace period
        finally:
            lease.end()  # a no-op where it finished; else its charge stays as reserved

    async def _stream(job: StreamJob, follow: _Follow, text: TextStream, reply: Reply, include_usage: bool,
                      lease: Lease):
        first, status = True, "200"
        try:
            async for kind, value in _events(job, follow):
                if kind == "tokens":
                    piece = text.feed(value)
                    if piece or first:
                        yield _sse(reply.chunk(piece, first=first))
                        first = False
                elif kind == "timeout":
                    status = "504"
                    yield _sse(error_body(f"the request took longer than {request_timeout_s:g} s and was cancelled",
                                          "timeout"))
                elif kind == "done":
                    if isinstance(value, BaseException):
                        status = "500"
                        yield _sse(error_body(f"generation failed: {value}", "server_error"))
                        break
                    finish, use = _finished(value, lease)
                    yield _sse(reply.chunk(text.finish(), finish, figures(value, batcher.version), first=first))
                    if include_usage:
                        yield _sse(reply.usage_chunk(use))
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit) as e:
            if isinstance(e, GeneratorExit) or not stopping():
                status = "499"  # the client went away: its sequence leaves the batch at the next step
                raise
            status = "503"  # the server stops past its grace period: the client is told, not cut off
            yield _sse(error_body(SHUTDOWN, "server_shutdown"))
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled = True  # a no-op for a finished sequence
            lease.end()
            metrics.requests.labels(status).inc()

    return app


class _Stream(StreamingResponse):
    """A stream that frees its request however the response ends. Its generator's own ``finally`` does where
    it ran; but a client gone before the first byte ends the response before the generator starts, and its
    sequence would then run to its end, and its key's place stay taken."""

    def __init__(self, events, held: tuple[StreamJob, Lease]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.held = held

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            job, lease = self.held
            job.cancelled = True  # a no-op for a finished sequence
            lease.end()


def _drop_job(submitting: asyncio.Future) -> None:
    """Cancel the job a submission queued after its request was cancelled (none where it failed)."""
    if not submitting.cancelled() and submitting.exception() is None:
        submitting.result()[1].cancelled = True


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def served_name(model_uri: str) -> str:
    """The model id clients name: the registered model's name, or the bank folder's."""
    from pathlib import Path

    if model_uri.startswith("models:/"):
        return model_uri[len("models:/"):].split("@")[0].split("/")[0]
    return Path(model_uri).resolve().name


def run(batcher: Batcher, model_uri: str, host: str, port: int, tracking_uri: str | None = None,
        request_timeout_s: float = 600.0, reload_s: float = 30.0, grace_s: float = 30.0, keys: Keys = Keys(),
        metrics_open: bool = False, head_timeout_s: float = 10.0, max_connections: int = 1024,
        caps: Caps = Caps()) -> None:
    """Serve until SIGTERM or Ctrl-C: then stop accepting, let requests in flight finish within
    ``grace_s``, cancel the rest, and return. ``keys``, ``metrics_open``: ``create_app``'s; a connection whose
    request head takes longer than ``head_timeout_s`` is closed (``connections.with_head_deadline``), and past
    ``max_connections`` open connections a request gets uvicorn's 503; ``caps``: each key's (``quota``)."""
    import signal

    import uvicorn

    from knnssd.serving.champion import ChampionWatch, follows_alias

    metrics = ServerMetrics()
    batcher.observer = metrics
    metrics.served.info({"model_uri": model_uri, "bank_version": str(batcher.version)})
    server: uvicorn.Server | None = None
    app = create_app(batcher, served_name(model_uri), metrics, request_timeout_s, model_uri,
                     lambda: server is not None and server.should_exit, keys, metrics_open, caps)
    watch = None
    if reload_s > 0 and follows_alias(model_uri):
        def swapped(version: str) -> None:
            metrics.served.info({"model_uri": model_uri, "bank_version": version})
            print(f"knnssd: {model_uri} is now version {version}: new requests route with its bank", file=sys.stderr,
                  flush=True)

        watch = ChampionWatch(batcher, model_uri, tracking_uri, reload_s, swapped).start()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                                           timeout_graceful_shutdown=grace_s, lifespan="off",
                                           http=with_head_deadline(head_timeout_s), limit_concurrency=max_connections))
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
