"""Errors as OpenAI's API gives them: ``{"error": {"message", "type", "param", "code"}}``
with the HTTP status that fits, for every bad request (never a 500 or a dropped
connection), and the exception handlers that produce them.

Types and codes follow OpenAI's (``invalid_request_error``, ``authentication_error``,
``context_length_exceeded``); a prompt longer than the context also carries llama.cpp
server's ``n_prompt_tokens`` and ``n_ctx``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("specgguf.server")


class APIError(Exception):
    """An error response: HTTP ``status``, a message a client can act on, OpenAI's
    ``type``, the request field at fault (``param``), a machine-readable ``code``, and
    ``extra`` fields added to the error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers
        self.extra = extra

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        err = {"message": self.message, "type": self.type, "param": self.param,
               "code": self.code, **self.extra}  # fmt: skip
        return {"error": err}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str | None = None) -> APIError:
    """A 400 for a feature this server does not have (yet)."""
    return APIError(
        400, f"{what or param} is not supported by this server", param=param,
        code="unsupported_parameter",
    )  # fmt: skip


_STATUS_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    503: "server_error",
}


#: Tags pydantic puts in an error's location for the member of a union that failed.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 for the first problem pydantic found (its ``errors()``), with the field's
    path as ``param`` (``messages.0.role``)."""
    if not errors:
        return bad_request("the request body is not valid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        msg = str(first.get("msg", "")).removeprefix("Invalid JSON: ")
        # jiter's words for a \uD800-\uDFFF escape that is not half of a pair
        msg = msg.replace("unexpected end of hex escape", "a lone UTF-16 surrogate escape")
        return bad_request(f"the request body is not valid JSON: {msg}")
    params = list(dict.fromkeys(_param(e.get("loc", ())) for e in errors))
    param = params[0]
    # (a validator's own ValueError comes back as "Value error, <its words>")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        return bad_request(f"the request body: {msg}")
    more = f" (and {len(params) - 1} more)" if len(params) > 1 else ""
    return bad_request(f"{param}: {msg}{more}", param=param)


def _param(loc: Sequence[Any]) -> str | None:
    """A field's path from pydantic's location, without the union members' tags."""
    parts = [
        str(p) for p in loc
        if p != "body" and not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p))
    ]  # fmt: skip
    return ".".join(parts) or None


def refused(method: str, path: str, err: APIError) -> JSONResponse:
    """``err``'s response, and its line in the log (the message names fields and numbers,
    never a prompt's text; the path with its control characters escaped, so that a
    request cannot write lines of its own into the log)."""
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in path)
    log.info("%s %s: %d %s", method, shown, err.status, err.message)
    return err.response()


def install_handlers(app: FastAPI) -> None:
    """Map every error to OpenAI's shape: :class:`APIError`, pydantic's validation errors
    (400), Starlette's HTTP errors (404, 405, ...) and, as a last resort, any other
    exception (500, logged)."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return refused(request.method, request.url.path, exc)

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return refused(request.method, request.url.path, validation_error(exc.errors()))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        err = APIError(
            status, str(exc.detail), type=_STATUS_TYPES.get(status, "invalid_request_error")
        )
        err.headers = dict(exc.headers or {})
        return refused(request.method, request.url.path, err)

    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(exc).__name__, exc, exc_info=exc)
        return APIError(500, "internal server error", type="server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal)
