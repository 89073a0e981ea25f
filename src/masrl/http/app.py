"""The app side of masrl's HTTP service: an ASGI app whose every answer is JSON in the server's own error shape.

    app = json_app("my server", error_body, api="the API is POST /a and GET /b")
    add_route(app, "/a", endpoint, "POST")   # one method per route: any other is a JSON 405 with Allow

- ``json_app``: a ``JsonApp``. A request for a route's path and method goes straight to its endpoint (no
  middleware, no parameter parsing to pay per call); every other request goes to a FastAPI app whose router
  answers in ``error_body``'s shape: an unknown path is a JSON 404, a method a route does not serve a JSON 405
  with ``Allow`` (HEAD, PUT, DELETE, PATCH, OPTIONS, ...), each naming the request and ``api``;
- ``add_route``: a plain route (a request in, a response out) serving one method (no HEAD added to a GET).
"""
from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from masrl.http.guard import plain_error

log = logging.getLogger("masrl.http")


class JsonApp:
    """The ASGI app of one server: its routes served directly, anything else by ``fallback`` (FastAPI), whose
    router answers unknown paths and methods as JSON errors."""

    def __init__(self, fallback: FastAPI, error_body: Callable[[int, str], Any]):
        self.fallback, self.error_body = fallback, error_body
        self.routes: list[Route] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            for route in self.routes:
                match = route.path_regex.match(scope["path"])
                if match is not None and scope["method"] in route.methods:
                    scope["path_params"] = {name: route.param_convertors[name].convert(value)
                                            for name, value in match.groupdict().items()}
                    await self._serve(route, scope, receive, send)
                    return
        await self.fallback(scope, receive, send)

    async def _serve(self, route: Route, scope, receive, send) -> None:
        try:
            response = await route.endpoint(Request(scope, receive))
        except Exception as e:  # noqa: BLE001 - an endpoint's own failure is a JSON 500 and an error line
            log.error("%s %s failed", scope["method"], scope["path"], exc_info=e)
            response = JSONResponse(self.error_body(500, f"{type(e).__name__}: {str(e)[:500]}"), status_code=500)
        await response(scope, receive, send)


def json_app(title: str, error_body: Callable[[int, str], Any] = plain_error, api: str = "") -> JsonApp:
    """The app (no docs pages) answering the router's errors as ``error_body(status, message)``."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = f"{exc.detail}: {request.method} {request.url.path}" + (f"; {api}" if api else "")
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    return JsonApp(app, error_body)


def add_route(app: JsonApp, path: str, endpoint: Callable[[Request], Awaitable[Any]], method: str) -> None:
    """``endpoint(request)`` on ``path`` for ``method`` alone."""
    served = Route(path, endpoint, methods=[method], include_in_schema=False)
    served.methods.discard("HEAD")  # starlette adds HEAD to a GET route: answered with 405 like any other method
    app.routes.append(served)
    app.fallback.router.routes.append(served)  # the router's 405 names the methods the path serves (Allow)
