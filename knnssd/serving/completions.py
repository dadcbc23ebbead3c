"""The answer to one completion request of ``knnssd serve``, whole or streamed (``Completions``).

Life of a request: its parameters are checked (``openai_protocol``), its key's caps take it or answer 429
(``quota``), its prompt is tokenized off the event loop and queued in the batch (``Batcher``), which prefills it
on the next free slot and routes it; every step's verified tokens come back from the batch's thread to the
event loop (``_Follow``), where ``TextStream`` turns them into text that is safe to send; a stream sends each
piece as a server-sent event at once, a whole answer waits for the last. A client that goes away, or a request
past its timeout, cancels its sequence, which leaves its slot at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from knnssd.engine.spec.request_params import ContextTooLong, GenerateParams, whole_prompt_ids
from knnssd.serving.access import key_name
from knnssd.serving.batcher import Batcher, QueueFull, StreamJob
from knnssd.serving.metrics import ServerMetrics
from knnssd.serving.openai_protocol import (CHAT_MAX_TOKENS, COMPLETION_MAX_TOKENS, FINISH, ApiError, Reply,
                                            error_body, figures, usage)
from knnssd.serving.quota import Caps, Lease, OverCap, Quotas
from knnssd.serving.text_stream import TextStream

DISCONNECT_POLL_S = 0.25
SHUTDOWN = "the server is shutting down and its grace period is over; retry on another server or later"


class _Follow:
    """One request's events from the batch's thread, on the event loop: ("tokens", ids) per step, then
    ("done", Result or exception)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, kind: str, value) -> None:  # the batch's thread
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody reads any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))


