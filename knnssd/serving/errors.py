"""Every error of ``knnssd serve`` in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and
counted in ``/metrics`` by status: ``answerer`` makes the answer, ``add_handlers`` routes FastAPI's own errors
(no such route, a body that does not parse or validate, a bug) through it."""
from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from knnssd.serving.metrics import ServerMetrics
from knnssd.serving.openai_protocol import ApiError

log = logging.getLogger(__name__)


def answerer(metrics: ServerMetrics) -> Callable[[ApiError], JSONResponse]:
    def answer_error(e: ApiError) -> JSONResponse:
        metrics.requests.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    return answer_error


def add_handlers(app: FastAPI, answer_error: Callable[[ApiError], JSONResponse]) -> None:
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
        return answer_error(invalid_body(e))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("request failed")
        return answer_error(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))


def invalid_body(e: RequestValidationError) -> ApiError:
    """pydantic's first complaint about a body, as a 400 that names the parameter in OpenAI's words."""
    first = e.errors()[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', '')})")
    # pydantic names the member of a union that failed ('prompt.str', 'temperature.float'): not a parameter
    loc = [str(x) for x in first["loc"] if x != "body" and not (isinstance(x, str) and (
        x in ("str", "int", "float", "bool") or "[" in x))]
    param = ".".join(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    if param is None:  # the body itself: empty, a list, a string, a form
        return ApiError(400, f"the body must be a JSON object ({msg.lower()})")
    if first["type"] == "extra_forbidden":
        msg = f"unknown field '{param}'"
    elif first["type"] == "missing":
        msg = f"'{param}' is required"
    elif first["type"] != "value_error":
        msg = f"'{param}': {msg} (got {str(first.get('input'))[:60]!r})"
    return ApiError(400, msg, param)
