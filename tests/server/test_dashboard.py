"""The dashboard's routes: the page and its assets are served openly, safely and self-contained."""

from __future__ import annotations

import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from seedfed.server.dashboard import STATIC_DIR, router
from seedfed.server.dashboard.routes import CONTENT_SECURITY_POLICY

SVG_NAMESPACE = "http://www.w3.org/2000/svg"


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    app.include_router(router)
    return TestClient(app)


def test_page_is_served_without_a_token_and_with_a_strict_policy(client: TestClient) -> None:
    # Act
    res = client.get("/")

    # Assert
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("text/html")
    assert res.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    assert "connect-src 'self'" in CONTENT_SECURITY_POLICY
    assert res.headers["x-content-type-options"] == "nosniff"
    assert 'id="chart-bytes"' in res.text


def test_every_asset_the_page_references_is_served_with_its_type(client: TestClient) -> None:
    # Arrange
    page = client.get("/").text
    refs = re.findall(r'(?:src|href)="(static/[^"]+)"', page)
    expected = {".js": "text/javascript", ".css": "text/css"}

    # Act
    responses = {ref: client.get("/" + ref) for ref in refs}

    # Assert
    assert {r.rsplit(".", 1)[1] for r in refs} == {"js", "css"}
    for ref, res in responses.items():
        assert res.status_code == 200, ref
        assert res.headers["content-type"].startswith(expected["." + ref.rsplit(".", 1)[1]])
        assert res.content == (STATIC_DIR / ref.removeprefix("static/")).read_bytes()


@pytest.mark.parametrize("name", ["missing.js", "..%2Fsettings.py", "dashboard.html",
                                  ".hidden.js", "a.b.js", "x" * 65 + ".js", "charts.js.map"])
def test_unknown_or_unsafe_asset_names_are_404(client: TestClient, name: str) -> None:
    # Act
    res = client.get(f"/static/{name}")

    # Assert
    assert res.status_code == 404
    assert "no dashboard asset" in res.json()["detail"] or res.json()["detail"] == "Not Found"


def test_path_traversal_does_not_leave_the_static_folder(client: TestClient) -> None:
    # Act
    res = client.get("/static/../dashboard/routes.py")
    encoded = client.get("/static/%2E%2E%2Fdashboard%2Froutes.py")

    # Assert
    assert res.status_code == 404
    assert encoded.status_code == 404
    assert "CONTENT_SECURITY_POLICY" not in res.text + encoded.text


def test_assets_load_nothing_from_another_origin() -> None:
    # Arrange: the coordinator may run offline; only the SVG namespace URI may appear.
    files = sorted(p for p in STATIC_DIR.iterdir() if p.suffix in (".html", ".js", ".css"))

    # Act
    offenders = {p.name: re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"')]*", p.read_text())
                 for p in files}

    # Assert
    assert {p.name for p in files} >= {"dashboard.html", "dashboard.js", "charts.js",
                                       "dashboard.css"}
    for name, urls in offenders.items():
        assert [u for u in urls if u != SVG_NAMESPACE] == [], name
