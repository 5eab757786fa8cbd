"""Errors a client can cause, and the JSON bodies they become (TGI's shape; OpenAI's under /v1; Anthropic's under
/v1/messages)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, error_type: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.headers = headers or {}


class GenerationFailed(APIError):
    """A request that failed after it was accepted; counted in the metrics where it happened."""


OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error", 503: "server_unavailable", 500: "server_error",
                504: "timeout"}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                   503: "overloaded_error", 504: "timeout_error"}


def error_body(path: str, status: int, message: str, error_type: str) -> dict:
    if path.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    if path.startswith("/v1"):
        return {"error": {"message": message, "type": OPENAI_TYPES.get(status, error_type), "param": None,
                          "code": error_type}}
    return {"error": message, "error_type": error_type}


def error_response(path: str, status: int, message: str, error_type: str, headers=None) -> JSONResponse:
    # OpenAI's and Anthropic's clients expect 400 where TGI uses 422 for a bad request.
    if path.startswith("/v1") and status == 422:
        status = 400
    return JSONResponse(error_body(path, status, message, error_type), status_code=status, headers=headers)
