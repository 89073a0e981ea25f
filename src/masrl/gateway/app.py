"""The gateway's FastAPI app: its three routes (bare, and under ``/e/<key>`` where the path names the episode),
and every other answer in OpenAI's error shape: an unknown path is a JSON 404, a method a route does not serve
a JSON 405 with ``Allow`` (HEAD, PUT, DELETE, PATCH, OPTIONS, ...)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request

from masrl.gateway.errors import error_body
from masrl.http.app import JsonApp, add_route, json_app

if TYPE_CHECKING:
    from masrl.gateway.server import Gateway

CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
API = f"the gateway serves POST {CHAT}, POST {COMPLETIONS} and GET {MODELS}"


def create_app(gateway: "Gateway") -> JsonApp:
    app = json_app("masrl gateway", error_body, API)
    for route, method in ((CHAT, "POST"), (COMPLETIONS, "POST"), (MODELS, "GET")):
        for path in (route, "/e/{key}" + route):  # the key: the path's, or else the Authorization header's
            add_route(app, path, _endpoint(gateway, route), method)
    return app


def _endpoint(gateway: "Gateway", route: str):
    async def endpoint(request: Request):
        return await gateway.serve(request, route, request.path_params.get("key"))

    return endpoint
