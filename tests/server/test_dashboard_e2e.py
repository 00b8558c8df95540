"""The dashboard of a real coordinator: uvicorn on SQLite, a task on a tiny BERT, devices that
train with `LocalTrainer` and upload real scalars over REST, rounds that close at quorum. The
page must show what the API says, and a screenshot is kept (SEEDFED_SCREENSHOT_DIR=docs saves
docs/dashboard.png for the README)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from playwright.sync_api import expect
from seedfed.client.trainer import LocalTrainer
from seedfed.server.app import create_app
from seedfed.server.settings import Settings
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.objectives import classification_loss
from seedfed.shared.model.replay import checksum, replay
from seedfed.shared.protocol.wire import DeviceMetrics, LogEntryWire, RoundPlan, Upload

from tests.server.conftest import tiny_spec
from tests.server.dashboard_harness import Browser, Page, browser_fixture, open_dashboard, serve

__all__ = ["browser_fixture"]  # the `browser` fixture, used by name

pytestmark = [pytest.mark.browser, pytest.mark.slow]  # ~25 s: model builds, 3 rounds, browser

ADMIN = "dashboard-e2e-admin-token"
QUORUM = 3
PARTICIPATION = [3, 2, 3, 1]  # uploads per round; the last round stays open
SENTENCES = [("good movie", 1), ("bad film", 0), ("great fun", 1), ("awful plot", 0),
             ("very good", 1), ("not fun", 0), ("love the film", 1), ("hate the plot", 0)]


@dataclass
class Fleet:
    """What the scenario left behind, for the assertions."""

    base_url: str
    task_id: str
    device_checksum: str  # the devices' own replayed state after the last closed round
    tasks: list[dict[str, Any]]
    stats: dict[str, Any]


def batches(tokenizer: Any, offset: int) -> Iterator[dict[str, torch.Tensor]]:
    """The device's private data: 4 labelled sentences per batch, rotating by device."""
    i = offset
    while True:
        rows = [SENTENCES[(i + k) % len(SENTENCES)] for k in range(4)]
        enc = tokenizer([t for t, _ in rows], padding=True, return_tensors="pt")
        yield {**enc, "labels": torch.tensor([y for _, y in rows])}
        i += 1


@torch.no_grad()
def held_out_accuracy(bundle: Any, k: int) -> float:
    """Device k's accuracy on its 3 held-out sentences with the shared model it holds (these
    devices have no personal part: they report the shared model's accuracy alone)."""
    rows = [SENTENCES[(3 * k + j) % len(SENTENCES)] for j in range(3)]
    enc = bundle.tokenizer([t for t, _ in rows], padding=True, return_tensors="pt")
    predicted = bundle.model(**enc).logits.argmax(-1)
    return float((predicted == torch.tensor([y for _, y in rows])).float().mean())


def wait_for_version(http: httpx.Client, task_id: str, version: int) -> None:
    """Rounds close in the background once the quorum has uploaded."""
    deadline = time.monotonic() + 20
    while http.get(f"/v1/tasks/{task_id}").json()["version"] < version:
        assert time.monotonic() < deadline, f"round did not close into version {version}"
        time.sleep(0.05)


def run_scenario(base_url: str, model_path: Path) -> Fleet:
    """Rounds with PARTICIPATION uploads each: at quorum they close by themselves, below it
    the admin closes them, and the last one stays open. 4 devices, the last one revoked."""
    spec = tiny_spec(model_path)
    admin = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {ADMIN}"},
                         timeout=30)
    created = admin.post("/v1/tasks", json={"spec": spec.to_dict(), "name": "tiny-sst2",
                                            "quorum": QUORUM}).raise_for_status().json()
    task_id = created["task_id"]
    devices = []
    for _ in range(QUORUM + 1):
        enrolled = httpx.post(f"{base_url}/v1/tasks/{task_id}/devices",
                              json={"join_token": created["join_token"]}).raise_for_status()
        token = enrolled.json()["token"]
        devices.append((enrolled.json()["device_id"],
                        httpx.Client(base_url=base_url, timeout=30,
                                     headers={"Authorization": f"Bearer {token}"})))
    # One model stands for every device: the trainer restores it after each device's steps.
    bundle = build_model(spec, initialize=True)
    assert checksum(bundle.scope) == created["checksum"]  # devices start at version 0 exactly
    trainer = LocalTrainer(bundle.model, bundle.scope, classification_loss)
    data = [batches(bundle.tokenizer, k) for k in range(len(devices))]

    def upload(k: int) -> None:
        http = devices[k][1]
        plan = RoundPlan.model_validate(http.get(f"/v1/tasks/{task_id}/rounds/current")
                                        .raise_for_status().json())
        result = trainer.run(plan, data[k])
        body = Upload.build(plan, result.scalars, result.num_examples, result.loss)
        http.post(f"/v1/tasks/{task_id}/rounds/{plan.round}/uploads",
                  content=body.model_dump_json(),
                  headers={"Content-Type": "application/json"}).raise_for_status()

    for version, participants in enumerate(PARTICIPATION[:-1], start=1):
        plan = admin.post(f"/v1/tasks/{task_id}/rounds").raise_for_status().json()
        for k in range(participants):
            upload(k)
        if participants < QUORUM:
            admin.post(f"/v1/tasks/{task_id}/rounds/{plan['round']}/close").raise_for_status()
        wait_for_version(admin, task_id, version)
        entries = devices[0][1].get(f"/v1/tasks/{task_id}/log",
                                    params={"since": version - 1}).raise_for_status().json()
        replay(bundle.scope, [LogEntryWire.model_validate(e).to_entry() for e in entries],
               task_id=task_id, version=version - 1, verify=True)
        for k in range(participants):  # each scores its own 3 held-out sentences at v
            score = DeviceMetrics(version=version, num_examples=3,
                                  shared_accuracy=held_out_accuracy(bundle, k))
            devices[k][1].post(f"/v1/tasks/{task_id}/rounds/{plan['round']}/metrics",
                               content=score.model_dump_json(),
                               headers={"Content-Type": "application/json"}).raise_for_status()
    admin.post(f"/v1/tasks/{task_id}/rounds").raise_for_status()
    for k in range(PARTICIPATION[-1]):  # below quorum: the round stays open
        upload(k)
    admin.delete(f"/v1/tasks/{task_id}/devices/{devices[-1][0]}").raise_for_status()
    return Fleet(base_url=base_url, task_id=task_id, device_checksum=checksum(bundle.scope),
                 tasks=admin.get("/v1/tasks").raise_for_status().json(),
                 stats=admin.get(f"/v1/tasks/{task_id}/stats").raise_for_status().json())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("coordinator")
    settings = Settings(database_url=f"sqlite:///{tmp / 'coordinator.db'}",
                        store_dir=tmp / "store", admin_token=ADMIN, tick_interval_s=0.2)
    with serve(create_app(settings)) as url:
        yield run_scenario(url, tiny_bert)


