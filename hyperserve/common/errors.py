"""OpenAI-style errors: the APIError type and the handlers that turn every failure into its body."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("hyperserve.errors")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_body(cls, status: int, body: Any) -> APIError:
        """Another server's OpenAI-style error answer, to pass on as it came (a body of another
        shape: its text, as a server error)."""
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return cls(status, str(body)[:1000], type_="server_error")
        return cls(status, str(error.get("message")), str(error.get("type") or "invalid_request_error"),
                   error.get("param"), error.get("code"))


def unavailable(message: str, retry_after_s: int = 5) -> APIError:
    """503 with Retry-After: the service cannot take the request now (loading, draining, engine down)."""
    return APIError(503, message, type_="service_unavailable", headers={"Retry-After": str(retry_after_s)})


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body: client mistakes as 4xx, anything else as a 500
    that names the failure (and is logged) rather than a bare traceback page."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_body(error.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        body = APIError(error.status_code, str(error.detail)).body()
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        body = APIError(500, f"internal error: {type(error).__name__}", type_="server_error").body()
        return JSONResponse(body, status_code=500)


def validation_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """pydantic's errors as one OpenAI-style 400 body; `param` names the top-level field."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}").body()
    location = [str(part) for part in first.get("loc", []) if part != "body"]
    param = location[0] if location else None
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', []) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors)
    return APIError(400, message, param=param).body()
