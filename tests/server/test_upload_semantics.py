"""Upload semantics over REST: authentication before validation, retries after the
close, devices_per_round, revoked devices, strict and bounded numbers, plan size."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from seedfed.server import service
from seedfed.server.settings import Settings
from seedfed.shared.protocol.task import Hyper, TaskSpec
from seedfed.shared.protocol.wire import RoundPlan, Upload, pack_binary

from tests.server.conftest import make_settings, tiny_spec
from tests.server.test_api import ADMIN, bearer, enroll, g_for, new_task


@pytest.fixture
def api_settings(sqlite_url: str, tmp_path: Path) -> Settings:
    """The `client` fixture's settings, with no tick: rounds close only when asked."""
    return make_settings(sqlite_url, tmp_path / "store", tick_interval_s=60)


def start(client: TestClient, spec: TaskSpec, devices: int, **kw: object
          ) -> tuple[str, list[tuple[str, str]], RoundPlan]:
    task_id, join = new_task(client, spec, **kw)
    devs = [enroll(client, task_id, join) for _ in range(devices)]
    r = client.post(f"/v1/tasks/{task_id}/rounds", headers=ADMIN)
    return task_id, devs, RoundPlan.model_validate(r.json())


def post(client: TestClient, plan: RoundPlan, token: str, body: str | bytes,
         ctype: str = "application/json", **hdr: str):
    return client.post(f"/v1/tasks/{plan.task_id}/rounds/{plan.round}/uploads", content=body,
                       headers={**bearer(token), "Content-Type": ctype, **hdr})


def body(plan: RoundPlan, seed: int = 1, **update: object) -> str:
    d = json.loads(Upload.build(plan, g_for(plan, seed), 8, 0.4).model_dump_json())
    d.update(update)
    return json.dumps(d)


def test_a_retry_after_the_round_closed_gets_the_original_receipt(client: TestClient,
                                                                  spec: TaskSpec) -> None:
    # Arrange: the upload that reaches quorum closes the round
    _, devs, plan = start(client, spec, 1, quorum=1)
    first = post(client, plan, devs[0][1], body(plan))

    # Act: the device did not see the answer and sends the same bytes again
    again = post(client, plan, devs[0][1], body(plan))
    different = post(client, plan, devs[0][1], body(plan, seed=2))

    # Assert
    assert first.status_code == 200 and again.status_code == 200, again.text
    assert again.json() == first.json()
    assert different.status_code == 409


@pytest.mark.parametrize("case", ["stale version", "wrong shape", "closed round", "garbage",
                                  "binary stale"])
def test_a_bogus_token_gets_401_whatever_the_body(client: TestClient, spec: TaskSpec,
                                                  case: str) -> None:
    # Arrange: bodies that would each tell a caller something about the round
    task_id, devs, plan = start(client, spec, 1, quorum=2)
    r = post(client, plan, "not-a-device-token", {
        "stale version": body(plan, version=7),
        "wrong shape": body(plan, shape=[9, 9]),
        "closed round": body(plan, round=5),
        "garbage": "{not json",
        "binary stale": pack_binary(np.ones((9, 9))),
    }[case], ctype="application/octet-stream" if case.startswith("binary") else
        "application/json", **{"X-Seedfed-Version": "7", "X-Seedfed-Num-Examples": "3",
                               "X-Seedfed-Loss": "0.5"})

    # Assert: 401, and nothing about version, round state or the plan's shape
    assert r.status_code == 401, r.text
    assert r.json()["error"] == "AuthenticationError"
    for leak in ("version", "shape", "round", "steps"):
        assert leak not in r.json()["detail"]


