"""Hypothesis through the API: whatever body an upload carries (bytes, near-valid JSON, binary
with any headers), the answer is a 4xx with the app's error body or a receipt, never a 5xx, and
a refused upload leaves no row behind (nor a partial one: the count moves only on a 200)."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from seedfed.server.api.openapi import ErrorBody
from seedfed.server.app import create_app
from seedfed.server.orm import UploadRow
from seedfed.server.runtime import Runtime
from seedfed.shared.protocol.wire import MAGIC, RoundPlan, Upload, pack_binary
from sqlalchemy import func, select

from tests.server.conftest import make_settings, tiny_spec
from tests.server.test_api import ADMIN, bearer
from tests.strategies import mutate_fields

FUZZ = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


@dataclass
class World:
    client: TestClient
    rt: Runtime
    task_id: str
    plan: RoundPlan
    join: str
    token: str  # a device that has not uploaded yet (replaced after each accepted upload)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("fuzz-uploads")
    settings_ = make_settings(f"sqlite:///{tmp / 'c.db'}", tmp / "store", max_body_bytes=4096)
    with TestClient(create_app(settings_), raise_server_exceptions=False) as client:
        r = client.post("/v1/tasks", json={"spec": tiny_spec(tiny_bert).to_dict(),
                                           "quorum": 10_000}, headers=ADMIN)
        task_id, join = r.json()["task_id"], r.json()["join_token"]
        plan = RoundPlan.model_validate(client.post(f"/v1/tasks/{task_id}/rounds",
                                                    headers=ADMIN).json())
        yield World(client, client.app.state.runtime, task_id, plan, join,
                    enroll(client, task_id, join))


def enroll(client: TestClient, task_id: str, join: str) -> str:
    token: str = client.post(f"/v1/tasks/{task_id}/devices", json={"join_token": join}
                             ).json()["token"]
    return token


def stored(w: World) -> int:
    with w.rt.transaction() as s:
        return int(s.scalar(select(func.count()).select_from(UploadRow)) or 0)


def check(w: World, body: bytes, headers: dict[str, str]) -> None:
    before = stored(w)

    r = w.client.post(f"/v1/tasks/{w.task_id}/rounds/{w.plan.round}/uploads", content=body,
                      headers={**bearer(w.token), **headers})

    assert r.status_code < 500, r.text
    if r.status_code == 200:
        assert stored(w) == before + 1
        w.token = enroll(w.client, w.task_id, w.join)  # that device has uploaded
    else:
        assert 400 <= r.status_code < 500
        ErrorBody.model_validate(r.json())
        assert stored(w) == before


@st.composite
def near_valid_json(draw: st.DrawFn, plan: RoundPlan) -> bytes:
    """A valid upload with some fields dropped, replaced by any JSON, or the text cut short."""
    g = np.zeros((plan.steps, plan.perturbations), dtype="<f4")
    doc = json.loads(Upload.build(plan, g, 3, 0.5).model_dump_json())
    mutate_fields(draw, doc, one_in=6)
    if draw(st.integers(0, 3)) == 0:  # scalars of the right length but any bit pattern
        doc["scalars"] = base64.b64encode(draw(st.binary(min_size=4 * g.size,
                                                         max_size=4 * g.size))).decode()
    text = json.dumps(doc)
    if draw(st.integers(0, 4)) == 0:
        text = text[:draw(st.integers(0, len(text)))]
    return text.encode("utf-8", "surrogatepass")


@FUZZ
@given(data=st.data())
@example(data=None)
def test_any_json_upload_is_refused_cleanly_or_stored_once(world: World,
                                                           data: st.DataObject | None) -> None:
    body = b'{"task_id": "\\ud800", "round": 1e999}' if data is None else \
        data.draw(near_valid_json(world.plan) | st.binary(max_size=300))

    check(world, body, {"Content-Type": "application/json"})


header_values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126),
                        max_size=24) | st.integers(-2**70, 2**70).map(str) | \
    st.floats().map(str)


@st.composite
def binary_upload(draw: st.DrawFn, plan: RoundPlan) -> tuple[bytes, dict[str, str]]:
    rows = draw(st.sampled_from([plan.steps, 0, 1, 2**32 - 1]))
    cols = draw(st.sampled_from([plan.perturbations, 0, 2, 2**16 + 1]))
    reserved = draw(st.sampled_from([0, 0, 1]))
    body = struct.pack("<4sIII", draw(st.sampled_from([MAGIC, b"SFS2"])), rows, cols, reserved)
    body += draw(st.binary(min_size=0, max_size=4 * plan.steps * plan.perturbations + 8))
    if draw(st.booleans()):
        body = draw(st.binary(max_size=64))
    headers = {"Content-Type": "application/octet-stream"}
    for name, good in (("X-Seedfed-Version", str(plan.version)),
                       ("X-Seedfed-Num-Examples", "3"), ("X-Seedfed-Loss", "0.5")):
        choice = draw(st.integers(0, 3))
        if choice == 1:
            headers[name] = draw(header_values)
        elif choice > 1:
            headers[name] = good
    return body, headers


@FUZZ
@given(data=st.data())
@example(data=None)
def test_any_binary_upload_is_refused_cleanly_or_stored_once(world: World,
                                                             data: st.DataObject | None
                                                             ) -> None:
    if data is None:  # a valid body whose weight does not fit a database integer
        g = np.zeros((world.plan.steps, world.plan.perturbations), dtype="<f4")
        body, headers = pack_binary(g), {
            "Content-Type": "application/octet-stream", "X-Seedfed-Num-Examples": str(2**63),
            "X-Seedfed-Version": str(world.plan.version), "X-Seedfed-Loss": "0.5"}
    else:
        body, headers = data.draw(binary_upload(world.plan))

    check(world, body, headers)


def test_a_rejected_upload_after_the_fuzzing_still_leaves_the_round_open(world: World) -> None:
    status = world.client.get(f"/v1/tasks/{world.task_id}", headers=ADMIN).json()

    assert status["state"] == "open" and status["round"] == world.plan.round
