"""The gateway's errors, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, and ``answer``, which
turns a request's handling into one JSON response (the gateway's and ``masrl serve --team``'s)."""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)

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


async def answer(request: Any, serve: Callable[[Callable[[], Awaitable[bytes]]], Awaitable[dict]], *,
                 max_body_bytes: int, body_timeout_s: float) -> Any:
    """The JSON response to ``request``: ``await serve(read)``, where ``await read()`` is the request's body (within
    ``max_body_bytes`` and ``body_timeout_s``: ``masrl.http.server.read_body``); every failure is one JSON error in
    OpenAI's shape (a ``GatewayError`` its own, a body refused 413 / 408 closing the connection, any other
    exception a 500), and a client that hung up while sending its body is answered nobody."""
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse

    from masrl.http.server import BodyError, read_body

    headers = None
    try:
        status, payload = 200, await serve(lambda: read_body(request, max_body_bytes, body_timeout_s))
    except BodyError as e:  # the rest of the body is unread: close the connection after answering
        status, payload = e.status, GatewayError(e.status, e.message, CODES.get(e.status)).body()
        headers = {"Connection": "close"}
    except ClientDisconnect:  # nobody to answer
        log.debug("a client hung up while sending its request")
        return JSONResponse({}, status_code=400)
    except GatewayError as e:
        status, payload = e.status, e.body()
    except Exception as e:  # noqa: BLE001 - a failed request is one JSON error, never a dropped connection
        status, payload = 500, GatewayError(500, f"{type(e).__name__}: {str(e)[:500]}", "internal_error",
                                            kind="server_error").body()
    return JSONResponse(payload, status_code=status, headers=headers)
