"""The browser playground: `/` and `/playground/*` serve the hand-written page in `playground/`
(package data, no build step, nothing loaded from another origin).

Model output is untrusted, so the page is served with a Content-Security-Policy that allows only
this origin's scripts and styles (no inline script, no eval), no framing, no plugins, and
`nosniff`; the page itself only ever inserts model text as text nodes. The API key is never part of
a URL: the page sends it as a bearer token from its settings."""
from __future__ import annotations

import os

PLAYGROUND_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "playground")
FILES = {"index.html": "text/html; charset=utf-8", "playground.js": "text/javascript; charset=utf-8",
         "markdown.js": "text/javascript; charset=utf-8", "playground.css": "text/css; charset=utf-8"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def add_playground_routes(app) -> None:
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException

    def serve(name: str) -> Response:
        if name not in FILES:
            raise HTTPException(404, f"no playground file {name!r}")
        with open(os.path.join(PLAYGROUND_DIR, name), "rb") as f:
            return Response(f.read(), media_type=FILES[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def playground_index():
        return serve("index.html")

    @app.get("/playground/{name}", include_in_schema=False)
    async def playground_file(name: str):
        return serve(name)
