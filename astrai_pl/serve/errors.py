"""Every error the server sends, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers turn what a request can raise — our `APIError`, a refused `SamplingParams` field, an unknown route
or method, a validation error, anything unforeseen — into that body with its HTTP status, so a client's
error path is the same whatever went wrong, and the server goes on serving.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..inference import SamplingParamsError

log = logging.getLogger("astrai_pl.serve")


class APIError(Exception):
    """A refusal the client can act on: HTTP `status` and OpenAI's error fields (`param`: the request field)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


def from_sampling_error(err: SamplingParamsError, names: dict[str, str] | None = None) -> APIError:
    """A 400 naming the request field behind the refused SamplingParams field (`names`: engine → request name)."""
    found = _SAMPLING_FIELD.search(str(err))
    field = found.group(1) if found else None
    param = (names or {}).get(field, field)
    message = str(err).replace(f"SamplingParams.{field}", param) if field else str(err)
    return bad_request(message, param)


def field_path(loc) -> str | None:
    """pydantic's error location as a request field path: ("body", "messages", 0, "role") → messages[0].role."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def from_validation_errors(errors) -> APIError:
    """A 400 for the first pydantic error: the field, what it should be, and what came."""
    first = errors[0]
    param = field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON ({first.get('msg')}); send a JSON object")
    got = type(first.get("input")).__name__ if "input" in first else None
    where = f"'{param}'" if param else "the request body"
    seen = f" (got {_json_kind(got)})" if got else ""
    return bad_request(f"{where}: {first.get('msg', 'invalid value')}{seen}", param)


def _json_kind(python_type: str) -> str:
    return {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "list": "an array",
            "dict": "an object", "NoneType": "null"}.get(python_type, python_type)


_STATUS_TEXT = {404: "not found", 405: "method not allowed"}


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception of a request to an OpenAI-shaped JSON error."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        refusal = from_validation_errors(err.errors())
        return JSONResponse(refusal.body(), status_code=refusal.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        if err.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models and POST /v1/completions"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(err.detail)
        code = _STATUS_TEXT.get(err.status_code, "http_error").replace(" ", "_")
        return JSONResponse(error_body(message, "invalid_request_error", None, code), status_code=err.status_code,
                            headers=getattr(err, "headers", None))


def internal_error(err: Exception) -> JSONResponse:
    """The 500 for an exception no handler knows; the traceback goes to the log, not to the client."""
    log.error("internal error", exc_info=err)
    return JSONResponse(error_body(f"internal server error ({type(err).__name__}); the server goes on serving",
                                   "server_error"), status_code=500)