class Completions:
    """``/v1/completions`` and ``/v1/chat/completions`` over ``batcher``. ``answer_error``: an ``ApiError`` as the
    server answers it (counted in ``metrics``); ``stopping``: whether the server is shutting down (a request
    cancelled then is told so, not cut off)."""

    def __init__(self, batcher: Batcher, metrics: ServerMetrics, served: str, request_timeout_s: float, caps: Caps,
                 answer_error: Callable[[ApiError], JSONResponse], stopping: Callable[[], bool]):
        self.batcher, self.metrics, self.served, self.timeout_s = batcher, metrics, served, request_timeout_s
        self.quotas, self.answer_error, self.stopping = Quotas(caps), answer_error, stopping
        self.tokenizer = batcher.gen.lm.tokenizer

    def check_served(self, model: str) -> None:
        if model != self.served:
            raise ApiError(404, f"model '{model}' is not served here; this server serves '{self.served}'", "model",
                           code="model_not_found")

    async def answer(self, body, prompt: str, chat: bool, request: Request):
        """The request's answer: a whole one, or a stream (``body.stream``)."""
        self.check_served(body.model)
        try:
            params = dataclasses.replace(body.params(CHAT_MAX_TOKENS if chat else COMPLETION_MAX_TOKENS),
                                         max_prompt_tokens=self.batcher.prompt_tokens)
        except ValueError as e:
            raise _invalid(e, body) from None
        try:  # before the request takes a slot or a place in the queue
            lease = self.quotas.take(getattr(request.state, "api_key", key_name(None)), params.max_new_tokens)
        except OverCap as e:
            raise ApiError(429, str(e), type=e.kind, code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        try:
            params, job, follow = await self._submit(body, prompt, chat, params)
        except BaseException:
            lease.end(0)  # never queued: nothing used
            raise
        reply = Reply(chat, self.served)
        text = TextStream(self.tokenizer, params.stop)
        if body.stream:
            return _Stream(self._stream(job, follow, text, reply, body.include_usage, lease), (job, lease))
        return await self._whole(job, follow, text, reply, request, lease)

    async def _submit(self, body, prompt: str, chat: bool, params: GenerateParams
                      ) -> tuple[GenerateParams, StreamJob, _Follow]:
        """(params, job, follow): the request queued, its prompt tokenized off the event loop, which serves the
        others meanwhile (a long prompt takes a while)."""
        follow, batcher = _Follow(), self.batcher

        def submit():
            # as OpenAI's API: the whole prompt, or a 400 (the CLI's policy of keeping a long prompt's last
            # tokens would drop a chat's system and user turns unseen)
            ids, fitted = whole_prompt_ids(self.tokenizer, prompt, params, batcher.limits,
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
            raise _invalid(e, body) from None
        except QueueFull as e:
            raise ApiError(503, f"the server is busy ({e}); retry later", type="server_busy",
                           headers={"Retry-After": "1"}) from None
        return fitted, job, follow

    async def _events(self, job: StreamJob, follow: _Follow) -> AsyncIterator[tuple[str, object]]:
        """The request's events until it ends; a timeout cancels it (and ends with ("timeout", None))."""
        metrics = self.metrics
        deadline = job.t_submit + self.timeout_s
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

    def _finished(self, result, lease: Lease) -> tuple[str, dict]:
        self.metrics.prompt_tokens.inc(result.prompt_tokens)
        self.metrics.completion_tokens.inc(len(result.tokens))
        lease.end(result.prompt_tokens + len(result.tokens))  # its charge: what it used, not its max_tokens
        return FINISH.get(result.stats.stop, "stop"), usage(result.prompt_tokens, len(result.tokens))

    def _timed_out(self) -> str:
        return f"the request took longer than {self.timeout_s:g} s and was cancelled"

    async def _whole(self, job: StreamJob, follow: _Follow, text: TextStream, reply: Reply, request: Request,
                     lease: Lease):
        checked = time.perf_counter()
        try:
            async for kind, value in self._events(job, follow):
                now = time.perf_counter()
                if now - checked >= DISCONNECT_POLL_S:  # tokens may arrive every step: look between them too
                    checked = now
                    if await request.is_disconnected():
                        job.cancelled = True  # its slot is freed at the next step
                        self.metrics.requests.labels("499").inc()
                        return Response(status_code=499)
                if kind == "tokens":
                    text.feed(value)
                elif kind == "timeout":
                    raise ApiError(504, self._timed_out(), type="timeout")
                elif kind == "done":
                    if isinstance(value, BaseException):
                        raise ApiError(500, f"generation failed: {value}", type="server_error")
                    finish, use = self._finished(value, lease)
                    self.metrics.requests.labels("200").inc()
                    return reply.whole(text.text, finish, figures(value, self.batcher.version), use)
        except asyncio.CancelledError:
            job.cancelled = True
            if not self.stopping():
                raise
            return self.answer_error(ApiError(503, SHUTDOWN, type="server_shutdown"))  # past the grace period
        finally:
            lease.end()  # a no-op where it finished; else its charge stays as reserved

    async def _stream(self, job: StreamJob, follow: _Follow, text: TextStream, reply: Reply, include_usage: bool,
                      lease: Lease):
        first, status = True, "200"
        try:
            async for kind, value in self._events(job, follow):
                if kind == "tokens":
                    piece = text.feed(value)
                    if piece or first:
                        yield _sse(reply.chunk(piece, first=first))
                        first = False
                elif kind == "timeout":
                    status = "504"
                    yield _sse(error_body(self._timed_out(), "timeout"))
                elif kind == "done":
                    if isinstance(value, BaseException):
                        status = "500"
                        yield _sse(error_body(f"generation failed: {value}", "server_error"))
                        break
                    finish, use = self._finished(value, lease)
                    yield _sse(reply.chunk(text.finish(), finish, figures(value, self.batcher.version), first=first))
                    if include_usage:
                        yield _sse(reply.usage_chunk(use))
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit) as e:
            if isinstance(e, GeneratorExit) or not self.stopping():
                status = "499"  # the client went away: its sequence leaves the batch at the next step
                raise
            status = "503"  # the server stops past its grace period: the client is told, not cut off
            yield _sse(error_body(SHUTDOWN, "server_shutdown"))
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled = True  # a no-op for a finished sequence
            lease.end()
            self.metrics.requests.labels(status).inc()


class _Stream(StreamingResponse):
    """A stream that frees its request however the response ends. Its generator's own ``finally`` does where
    the generator ran; one that never started (a response ended before its body began) runs no ``finally``,
    and its sequence would run to its end and its key's place stay taken."""

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


def _invalid(e: ValueError, body) -> ApiError:
    """A parameter's check that failed, as OpenAI's 400 naming the parameter where the message starts with one."""
    if isinstance(e, ContextTooLong):
        return ApiError(400, str(e), e.param, code="context_length_exceeded")
    word = str(e).split(" ", 1)[0]  # the parameter a check names first ("seed must be ...")
    return ApiError(400, str(e), word if word in type(body).model_fields else None)


def _drop_job(submitting: asyncio.Future) -> None:
    """Cancel the job a submission queued after its request was cancelled (none where it failed)."""
    if not submitting.cancelled() and submitting.exception() is None:
        submitting.result()[1].cancelled = True


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
