"""OpenAI error objects: every failure leaves as `{"error": {message, type, param, code}}`.

Errors travel as exceptions (`APIError`, or the scheduler's own
`InvalidRequestError` / `QueueFullError`, the engine's `EngineDeadError`) until the handlers registered here
turn them into a status code and body. A traceback never reaches a client.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.engine import EngineDeadError
from scheduler.scheduler import QueueFullError
from scheduler.types import InvalidRequestError

logger = logging.getLogger("specd.server")

RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """A request that fails with an HTTP status and an OpenAI error object."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class BadRequestError(APIError):
    pass


class NotFoundError(APIError):
    status_code = 404


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "service_unavailable_error"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message, code=code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class EngineError(APIError):
    """The engine failed this one request (others continue)."""

    status_code = 500
    error_type = "server_error"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    status_code: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status_code, headers=headers)


def to_api_error(exc: Exception) -> APIError:
    """Map the engine's refusals onto API errors; anything else is a 500 without details."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return BadRequestError(exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return ServiceUnavailableError(f"{exc}; retry later", code="queue_full")
    if isinstance(exc, EngineDeadError):  # its reason is in the log: no internals in a public reply
        return ServiceUnavailableError(
            "the engine stopped after an internal error; the server must be restarted", code="engine_dead"
        )
    return EngineError("internal server error", code="internal_error")


def api_error_response(exc: APIError) -> JSONResponse:
    return error_response(exc.status_code, exc.message, exc.error_type, exc.param, exc.code, exc.headers)


# -- schema errors: 422 becomes 400 with `param` ---------------------------------

_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Segments pydantic adds for union members and validators, which name no field.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


def loc_to_param(loc: Sequence[str | int]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
        else:
            break  # a union tag such as "list[int]" or "function-after[...]"
    return param or None


def validation_message(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    located: Any = (first.get("ctx") or {}).get("error")
    if hasattr(located, "param"):  # a whole-body check that names the field itself (server.protocol)
        return str(located), located.param
    if tuple(first.get("loc", ())) in (("body",), ()):  # the body itself (a nested non-object names its field)
        if isinstance(first.get("input"), (bytes, str)):
            return "the request body must be a JSON object sent with 'Content-Type: application/json'", None
        return "the request body must be a JSON object", None
    param = loc_to_param(first.get("loc", ()))
    message = f"{param or 'body'}: {first.get('msg', 'invalid value').removeprefix('Value error, ')}"
    if len(errors) > 1:
        others = {loc_to_param(e.get("loc", ())) or "body" for e in errors[1:]} - {param or "body"}
        if others:
            message += f" (also invalid: {', '.join(sorted(others)[:3])})"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return api_error_response(to_api_error(exc))

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        return api_error_response(to_api_error(exc))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return api_error_response(to_api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _schema(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail) or HTTPStatus(exc.status_code).phrase
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, message, error_type, code=code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return api_error_response(to_api_error(exc))
