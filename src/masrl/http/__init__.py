"""The HTTP service masrl's servers run on (the gateway, docs/gateway.md; ``masrl serve --team``,
docs/harnesses.md; the retrieval server, docs/search.md): FastAPI behind uvicorn (httptools' parser and
uvloop where installed, else h11 and asyncio's loop), in a thread of the server's own.

- ``masrl.http.guard``: the connection guard under the app (a deadline on the whole request head,
  connection limits, malformed HTTP answered in the server's JSON error shape, hang-ups logged at debug level);
- ``masrl.http.app``: the app: one-method routes served straight to their endpoints, every other request to a
  FastAPI router whose errors (404, 405 with ``Allow``) are JSON in the server's shape;
- ``masrl.http.server``: the listening socket (IPv4 or IPv6, one clear line when it cannot bind, naming
  the setting the user gave), the server thread, and the request body read within a size and a deadline.

These modules need the ``server`` extra (``pip install masrl[server]``: fastapi, uvicorn, httptools, uvloop);
this package imports none of them until one is imported.
"""
