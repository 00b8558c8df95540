"""The dashboard's routes: the HTML shell at `/` and its assets under `/static/`.

Auth choice (docs/dashboard.md): the shell and the assets are served openly because they hold
no data; the page's JavaScript reads the JSON API (`/v1/tasks`, `/v1/tasks/{id}`,
`/v1/tasks/{id}/stats`) with a bearer token the operator types once, kept in the tab's
sessionStorage. So the dashboard adds no unauthenticated data path to the coordinator.

Everything is served from the package (no CDN, no web fonts): coordinators often run on
machines without internet, and a strict Content-Security-Policy keeps the page from loading or
sending anything anywhere but its own origin.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
PAGE = "dashboard.html"

MEDIA_TYPES: dict[str, str] = {
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}
# A flat namespace of plain names: no separators or dots beyond the extension, so no request
# can climb out of STATIC_DIR whatever the platform's path rules.
_ASSET_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\.(css|js|png|svg)$")

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Small files that change with each release: revalidate rather than serve a stale page.
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False, tags=["dashboard"])


@router.get("/")
def dashboard_page() -> FileResponse:
    """The dashboard's HTML shell (no data in it; the page fetches the API with a token)."""
    return FileResponse(STATIC_DIR / PAGE, media_type=MEDIA_TYPES[".html"],
                        headers=SECURITY_HEADERS)


@router.get("/static/{name}")
def dashboard_asset(name: str) -> FileResponse:
    """One of the dashboard's own files (scripts, stylesheet, images)."""
    path = STATIC_DIR / name
    if not _ASSET_NAME.fullmatch(name) or not path.is_file():
        raise HTTPException(status_code=404, detail=f"no dashboard asset named {name!r}")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=SECURITY_HEADERS)
