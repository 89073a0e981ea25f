"""The app side of masrl's HTTP service: a FastAPI app whose every answer is JSON in the server's own error shape.

    app = json_app("my server", error_body, api="the API is POST /a and GET /b")
    add_route(app, "/a", endpoint, "POST")   # one method per route: any other is a JSON 405 with Allow

- ``json_app``: an unknown path is a JSON 404, a method a route does not serve a JSON 405 with ``Allow`` (HEAD,
  PUT, DELETE, PATCH, OPTIONS, ...), each naming the request and ``api``;
- ``add_route``: a plain route (a request in, a response out: no parameter parsing to pay per call) serving one
  method (no HEAD added to a GET).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from masrl.http.guard import plain_error


def json_app(title: str, error_body: Callable[[int, str], Any] = plain_error, api: str = "") -> FastAPI:
    """A FastAPI app (no docs pages) answering the router's errors as ``error_body(status, message)``."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = f"{exc.detail}: {request.method} {request.url.path}" + (f"; {api}" if api else "")
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    return app


def add_route(app: FastAPI, path: str, endpoint: Callable[[Request], Awaitable[Any]], method: str) -> None:
    """``endpoint(request)`` on ``path`` for ``method`` alone."""
    served = Route(path, endpoint, methods=[method], include_in_schema=False)
    served.methods.discard("HEAD")  # starlette adds HEAD to a GET route: answered with 405 like any other method
    app.router.routes.append(served)

