"""The gateway's FastAPI app: its three routes (bare, and under ``/e/<key>`` where the path names the episode),
and every other answer in OpenAI's error shape: an unknown path is a JSON 404, a method a route does not serve
a JSON 405 with ``Allow`` (HEAD, PUT, DELETE, PATCH, OPTIONS, ...)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from masrl.gateway.errors import error_body

if TYPE_CHECKING:
    from masrl.gateway.server import Gateway

CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
API = f"the gateway serves POST {CHAT}, POST {COMPLETIONS} and GET {MODELS}"


def create_app(gateway: "Gateway") -> FastAPI:
    app = FastAPI(title="masrl gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = f"{exc.detail}: {request.method} {request.url.path}; {API}"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    # plain routes (a request in, a response out: no parameter parsing to pay per call), each serving one method
    for route, method in ((CHAT, "POST"), (COMPLETIONS, "POST"), (MODELS, "GET")):
        for path in (route, "/e/{key}" + route):  # the key: the path's, or else the Authorization header's
            served = Route(path, _endpoint(gateway, route), methods=[method], include_in_schema=False)
            served.methods.discard("HEAD")  # starlette adds HEAD to a GET route: the gateway answers HEAD with 405
            app.router.routes.append(served)
    return app


def _endpoint(gateway: "Gateway", route: str):
    async def endpoint(request: Request):
        return await gateway.serve(request, route, request.path_params.get("key"))

    return endpoint
