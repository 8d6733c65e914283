"""HTTP errors, and the body each API family uses to report them.

Every failure inside the gateway is an `ApiError` (status, message, machine-readable code); the
middleware renders it in the shape of the API the client called, so each client library shows
its user our message:

    openai   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}   /v1/embeddings, /v1/score
    tei      {"error": ..., "error_type": ...}                                   /embed, /rerank, ...
    cohere   {"message": ...}                                                    /v1/rerank
"""

from __future__ import annotations

from typing import Literal

Family = Literal["openai", "tei", "cohere"]

# TEI's error_type names; its status codes are not used (TEI answers 413/422 for bad input).
_TEI_TYPES = {400: "Validation", 401: "Unauthorized", 404: "NotFound", 405: "NotFound", 413: "Validation",
              429: "Overloaded", 500: "Backend", 502: "Backend", 503: "Unhealthy", 504: "Backend"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                 500: "server_error", 502: "server_error", 503: "server_error", 504: "server_error"}


class ApiError(Exception):
    """A request that cannot be served; `message` says what went wrong and what to do."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = status, message, param, retry_after_s
        self.code = code or _DEFAULT_CODES.get(status, "error")


_DEFAULT_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                  413: "payload_too_large", 429: "overloaded", 500: "internal_error", 502: "bad_engine_response",
                  503: "no_healthy_replica", 504: "timeout"}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def error_body(family: Family, e: ApiError) -> dict:
    if family == "openai":
        return {"error": {"message": e.message, "type": _OPENAI_TYPES.get(e.status, "server_error"), "param": e.param, "code": e.code}}
    if family == "cohere":
        return {"message": e.message}
    return {"error": e.message, "error_type": _TEI_TYPES.get(e.status, "Backend")}


def family_of_path(path: str) -> Family:
    """The family of a path no route matched (unknown routes, wrong methods)."""
    if path.startswith("/v1/rerank"):
        return "cohere"
    return "openai" if path.startswith("/v1/") else "tei"
