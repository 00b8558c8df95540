"""The REST API end to end on SQLite: task, enrollment, rounds, uploads, log, snapshots."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient
from safetensors.torch import load as st_load
from seedfed.server.app import create_app
from seedfed.server.settings import Settings
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.replay import checksum, replay
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import LogEntryWire, RoundPlan, Upload, pack_binary

from tests.server.conftest import make_settings

ADMIN = {"Authorization": "Bearer admin-" + "x" * 20}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def new_task(client: TestClient, spec: TaskSpec, **kw: object) -> tuple[str, str]:
    r = client.post("/v1/tasks", json={"spec": spec.to_dict(), **kw}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()["task_id"], r.json()["join_token"]


def enroll(client: TestClient, task_id: str, join: str) -> tuple[str, str]:
    r = client.post(f"/v1/tasks/{task_id}/devices", json={"join_token": join})
    assert r.status_code == 201, r.text
    return r.json()["device_id"], r.json()["token"]


def g_for(plan: RoundPlan, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(plan.steps, plan.perturbations))


def test_startup_freezes_the_long_lived_heap(api_settings: Settings) -> None:
    # Full collections over the imported libraries stalled uploads by 100-200 ms
    # (`seedfed bench ingest`); the running app keeps them frozen, and gives them back on exit.
    gc.unfreeze()
    with TestClient(create_app(api_settings)) as c:
        assert c.get("/healthz").status_code == 200
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0


def test_a_device_follows_two_rounds_over_http(client: TestClient, spec: TaskSpec) -> None:
    task_id, join = new_task(client, spec, quorum=3, name="prefs")
    devices = [enroll(client, task_id, join) for _ in range(2)]
    r = client.post(f"/v1/tasks/{task_id}/rounds", headers=ADMIN)
    assert r.status_code == 201

    for rnd in (1, 2):
        plan = RoundPlan.model_validate(client.get(f"/v1/tasks/{task_id}/rounds/current",
                                                   headers=bearer(devices[0][1])).json())
        assert plan.round == rnd
        up = Upload.build(plan, g_for(plan, rnd), 12, 0.69)
        r1 = client.post(f"/v1/tasks/{task_id}/rounds/{rnd}/uploads",
                         content=up.model_dump_json(), headers={
                             **bearer(devices[0][1]), "Content-Type": "application/json"})
        r2 = client.post(f"/v1/tasks/{task_id}/rounds/{rnd}/uploads",
                         content=pack_binary(g_for(plan, rnd + 10)), headers={
                             **bearer(devices[1][1]), "Content-Type": "application/octet-stream",
                             "X-Seedfed-Version": str(plan.version),
                             "X-Seedfed-Num-Examples": "7", "X-Seedfed-Loss": "0.5"})
        assert (r1.status_code, r2.status_code) == (200, 200), (r1.text, r2.text)
        r = client.post(f"/v1/tasks/{task_id}/rounds/{rnd}/close", headers=ADMIN)
        assert r.status_code == 200, r.text
        if rnd == 1:
            client.post(f"/v1/tasks/{task_id}/rounds", headers=ADMIN)

    status = client.get(f"/v1/tasks/{task_id}", headers=bearer(devices[1][1])).json()
    log = [LogEntryWire.model_validate(e) for e in client.get(
        f"/v1/tasks/{task_id}/log", params={"since": 0}, headers=bearer(devices[0][1])).json()]
    snap0 = client.get(f"/v1/tasks/{task_id}/snapshots/0", headers=bearer(devices[0][1]))
    device = build_model(spec, initialize=False)
    device.scope.write(st_load(snap0.content))
    assert checksum(device.scope) == snap0.headers["x-seedfed-checksum"]
    replay(device.scope, [e.to_entry() for e in log], task_id=task_id, version=0)

    assert status["version"] == 2 and status["name"] == "prefs" and status["devices"] == 2
    assert [e.base_version for e in log] == [0, 1]
    assert checksum(device.scope) == status["checksum"] == log[-1].checksum
    snap2 = client.get(f"/v1/tasks/{task_id}/snapshots/2", headers=ADMIN)
    assert snap2.headers["x-seedfed-checksum"] == status["checksum"]
    assert int(snap2.headers["content-length"]) == len(snap2.content)


def test_retry_is_idempotent_and_quorum_closes_the_round(client: TestClient,
                                                         spec: TaskSpec) -> None:
    task_id, join = new_task(client, spec, quorum=2)
    devices = [enroll(client, task_id, join) for _ in range(2)]
    plan = RoundPlan.model_validate(client.post(f"/v1/tasks/{task_id}/rounds",
                                                headers=ADMIN).json())
    body = Upload.build(plan, g_for(plan, 0), 5, 0.4).model_dump_json()
    url = f"/v1/tasks/{task_id}/rounds/1/uploads"
    hdr = {**bearer(devices[0][1]), "Content-Type": "application/json"}

    first = client.post(url, content=body, headers=hdr)
    retry = client.post(url, content=body, headers=hdr)
    other = client.post(url, content=Upload.build(plan, g_for(plan, 1), 5, 0.4)
                        .model_dump_json(), headers=hdr)
    assert (first.status_code, retry.status_code, other.status_code) == (200, 200, 409)
    assert retry.json() == first.json()
    assert "already uploaded different scalars" in other.json()["detail"]
    client.post(url, content=Upload.build(plan, g_for(plan, 2), 5, 0.4).model_dump_json(),
                headers={**bearer(devices[1][1]), "Content-Type": "application/json"})

    status = client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()  # background close ran
    assert status["version"] == 1 and status["state"] == "idle"


def test_deadline_closes_or_expires_rounds(api_settings: Settings, spec: TaskSpec) -> None:
    import time

    with TestClient(create_app(api_settings)) as client:
        task_id, join = new_task(client, spec, quorum=5, round_timeout_s=1.0)
        dev, tok = enroll(client, task_id, join)
        plan = RoundPlan.model_validate(client.post(f"/v1/tasks/{task_id}/rounds",
                                                    headers=ADMIN).json())
        client.post(f"/v1/tasks/{task_id}/rounds/1/uploads", headers=bearer(tok),
                    content=Upload.build(plan, g_for(plan, 0), 5, 0.4).model_dump_json())
        client.post(f"/v1/tasks/{task_id}/rounds", headers=ADMIN)  # returns the open round
        deadline = time.monotonic() + 10
        while client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()["version"] < 1:
            assert time.monotonic() < deadline, "deadline did not close the round"
            time.sleep(0.05)
        client.post(f"/v1/tasks/{task_id}/rounds", headers=ADMIN)  # round 2, nobody uploads
        while client.get(f"/v1/tasks/{task_id}/rounds", headers=ADMIN).json()[-1]["state"] \
                != "expired":
            assert time.monotonic() < deadline, "empty round did not expire"
            time.sleep(0.05)
        rounds = client.get(f"/v1/tasks/{task_id}/stats", headers=ADMIN).json()["rounds"]

    assert [(r["round"], r["state"], r["version"]) for r in rounds] == [
        (1, "closed", 1), (2, "expired", None)]


def test_stats_catchup_metrics_and_health(client: TestClient, spec: TaskSpec) -> None:
    task_id, join = new_task(client, spec, quorum=1)
    dev, tok = enroll(client, task_id, join)
    plan = RoundPlan.model_validate(client.post(f"/v1/tasks/{task_id}/rounds",
                                                headers=ADMIN).json())
    client.post(f"/v1/tasks/{task_id}/rounds/1/close", headers=ADMIN)  # empty: 409
    up = Upload.build(plan, g_for(plan, 0), 5, 0.4).model_dump_json()
    client.post(f"/v1/tasks/{task_id}/rounds/1/uploads", content=up, headers=bearer(tok))
    client.post(f"/v1/tasks/{task_id}/rounds/1/close", headers=ADMIN)

    stats = client.get(f"/v1/tasks/{task_id}/stats", headers=ADMIN).json()
    slow_link = client.get(f"/v1/tasks/{task_id}/catchup", headers=bearer(tok),
                           params={"from": 0, "bandwidth": 1e3}).json()
    slow_cpu = client.get(f"/v1/tasks/{task_id}/catchup", headers=bearer(tok),
                          params={"from": 0, "bandwidth": 1e9, "regen_rate": 1}).json()
    metrics = client.get("/metrics").text
    tasks = client.get("/v1/tasks", headers=ADMIN).json()

    (r,) = stats["rounds"]
    assert (r["round"], r["version"], r["participants"], r["loss"]) == (1, 1, 1, 0.4)
    assert r["upload_bytes"] == len(up) and r["download_bytes"] > 0
    assert r["fedavg_bytes"] == 2 * 4 * stats["scope_numel"]
    assert stats["devices_seen"] == 1 and stats["devices_enrolled"] == 1
    assert {k for k in r} >= {"opened_at", "closed_at"}
    assert slow_link["action"] == "replay" and slow_cpu["action"] == "download"
    assert "seedfed_uploads_total{result=\"accepted\"} 1.0" in metrics
    assert "seedfed_rounds_closed_total 1.0" in metrics
    assert "seedfed_aggregation_seconds_count 1.0" in metrics
    assert [t["task_id"] for t in tasks] == [task_id]
    assert client.get("/healthz").json() == {"status": "ok", "detail": None}
    assert client.get("/readyz").status_code == 200
    assert "/v1/tasks/{task_id}/rounds/{round_number}/uploads" in client.get(
        "/openapi.json").json()["paths"]


def test_int8_task_publishes_through_the_quant_hook(client: TestClient, tiny_bert: Path) -> None:
    from seedfed.shared.model.quant.publish import publish_int8

    from tests.server.conftest import tiny_spec

    spec = tiny_spec(tiny_bert, format="int8", scope="named",
                     scope_options={"patterns": ("classifier",)})
    task_id, _ = new_task(client, spec)

    fp32 = st_load(client.get(f"/v1/tasks/{task_id}/snapshots/0", headers=ADMIN).content)
    r = client.get(f"/v1/tasks/{task_id}/snapshots/0", params={"format": "int8"},
                   headers=ADMIN)

    assert r.headers["x-seedfed-format"] == "int8"
    assert set(st_load(r.content)) == set(publish_int8(fp32, None))


def test_fp16_task_publishes_an_fp16_snapshot(client: TestClient, tiny_bert: Path) -> None:
    from tests.server.conftest import tiny_spec

    task_id, _ = new_task(client, tiny_spec(tiny_bert, format="fp16"))

    fp32 = st_load(client.get(f"/v1/tasks/{task_id}/snapshots/0", headers=ADMIN).content)
    r = client.get(f"/v1/tasks/{task_id}/snapshots/0", params={"format": "fp16"},
                   headers=ADMIN)
    fp16 = st_load(r.content)

    assert r.headers["x-seedfed-format"] == "fp16"
    assert {v.dtype for v in fp16.values()} == {__import__("torch").float16}
    assert all(np.allclose(fp16[k].float(), fp32[k], atol=1e-2, rtol=1e-2) for k in fp32)


def test_the_fastapi_route_answers_like_the_fast_path(sqlite_url: str, tmp_path: Path,
                                                      spec: TaskSpec) -> None:
    answers = []
    for fast in (True, False):
        settings = make_settings(f"sqlite:///{tmp_path / f'{fast}.db'}", tmp_path / f"s{fast}",
                                 upload_fast_path=fast)
        with TestClient(create_app(settings)) as client:
            task_id, join = new_task(client, spec)
            _, tok = enroll(client, task_id, join)
            plan = RoundPlan.model_validate(client.post(f"/v1/tasks/{task_id}/rounds",
                                                        headers=ADMIN).json())
            url = f"/v1/tasks/{task_id}/rounds/1/uploads"
            ok = client.post(url, content=pack_binary(g_for(plan, 0)), headers={
                **bearer(tok), "Content-Type": "application/octet-stream",
                "X-Seedfed-Version": "0", "X-Seedfed-Num-Examples": "3", "X-Seedfed-Loss": "1"})
            bad = client.post(url, content=b"{", headers=bearer(tok))
            answers.append((ok.status_code, sorted(ok.json()), bad.status_code, bad.json()))

    assert answers[0] == answers[1]
    assert answers[0][0] == 200 and answers[0][2] == 400