def test_devices_per_round_caps_a_round_over_rest(client: TestClient, spec: TaskSpec,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: quorum 1, at most 2 devices; the close at quorum is held back, so that
    # uploads keep arriving while it would run
    monkeypatch.setattr(service, "close_if_due", lambda *a, **k: None)
    task_id, devs, plan = start(client, spec, 3, quorum=1, devices_per_round=2)

    # Act
    codes = [post(client, plan, tok, body(plan, seed=i)).status_code
             for i, (_, tok) in enumerate(devs)]
    third = post(client, plan, devs[2][1], body(plan, seed=2))

    # Assert
    assert codes == [200, 200, 409]
    assert third.json()["error"] == "RoundFullError"


def test_a_device_revoked_with_an_upload_in_the_open_round_is_not_aggregated(
        client: TestClient, spec: TaskSpec) -> None:
    task_id, devs, plan = start(client, spec, 2, quorum=5)
    for i, (_, tok) in enumerate(devs):
        assert post(client, plan, tok, body(plan, seed=i)).status_code == 200
    assert client.delete(f"/v1/tasks/{task_id}/devices/{devs[1][0]}",
                         headers=ADMIN).status_code == 204

    closed = client.post(f"/v1/tasks/{task_id}/rounds/1/close", headers=ADMIN)
    (metrics,) = client.get(f"/v1/tasks/{task_id}/rounds", headers=ADMIN).json()

    assert closed.status_code == 200, closed.text
    assert metrics["participants"] == 1


@pytest.mark.parametrize("update,code", [
    ({"num_examples": "10"}, 422), ({"loss": 1e308}, 422), ({"loss": -1e308}, 422),
    ({"num_examples": 2**31}, 422), ({"num_examples": 2**63}, 422), ({"version": 2**40}, 422),
], ids=str)
def test_out_of_range_or_string_numbers_are_refused(client: TestClient, spec: TaskSpec,
                                                    update: dict[str, object], code: int) -> None:
    _, devs, plan = start(client, spec, 1, quorum=2)

    r = post(client, plan, devs[0][1], body(plan, **update))

    assert r.status_code == code, r.text


@pytest.mark.parametrize("headers,code", [
    ({"X-Seedfed-Num-Examples": "1_0"}, 400), ({"X-Seedfed-Num-Examples": " 10"}, 400),
    ({"X-Seedfed-Loss": "nan"}, 400), ({"X-Seedfed-Loss": "1e308"}, 422),
    ({"X-Seedfed-Num-Examples": "9999999999"}, 422),
], ids=str)
def test_binary_headers_are_strict_decimal_numbers_in_range(
        client: TestClient, spec: TaskSpec, headers: dict[str, str], code: int) -> None:
    _, devs, plan = start(client, spec, 1, quorum=2)
    h = {"X-Seedfed-Version": "0", "X-Seedfed-Num-Examples": "10", "X-Seedfed-Loss": "0.5",
         **headers}

    r = post(client, plan, devs[0][1], pack_binary(g_for(plan, 1)), "application/octet-stream",
             **h)

    assert r.status_code == code, r.text


def test_binary_reserved_header_word_is_checked(client: TestClient, spec: TaskSpec) -> None:
    _, devs, plan = start(client, spec, 1, quorum=2)
    data = bytearray(pack_binary(g_for(plan, 1)))
    struct.pack_into("<I", data, 12, 1)

    r = post(client, plan, devs[0][1], bytes(data), "application/octet-stream",
             **{"X-Seedfed-Version": "0", "X-Seedfed-Num-Examples": "10",
                "X-Seedfed-Loss": "0.5"})

    assert r.status_code == 422 and "reserved" in r.json()["detail"]


def test_a_task_whose_uploads_exceed_the_body_limit_is_refused(sqlite_url: str,
                                                               tmp_path: Path,
                                                               tiny_bert: Path) -> None:
    # 64 x 1024 scalars (the most a round may plan): 262 kB binary, ~350 kB as JSON, above a
    # coordinator's 200 kB limit
    from seedfed.server.app import create_app

    spec = tiny_spec(tiny_bert, hyper=Hyper(steps=64, perturbations=1024))
    settings = make_settings(sqlite_url, tmp_path / "store", max_body_bytes=200_000)

    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/tasks", json={"spec": spec.to_dict()}, headers=ADMIN)

    assert r.status_code == 422 and "body limit" in r.json()["detail"]


def test_devices_per_round_below_the_quorum_is_refused(client: TestClient,
                                                       spec: TaskSpec) -> None:
    r = client.post("/v1/tasks", json={"spec": spec.to_dict(), "quorum": 3,
                                       "devices_per_round": 2}, headers=ADMIN)

    assert r.status_code == 422 and "below the quorum" in r.json()["detail"]
