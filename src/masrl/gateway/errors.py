"""The gateway's errors, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from http import HTTPStatus

# the code of a status the app or the connection guard answers without a GatewayError of its own
CODES = {400: None, 404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "body_too_large",
         503: "server_busy"}


class GatewayError(Exception):
    """A request the gateway refuses: an HTTP status, OpenAI's error type and code, and a message."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.kind, self.param = status, code, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def error_body(status: int, message: str) -> dict:
    """The body of an error answered by status alone (the connection guard's, the router's) in OpenAI's shape."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    code = CODES.get(status, HTTPStatus(status).phrase.lower().replace(" ", "_"))
    return GatewayError(status, message, code, kind=kind).body()
