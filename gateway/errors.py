"""One error tree: each error knows its HTTP status and OpenAI error type.

`to_body()` is the single place an error becomes the JSON a client sees, in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, which the official SDKs turn into their typed
exceptions (BadRequestError, AuthenticationError, NotFoundError, RateLimitError, ...).
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = [
    "shown",
    "GatewayError",
    "BadRequest",
    "PayloadTooLarge",
    "Unauthorized",
    "Forbidden",
    "Conflict",
    "ModelNotFound",
    "NotFound",
    "RateLimited",
    "UpstreamError",
    "UpstreamTimeout",
    "Unavailable",
    "UpstreamRejected",
    "AllBackendsFailed",
    "InternalError",
]


def shown(value: str, limit: int = 200) -> str:
    """A caller's value as an error message quotes it: its repr, cut to `limit` characters (a
    megabyte model name must not come back as a megabyte error)."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"... ({len(value)} characters)"


class GatewayError(Exception):
    """Base of every error the gateway answers with."""

    status: int = 500
    type: str = "api_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_body(self) -> bytes:
        return orjson.dumps(self.to_dict())

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        # Retry-After is whole seconds; never advertise 0, which invites an immediate hammer.
        return {"Retry-After": str(max(1, int(self.retry_after_s + 0.999)))}


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "model_not_allowed"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(GatewayError):
    """The request is valid but the state it acts on does not allow it (a revoked key, a full table)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class UpstreamError(GatewayError):
    """A backend failed (connection, 5xx, malformed answer, cut stream)."""

    status = 502
    type = "api_error"
    code = "upstream_error"

    def __init__(self, message: str, *, upstream_status: int | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        # The backend's own HTTP status when it answered one (a 404: it does not hold what was
        # asked for); `status` stays what the gateway answers.
        self.upstream_status = upstream_status


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class Unavailable(GatewayError):
    status = 503
    type = "api_error"
    code = "service_unavailable"


class UpstreamRejected(GatewayError):
    """A backend answered a 4xx about the request itself (context length, content filter):
    passed back as the backend said it, never retried on another backend."""

    def __init__(self, status: int, body: bytes, backend: str, *, context_length: bool = False) -> None:
        super().__init__(f"backend {backend!r} rejected the request with HTTP {status}")
        self.status = status
        self.backend = backend
        self.raw_body = body
        self.context_length = context_length  # the prompt does not fit: a larger-context backend may answer

    def to_body(self) -> bytes:
        try:
            parsed = orjson.loads(self.raw_body)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return self.raw_body
        text = self.raw_body[:500].decode("utf-8", "replace")
        return orjson.dumps(
            {
                "error": {
                    "message": f"{self.message}: {text}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "upstream_rejected",
                }
            }
        )


class InternalError(GatewayError):
    """A bug in the gateway: answered in the contract, with the request id to find the traceback."""

    status = 500
    type = "gateway_error"
    code = "internal_error"


class AllBackendsFailed(GatewayError):
    """Every candidate failed before the first byte; the message lists each failure."""

    def __init__(self, failures: list[tuple[str, GatewayError]], *, deadline_hit: bool = False) -> None:
        detail = "; ".join(f"{name}: {err.message}" for name, err in failures) or "no candidate"
        head = "the request's deadline passed" if deadline_hit else "all backends failed"
        super().__init__(f"{head} ({detail})")
        self.failures = failures
        statuses = {err.status for _, err in failures}
        if deadline_hit or statuses == {504}:
            self.status, self.code = 504, "upstream_timeout"
        elif failures and all(isinstance(err, (RateLimited, Unavailable)) for _, err in failures):
            # Every backend is cooling down or full: tell the client when to come back.
            self.status = 429 if all(isinstance(e, RateLimited) for _, e in failures) else 503
            self.code = "backends_busy"
            self.type = "rate_limit_error" if self.status == 429 else "api_error"
            waits = [e.retry_after_s for _, e in failures if e.retry_after_s is not None]
            self.retry_after_s = min(waits) if waits else None
        else:
            self.status, self.code = 502, "upstream_error"
