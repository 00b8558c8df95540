"""Bad input gets a 4xx that names the problem and changes nothing (database and store)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from seedfed.server.app import create_app
from seedfed.server.orm import DeviceRow, RoundRow, TaskRow, UploadRow, VersionRow
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan, Upload, pack_binary
from sqlalchemy import func, select

from tests.server.conftest import ServedTask, make_settings, tiny_spec
from tests.server.test_api import ADMIN, bearer, enroll, g_for, new_task

LIMIT = 8192


@dataclass
class World(ServedTask):
    plan: RoundPlan  # round 2, open, at version 1
    old_plan: RoundPlan  # round 1, closed
    device: tuple[str, str]
    other: tuple[str, str]
    revoked: tuple[str, str]
    foreign_token: str


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("errors")
    settings = make_settings(f"sqlite:///{tmp / 'c.db'}", tmp / "store", max_body_bytes=LIMIT,
                             scalar_hard_limit=100.0)
    spec = tiny_spec(tiny_bert)
    with TestClient(create_app(settings)) as client:
        task_id, join = new_task(client, spec, quorum=10)
        other_task, other_join = new_task(client, spec, quorum=10)
        device, other, revoked = (enroll(client, task_id, join) for _ in range(3))
        foreign = enroll(client, other_task, other_join)
        old = RoundPlan.model_validate(client.post(f"/v1/tasks/{task_id}/rounds",
                                                   headers=ADMIN).json())
        client.post(f"/v1/tasks/{task_id}/rounds/1/uploads", headers=bearer(device[1]),
                    content=Upload.build(old, g_for(old, 0), 3, 0.1).model_dump_json())
        assert client.post(f"/v1/tasks/{task_id}/rounds/1/close", headers=ADMIN).is_success
        plan = RoundPlan.model_validate(client.post(f"/v1/tasks/{task_id}/rounds",
                                                    headers=ADMIN).json())
        assert client.delete(f"/v1/tasks/{task_id}/devices/{revoked[0]}",
                             headers=ADMIN).status_code == 204
        yield World(client, client.app.state.runtime, task_id, join, plan, old, device, other,
                    revoked, foreign[1])


def state(w: World) -> tuple[object, ...]:
    with w.rt.transaction() as s:
        counts = tuple(s.scalar(select(func.count()).select_from(t)) for t in
                       (TaskRow, DeviceRow, RoundRow, UploadRow, VersionRow))
        versions = tuple(s.scalars(select(TaskRow.current_version).order_by(TaskRow.id)))
        rounds = tuple(s.execute(select(RoundRow.id, RoundRow.state)))
    files = tuple(sorted((str(p.relative_to(w.rt.store.root)), p.stat().st_size,
                          p.stat().st_mtime_ns) for p in w.rt.store.root.rglob("*")
                         if p.is_file()))
    return counts, versions, rounds, files


def upload_json(w: World, body: str | bytes, token: str, rnd: int = 2, **hdr: str):
    return w.client.post(f"/v1/tasks/{w.task_id}/rounds/{rnd}/uploads", content=body,
                         headers={**bearer(token), "Content-Type": "application/json", **hdr})


def good(w: World, **update: object) -> str:
    return Upload.build(w.plan, g_for(w.plan, 1), 4, 0.3).model_copy(update=update) \
        .model_dump_json()


def nonfinite(w: World, value: float) -> str:
    g = np.zeros((w.plan.steps, w.plan.perturbations), dtype="<f4")
    g[0, 1] = value
    return good(w, scalars=base64.b64encode(g.tobytes()).decode())


CASES = {
    "malformed json": (lambda w: upload_json(w, b'{"task_id": ', w.device[1]), 400,
                       "not valid JSON"),
    "schema": (lambda w: upload_json(w, b'{"task_id": "x"}', w.device[1]), 422, "Field required"),
    "wrong shape": (lambda w: upload_json(w, Upload.build(
        w.plan.model_copy(update={"seeds": [[1]]}), np.zeros((1, 1)), 4, 0.3)
        .model_dump_json(), w.device[1]), 422, "does not match the plan's"),
    "bad base64 length": (lambda w: upload_json(w, good(w, scalars="AAAA"), w.device[1]), 422,
                          "scalars hold 3 bytes"),
    "nan": (lambda w: upload_json(w, nonfinite(w, float("nan")), w.device[1]), 422, "NaN"),
    "inf binary": (lambda w: w.client.post(
        f"/v1/tasks/{w.task_id}/rounds/2/uploads",
        content=pack_binary(np.full((w.plan.steps, w.plan.perturbations), np.inf)),
        headers={**bearer(w.device[1]), "Content-Type": "application/octet-stream",
                 "X-Seedfed-Version": "1", "X-Seedfed-Num-Examples": "3",
                 "X-Seedfed-Loss": "0.2"}), 422, "NaN or infinity"),
    "binary without headers": (lambda w: w.client.post(
        f"/v1/tasks/{w.task_id}/rounds/2/uploads", content=pack_binary(np.zeros((2, 3))),
        headers={**bearer(w.device[1]), "Content-Type": "application/octet-stream"}), 400,
        "X-Seedfed-Num-Examples"),
    "wrong content type": (lambda w: upload_json(w, good(w), w.device[1],
                                                 **{"Content-Type": "text/plain"}), 400,
                           "text/plain"),
    "above hard limit": (lambda w: upload_json(w, nonfinite(w, 1000.0), w.device[1]), 422,
                         "above the hard limit 100.0"),
    "nan loss": (lambda w: upload_json(w, good(w).replace('"loss":0.3', '"loss":NaN'),
                                       w.device[1]), 422, "loss must be finite"),
    "unknown round": (lambda w: upload_json(w, good(w, round=7), w.device[1], rnd=7), 404,
                      "has no round 7"),
    "closed round": (lambda w: upload_json(w, Upload.build(w.old_plan, g_for(w.old_plan, 3), 4,
                                                           0.3).model_dump_json(),
                                           w.other[1], rnd=1), 409, "round 1 .* is closed"),
    "stale version": (lambda w: upload_json(w, good(w, version=0), w.device[1]), 409,
                      "computed at version 0, round 2 is at version 1"),
    "round mismatch": (lambda w: upload_json(w, good(w, round=1), w.device[1]), 422,
                       "upload is for round 1 but was sent to round 2"),
    "task mismatch": (lambda w: upload_json(w, good(w, task_id="nope"), w.device[1]), 422,
                      "is for task 'nope'"),
    "no token": (lambda w: w.client.post(f"/v1/tasks/{w.task_id}/rounds/2/uploads",
                                         content=good(w)), 401, "missing Authorization"),
    "bad token": (lambda w: upload_json(w, good(w), "forged"), 401, "unknown device token"),
    "revoked token": (lambda w: upload_json(w, good(w), w.revoked[1]), 401, "revoked"),
    "foreign device": (lambda w: upload_json(w, good(w), w.foreign_token), 403,
                       "enrolled in another task"),
    "oversized body": (lambda w: upload_json(w, b" " * (LIMIT + 1), w.device[1]), 413,
                       f"exceeds the limit of {LIMIT} bytes"),
    "oversized chunked": (lambda w: w.client.post(
        f"/v1/tasks/{w.task_id}/rounds/2/uploads", content=iter([b" " * 5000] * 3),
        headers=bearer(w.device[1])), 413, "exceeds"),
    "admin route with device token": (lambda w: w.client.post(
        f"/v1/tasks/{w.task_id}/rounds/2/close", headers=bearer(w.device[1])), 401,
        "wrong admin token"),
    "bad join token": (lambda w: w.client.post(f"/v1/tasks/{w.task_id}/devices",
                                               json={"join_token": "guess"}), 401,
                       "wrong join token"),
    "unknown task": (lambda w: w.client.get("/v1/tasks/nope", headers=ADMIN), 404,
                     "task 'nope' does not exist"),
    "unknown version": (lambda w: w.client.get(f"/v1/tasks/{w.task_id}/snapshots/9",
                                               headers=ADMIN), 404, "has no version 9"),
    "log since the future": (lambda w: w.client.get(f"/v1/tasks/{w.task_id}/log",
                                                    params={"since": 5}, headers=ADMIN), 409,
                             "since=5 is beyond"),
    "unknown format": (lambda w: w.client.post("/v1/tasks", headers=ADMIN, json={
        "spec": {**tiny_spec(Path(w.rt.store.root)).to_dict(), "format": "int3"}}), 422,
        "format must be one of .* got 'int3'"),
    "missing model": (lambda w: w.client.post("/v1/tasks", headers=ADMIN, json={
        "spec": tiny_spec(Path("/nonexistent")).to_dict()}), 422, "/nonexistent"),
    "invalid spec": (lambda w: w.client.post("/v1/tasks", headers=ADMIN, json={
        "spec": {"model_path": "x", "hyper": {"lr": -1}}}), 422,
        r"hyper.lr must be in \[1e-12, 10000\], got -1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_is_refused_and_changes_nothing(world: World, case: str) -> None:
    send, code, message = CASES[case]
    before = state(world)

    r = send(world)

    assert r.status_code == code, r.text
    import re

    assert re.search(message, r.json()["detail"] if isinstance(r.json()["detail"], str)
                     else str(r.json()["detail"])), r.text
    assert state(world) == before


def test_a_good_upload_after_all_that_is_accepted(world: World, spec: TaskSpec) -> None:
    r = upload_json(world, good(world), world.other[1])

    assert r.status_code == 200, r.text
    assert r.json()["device_id"] == world.other[0]