def attr(page: Page, selector: str, name: str = "data-value") -> str:
    value = page.get_attribute(selector, name)
    assert value is not None, f"{selector} has no {name}"
    return value


def numbers(page: Page, selector: str) -> list[float]:
    return [float(v) for v in page.eval_on_selector_all(
        selector, "els => els.map(e => e.getAttribute('data-value'))")]


def test_dashboard_shows_what_the_api_says(browser: Browser, fleet: Fleet,
                                           tmp_path: Path) -> None:
    # Arrange
    status = next(t for t in fleet.tasks if t["task_id"] == fleet.task_id)
    rounds = fleet.stats["rounds"]

    # Act
    page, problems = open_dashboard(browser, fleet.base_url, ADMIN)
    expect(page.locator("#chart-bytes rect.bar.fedavg")).to_have_count(len(rounds))
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("SEEDFED_SCREENSHOT_DIR"):
        out = Path(os.environ["SEEDFED_SCREENSHOT_DIR"]) / "dashboard.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)

    # Assert: the scenario itself
    closed = len(PARTICIPATION) - 1
    assert [r["participants"] for r in rounds] == PARTICIPATION
    assert [r["state"] for r in rounds] == ["closed"] * closed + ["open"]
    assert status["version"] == closed and status["checksum"] == fleet.device_checksum
    # cards: the API's version and checksum (equal to the devices' replayed state)
    assert attr(page, '[data-field="version"]') == str(closed)
    assert page.text_content('[data-field="checksum"]') == status["checksum"]
    assert page.text_content('[data-field="round-state"]') == "open"
    assert attr(page, '[data-field="devices"]') == str(fleet.stats["devices_seen"]) == "3"
    assert "4 enrolled, 1 revoked" in (page.text_content('[data-field="devices-note"]') or "")
    assert int(attr(page, '[data-field="upload-bytes"]')) == \
        sum(r["upload_bytes"] for r in rounds)
    assert int(attr(page, '[data-field="fedavg-bytes"]')) == \
        sum(r["fedavg_bytes"] for r in rounds)
    # devices: the API's list, uploads per device, the revoked one marked
    shown = page.eval_on_selector_all(
        "#devices tbody tr", "els => els.map(e => [e.dataset.deviceId, "
        "+e.children[3].dataset.value, e.children[5].textContent])")
    assert shown == [[d["device_id"], d["uploads"], "revoked" if d["revoked_at"] else "active"]
                     for d in fleet.stats["devices"]]
    assert sorted(d["uploads"] for d in fleet.stats["devices"]) == [0, 2, 3, 4]
    # charts: one bar per round, one loss point per round with a loss, the quorum line
    assert numbers(page, "#chart-participation rect.bar") == [r["participants"] for r in rounds]
    assert float(attr(page, "#chart-participation line.ref-line")) == QUORUM
    assert numbers(page, "#chart-loss circle.pt.loss") == \
        pytest.approx([r["loss"] for r in rounds if r["loss"] is not None])
    assert page.locator("#chart-loss circle.pt.loss").count() >= 2
    for cls, field in (("upload", "upload_bytes"), ("fedavg", "fedavg_bytes")):
        assert numbers(page, f"#chart-bytes rect.bar.{cls}") == [r[field] for r in rounds]
    assert all(r["fedavg_bytes"] > 10 * r["upload_bytes"] for r in rounds)
    # held-out accuracy: the fleet's mean and worst decile of what the devices reported
    reported = [r for r in rounds if r["shared_accuracy_mean"] is not None]
    assert [r["metric_devices"] for r in rounds] == PARTICIPATION[:-1] + [0]
    for cls, field in (("shared-mean", "shared_accuracy_mean"),
                       ("shared-worst", "shared_accuracy_worst_decile")):
        assert numbers(page, f"#chart-personal circle.pt.{cls}") == \
            pytest.approx([r[field] for r in reported]), cls
    assert page.locator("#chart-personal circle.pt.personal-mean").count() == 0
    # table: every round, newest first
    assert page.eval_on_selector_all("#rounds tbody tr", "els => els.map(e => e.dataset.round)") \
        == [str(r["round"]) for r in reversed(rounds)]
    assert shot.stat().st_size > 10_000
    assert problems == []
    page.close()


def test_dashboard_page_is_open_but_its_data_is_not(fleet: Fleet) -> None:
    # Act
    page = httpx.get(fleet.base_url + "/")
    data = httpx.get(f"{fleet.base_url}/v1/tasks/{fleet.task_id}/stats")

    # Assert
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert data.status_code == 401
