"""The chat playground: one self-contained page (package data) served at / and /playground.

The page itself needs no key; the API calls it makes from the browser carry
the one its user types. Its Content-Security-Policy lets it reach only this
server, so it works offline and can load nothing from elsewhere.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; connect-src 'self'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def playground_page() -> str:
    return files("server").joinpath("static", "playground.html").read_text(encoding="utf-8")


def playground_router() -> APIRouter:
    page = playground_page()  # read once: it never changes while the server runs
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    @router.get("/playground", include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(page, headers=PAGE_HEADERS)

    return router
