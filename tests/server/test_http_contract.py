"""The coordinator's HTTP contract: out-of-range numbers and unstorable strings are 4xx with
the app's error body (never a 500 with a traceback), on SQLite and PostgreSQL; the OpenAPI
document lists every route, both upload bodies, each status a route returns with the real
error schema, and the parameters' ranges."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from httpx import Response
from pydantic import BaseModel
from seedfed.server.api.openapi import ErrorBody, install
from seedfed.server.app import create_app
from seedfed.server.orm import DeviceRow, RoundRow, TaskRow, UploadRow, VersionRow
from seedfed.shared.protocol.wire import RoundPlan, Upload, pack_binary
from sqlalchemy import func, select

from tests.server.conftest import ServedTask, _reset_pg, make_settings, tiny_spec
from tests.server.test_api import ADMIN, bearer

BIG = 2**63  # the smallest integer neither SQLite nor PostgreSQL can bind


@dataclass
class World(ServedTask):
    token: str
    plan: RoundPlan
    spec: dict[str, Any]


def _world(url: str, store: Path, tiny_bert: Path, **over: object) -> Iterator[World]:
    spec = tiny_spec(tiny_bert).to_dict()
    with TestClient(create_app(make_settings(url, store, **over)),
                    raise_server_exceptions=False) as client:
        r = client.post("/v1/tasks", json={"spec": spec, "quorum": 5}, headers=ADMIN)
        assert r.status_code == 201, r.text
        task_id, join = r.json()["task_id"], r.json()["join_token"]
        token = client.post(f"/v1/tasks/{task_id}/devices", json={"join_token": join}
                            ).json()["token"]
        plan = RoundPlan.model_validate(client.post(f"/v1/tasks/{task_id}/rounds",
                                                    headers=ADMIN).json())
        yield World(client, client.app.state.runtime, task_id, join, token, plan, spec)


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql",
                                                               marks=pytest.mark.postgres)])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          tiny_bert: Path) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("contract")
    if request.param == "sqlite":
        url = f"sqlite:///{tmp / 'c.db'}"
    else:
        url = request.getfixturevalue("pg_server_url")
        _reset_pg(url)
    yield from _world(url, tmp / "store", tiny_bert)


@pytest.fixture(scope="module")
def slow_path(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> Iterator[World]:
    """The upload route without the ASGI fast path (the FastAPI route answers)."""
    tmp = tmp_path_factory.mktemp("contract-route")
    yield from _world(f"sqlite:///{tmp / 'c.db'}", tmp / "store", tiny_bert,
                      upload_fast_path=False)


def rows(w: World) -> tuple[int, ...]:
    with w.rt.transaction() as s:
        return tuple(s.scalar(select(func.count()).select_from(t)) or 0
                     for t in (TaskRow, DeviceRow, RoundRow, UploadRow, VersionRow))


def upload_doc(w: World, **update: object) -> str:
    doc = json.loads(Upload.build(w.plan, np.zeros((w.plan.steps, w.plan.perturbations)), 3,
                                  0.5).model_dump_json())
    return json.dumps({**doc, **update})


def binary(w: World, **headers: str) -> dict[str, Any]:
    return {"content": pack_binary(np.zeros((w.plan.steps, w.plan.perturbations))),
            "headers": {**bearer(w.token), "Content-Type": "application/octet-stream",
                        "X-Seedfed-Version": str(w.plan.version), "X-Seedfed-Num-Examples": "3",
                        "X-Seedfed-Loss": "0.5", **headers}}


def create(w: World, raw: str) -> Response:
    return w.client.post("/v1/tasks", content=raw.encode("utf-8", "surrogatepass"),
                         headers={**ADMIN, "Content-Type": "application/json"})


JSON = {"Content-Type": "application/json"}
# Each was a 500 (and a traceback in the log) before; `text` is what the 4xx must name.
CASES: dict[str, tuple[Callable[[World], Response], int, str]] = {
    "upload to round 2**63": (lambda w: w.client.post(
        f"/v1/tasks/{w.task_id}/rounds/{BIG}/uploads", content=upload_doc(w, round=BIG),
        headers={**bearer(w.token), **JSON}), 422, "round_number"),
    "close round 2**63": (lambda w: w.client.post(f"/v1/tasks/{w.task_id}/rounds/{BIG}/close",
                                                  headers=ADMIN), 422, "round_number"),
    "snapshot of version 2**63": (lambda w: w.client.get(
        f"/v1/tasks/{w.task_id}/snapshots/{BIG}", headers=ADMIN), 422, "version"),
    "log since 2**63": (lambda w: w.client.get(f"/v1/tasks/{w.task_id}/log",
                                               params={"since": BIG}, headers=ADMIN), 422,
                        "since"),
    "catch-up from 2**63": (lambda w: w.client.get(f"/v1/tasks/{w.task_id}/catchup",
                                                   params={"from": BIG}, headers=ADMIN), 422,
                            "from"),
    "catch-up at a vanishing bandwidth": (lambda w: w.client.get(
        f"/v1/tasks/{w.task_id}/catchup", params={"from": 0, "bandwidth": 1e-320},
        headers=ADMIN), 422, "bandwidth"),
    "num_examples 2**63": (lambda w: w.client.post(
        f"/v1/tasks/{w.task_id}/rounds/{w.plan.round}/uploads",
        content=upload_doc(w, num_examples=BIG), headers={**bearer(w.token), **JSON}), 422,
        "num_examples"),
    "num_examples 2**31 (PostgreSQL INTEGER)": (lambda w: w.client.post(
        f"/v1/tasks/{w.task_id}/rounds/{w.plan.round}/uploads",
        content=upload_doc(w, num_examples=2**31), headers={**bearer(w.token), **JSON}), 422,
        "num_examples"),
    "binary num_examples 2**63": (lambda w: w.client.post(
        f"/v1/tasks/{w.task_id}/rounds/{w.plan.round}/uploads",
        **binary(w, **{"X-Seedfed-Num-Examples": str(BIG)})), 400, "num"),
    "quorum 2**63": (lambda w: w.client.post("/v1/tasks", json={"spec": w.spec, "quorum": BIG},
                                             headers=ADMIN), 422, "quorum"),
    "quorum 2**31": (lambda w: w.client.post("/v1/tasks", json={"spec": w.spec,
                                                                "quorum": 2**31},
                                             headers=ADMIN), 422, "quorum"),
    "round timeout past year 9999": (lambda w: w.client.post(
        "/v1/tasks", json={"spec": w.spec, "round_timeout_s": 1e308}, headers=ADMIN), 422,
        "round_timeout_s"),
    "lone surrogate in a join token": (lambda w: w.client.post(
        f"/v1/tasks/{w.task_id}/devices", content=b'{"join_token": "\\ud800"}', headers=JSON),
        422, "surrogate"),
    "lone surrogate in a task name": (lambda w: create(
        w, json.dumps({"spec": w.spec, "name": "\ud800"})), 422, "surrogate"),
    "lone surrogate inside the spec": (lambda w: create(
        w, json.dumps({"spec": {**w.spec, "model_path": "\udcff"}})), 422, "surrogate"),
    "a boolean as the quorum": (lambda w: w.client.post(
        "/v1/tasks", json={"spec": w.spec, "quorum": True}, headers=ADMIN), 422, "quorum"),
    "a boolean as a join token's max_devices": (lambda w: w.client.post(
        f"/v1/tasks/{w.task_id}/join-tokens", json={"max_devices": True}, headers=ADMIN), 422,
        "max_devices"),
    "NUL in a task name": (lambda w: w.client.post(
        "/v1/tasks", json={"spec": w.spec, "name": "a\x00b"}, headers=ADMIN), 422, "NUL"),
    "NUL in a task id": (lambda w: w.client.get("/v1/tasks/a%00b", headers=ADMIN), 422,
                         "task_id"),
    "NUL in an upload's task id": (lambda w: w.client.post(
        "/v1/tasks/a%00b/rounds/1/uploads", content=upload_doc(w),
        headers={**bearer(w.token), **JSON}), 422, "task_id"),
    "NUL in a device id": (lambda w: w.client.delete(
        f"/v1/tasks/{w.task_id}/devices/a%00b", headers=ADMIN), 422, "device_id"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_out_of_range_or_unstorable_input_is_a_4xx_with_the_error_body(
        world: World, case: str, caplog: pytest.LogCaptureFixture) -> None:
    send, code, text = CASES[case]
    before = rows(world)

    with caplog.at_level(logging.ERROR):
        r = send(world)

    assert r.status_code == code, r.text
    body = ErrorBody.model_validate(r.json())
    assert text in body.detail, body.detail
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert rows(world) == before


def test_the_upload_route_without_the_fast_path_refuses_round_2_63(slow_path: World) -> None:
    r = slow_path.client.post(f"/v1/tasks/{slow_path.task_id}/rounds/{BIG}/uploads",
                              content=upload_doc(slow_path, round=BIG),
                              headers={**bearer(slow_path.token), **JSON})

    assert r.status_code == 422, r.text
    assert ErrorBody.model_validate(r.json()).error == "RequestValidationError"


def test_an_upload_in_range_still_takes_both_paths(world: World, slow_path: World) -> None:
    for w in (world, slow_path):
        r = w.client.post(f"/v1/tasks/{w.task_id}/rounds/{w.plan.round}/uploads",
                          **binary(w))

        assert r.status_code == 200, r.text


# --- the OpenAPI document ---------------------------------------------------------------


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("openapi")
    with TestClient(create_app(make_settings(f"sqlite:///{tmp / 'c.db'}",
                                             tmp / "store"))) as client:
        out: dict[str, Any] = client.get("/openapi.json").json()
        return out


UPLOAD = "/v1/tasks/{task_id}/rounds/{round_number}/uploads"
# What each route can answer besides its success (see server/README.md, Errors).
STATUSES = {
    ("post", "/v1/tasks"): {201, 400, 401, 413, 422},
    ("get", "/v1/tasks"): {200, 401},
    ("get", "/v1/tasks/{task_id}"): {200, 401, 403, 404, 422},
    ("get", "/v1/tasks/{task_id}/spec"): {200, 401, 403, 404, 422},
    ("get", "/v1/tasks/{task_id}/stats"): {200, 401, 404, 422},
    ("get", "/v1/tasks/{task_id}/rounds"): {200, 401, 404, 422},
    ("get", "/v1/tasks/{task_id}/catchup"): {200, 401, 403, 404, 409, 422},
    ("patch", "/v1/tasks/{task_id}/schedule"): {200, 401, 404, 422},
    ("post", "/v1/tasks/{task_id}/devices"): {201, 400, 401, 403, 404, 413, 422},
    ("delete", "/v1/tasks/{task_id}/devices/{device_id}"): {204, 401, 404, 422},
    ("post", "/v1/tasks/{task_id}/rounds"): {201, 401, 404, 409, 422},
    ("get", "/v1/tasks/{task_id}/rounds/current"): {200, 401, 403, 404, 422},
    ("post", "/v1/tasks/{task_id}/rounds/{round_number}/close"): {200, 401, 404, 409, 422},
    ("post", "/v1/tasks/{task_id}/rounds/{round_number}/abandon"): {200, 401, 404, 409, 422},
    ("post", UPLOAD): {200, 400, 401, 403, 404, 409, 413, 422},
    ("get", "/v1/tasks/{task_id}/log"): {200, 401, 403, 404, 409, 422},
    ("get", "/v1/tasks/{task_id}/snapshots/{version}"): {200, 401, 403, 404, 422},
    ("get", "/readyz"): {200, 503},
}


def test_the_upload_route_documents_its_json_and_binary_bodies(doc: dict[str, Any]) -> None:
    op = doc["paths"][UPLOAD]["post"]

    content = op["requestBody"]["content"]
    assert set(content) == {"application/json", "application/octet-stream"}
    assert {"task_id", "round", "version", "shape", "scalars", "num_examples", "loss"} <= \
        set(content["application/json"]["schema"]["properties"])
    assert content["application/octet-stream"]["schema"]["format"] == "binary"
    assert {"X-Seedfed-Version", "X-Seedfed-Num-Examples", "X-Seedfed-Loss"} <= \
        {p["name"] for p in op["parameters"] if p["in"] == "header"}


@pytest.mark.parametrize("route", list(STATUSES), ids=" ".join)
def test_each_route_documents_the_statuses_it_returns(doc: dict[str, Any],
                                                      route: tuple[str, str]) -> None:
    method, path = route

    documented = {int(code) for code in doc["paths"][path][method]["responses"]}

    # 503: the database or the model store is unavailable (every /v1 route reads the database)
    assert STATUSES[route] | ({503} if path.startswith("/v1/") else set()) <= documented


def test_every_error_status_has_the_apps_error_body(doc: dict[str, Any]) -> None:
    refs = {resp["content"]["application/json"]["schema"].get("$ref")
            for ops in doc["paths"].values() for op in ops.values()
            for code, resp in op["responses"].items() if int(code) >= 400 and
            (code, op.get("operationId")) != ("503", "readyz_readyz_get")}

    assert refs == {"#/components/schemas/ErrorBody"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_parameter_ranges_are_in_the_document(doc: dict[str, Any]) -> None:
    def param(path: str, method: str, name: str) -> dict[str, Any]:
        (p,) = [p for p in doc["paths"][path][method]["parameters"] if p["name"] == name]
        return p["schema"]  # type: ignore[no-any-return]

    since = param("/v1/tasks/{task_id}/log", "get", "since")
    frm = param("/v1/tasks/{task_id}/catchup", "get", "from")
    rnd = param(UPLOAD, "post", "round_number")
    version = param("/v1/tasks/{task_id}/snapshots/{version}", "get", "version")
    bandwidth = param("/v1/tasks/{task_id}/catchup", "get", "bandwidth")

    for s in (since, frm, rnd, version):
        assert s["minimum"] == 0 and s["maximum"] == 2**31 - 1, s
    assert bandwidth["minimum"] >= 1 and bandwidth["maximum"] <= 1e15
    assert "pattern" in param("/v1/tasks/{task_id}", "get", "task_id")


@pytest.mark.parametrize("send", [
    lambda c: c.post("/v1/tasks/abc/devices", json={}),  # FastAPI's request validation
    lambda c: c.get("/v1/no/such/route"),  # Starlette's routing
    lambda c: c.put("/healthz"),  # method not allowed
    lambda c: c.post("/v1/tasks", content=b"[" * 100_000,  # nested beyond json's recursion
                     headers={**ADMIN, "Content-Type": "application/json"}),
], ids=["422 validation", "404 route", "405 method", "deep JSON"])
def test_framework_errors_answer_the_same_error_body(world: World,
                                                     send: Callable[[TestClient], Response]
                                                     ) -> None:
    r = send(world.client)

    assert 400 <= r.status_code < 500, r.text
    ErrorBody.model_validate(r.json())


class _Body(BaseModel):
    x: int


def test_a_route_that_lists_no_errors_still_documents_the_apps_422() -> None:
    app = FastAPI()

    @app.post("/x")
    def route(body: _Body) -> int:
        return body.x

    install(app)
    doc = app.openapi()

    schema = doc["paths"]["/x"]["post"]["responses"]["422"]["content"]["application/json"]
    assert schema["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]
