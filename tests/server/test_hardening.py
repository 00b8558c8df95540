"""What a hostile or careless client cannot do to the coordinator: define a task outside the
ranges, name it with terminal escapes, send a header twice, stream a body past the limit, read
CDN-loading API pages, or turn a failed close after an upload's answer into tracebacks."""

from __future__ import annotations

import logging
import select
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from seedfed.server import service
from seedfed.server.app import create_app
from seedfed.server.settings import Settings
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan, pack_binary
from sqlalchemy.exc import OperationalError

from tests.live_coordinator import ADMIN_TOKEN, live_settings, serve
from tests.server.conftest import make_settings

ADMIN = {"Authorization": "Bearer admin-" + "x" * 20}


@pytest.mark.parametrize(("body", "field", "range_text"), [
    ({"hyper": {"lr": 1e37}}, "hyper.lr", "[1e-12, 10000]"),
    ({"hyper": {"eps": 1e300}}, "hyper.eps", "[1e-08, 100]"),
    ({"hyper": {"batch_size": 10**12}}, "hyper.batch_size", "1..4096"),
    ({"hyper": {"clip": 1e300}}, "hyper.clip", "(0, 1e+06]"),
    ({"max_seq_len": 10**9}, "max_seq_len", "1..32768"),
    ({"lora": {"r": 10**6}}, "lora.r", "1..256"),
    ({"aggregation": {"dp_clip": 1.0, "dp_noise_multiplier": 1e300}},
     "aggregation.dp_noise_multiplier", "[0, 1000]"),
])
def test_task_creation_refuses_out_of_range_values_naming_field_and_range(
        client: TestClient, spec: TaskSpec, body: dict[str, Any], field: str,
        range_text: str) -> None:
    # Arrange
    d = spec.to_dict()
    for key, value in body.items():
        d[key] = {**d[key], **value} if isinstance(value, dict) else value

    # Act
    r = client.post("/v1/tasks", json={"spec": d}, headers=ADMIN)

    # Assert: 422, one line naming the field and its range; nothing was created
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"] and range_text in r.json()["detail"]
    assert client.get("/v1/tasks", headers=ADMIN).json() == []


@pytest.mark.parametrize("timeout", [1e-9, 0.5, 0.0])
def test_a_round_timeout_below_a_second_is_refused(client: TestClient, spec: TaskSpec,
                                                   timeout: float) -> None:
    r = client.post("/v1/tasks", json={"spec": spec.to_dict(), "round_timeout_s": timeout},
                    headers=ADMIN)

    assert r.status_code == 422
    assert "round_timeout_s" in r.json()["detail"] and "greater than or equal to 1" in \
        r.json()["detail"]


@pytest.mark.parametrize("name", ["\x1b[2J\x1b[31mowned", "two\nlines", "rtl\u202eevil",
                                  "zero\u200bwidth", "bell\x07"])
def test_a_task_name_with_control_characters_is_refused(client: TestClient, spec: TaskSpec,
                                                        name: str) -> None:
    r = client.post("/v1/tasks", json={"spec": spec.to_dict(), "name": name}, headers=ADMIN)

    assert r.status_code == 422 and "printable" in r.json()["detail"]


def test_a_printable_unicode_name_is_kept(client: TestClient, spec: TaskSpec) -> None:
    r = client.post("/v1/tasks", json={"spec": spec.to_dict(), "name": "Préférences 🎬 v2"},
                    headers=ADMIN)

    assert r.status_code == 201
    assert client.get(f"/v1/tasks/{r.json()['task_id']}", headers=ADMIN).json()["name"] == \
        "Préférences 🎬 v2"


def test_api_pages_that_load_a_cdn_are_not_served_but_the_contract_is(
        client: TestClient) -> None:
    assert client.get("/docs").status_code == 404
    assert client.get("/redoc").status_code == 404
    assert client.get("/openapi.json").json()["info"]["title"] == "seedfed coordinator"


# -- uploads: repeated headers, and a close that fails after the answer ---------------------------
@pytest.fixture(params=[True, False], ids=["fast path", "route"])
def round_open(request: pytest.FixtureRequest, sqlite_url: str, tmp_path: Path,
               spec: TaskSpec) -> Iterator[tuple[TestClient, str, list[str], RoundPlan]]:
    settings = make_settings(sqlite_url, tmp_path / "store", upload_fast_path=request.param,
                             tick_interval_s=0.05, close_retry_base_s=0.05)
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/tasks", json={"spec": spec.to_dict(), "quorum": 2,
                                           "schedule": "manual"}, headers=ADMIN)
        task_id, join = r.json()["task_id"], r.json()["join_token"]
        tokens = [client.post(f"/v1/tasks/{task_id}/devices",
                              json={"join_token": join}).json()["token"] for _ in range(2)]
        plan = RoundPlan.model_validate(client.post(f"/v1/tasks/{task_id}/rounds",
                                                    headers=ADMIN).json())
        yield client, task_id, tokens, plan


def _binary(plan: RoundPlan, token: str, *extra: tuple[str, str]) -> dict[str, Any]:
    m = np.full((plan.steps, plan.perturbations), 0.25, dtype=np.float32)
    headers = [("Authorization", f"Bearer {token}"),
               ("Content-Type", "application/octet-stream"),
               ("X-Seedfed-Version", str(plan.version)), ("X-Seedfed-Num-Examples", "5"),
               ("X-Seedfed-Loss", "0.5"), *extra]
    return {"content": pack_binary(m), "headers": headers}


@pytest.mark.parametrize("repeated", [("X-Seedfed-Num-Examples", "100000"),
                                      ("x-seedfed-loss", "0.1"), ("X-Seedfed-Version", "0"),
                                      ("Authorization", "Bearer other")])
def test_a_repeated_header_is_refused_and_nothing_is_stored(
        round_open: tuple[TestClient, str, list[str], RoundPlan],
        repeated: tuple[str, str]) -> None:
    client, task_id, tokens, plan = round_open
    url = f"/v1/tasks/{task_id}/rounds/{plan.round}/uploads"

    r = client.post(url, **_binary(plan, tokens[0], repeated))

    assert r.status_code == 400, r.text
    assert r.json()["error"] == "MalformedRequestError"
    assert repeated[0].lower() in r.json()["detail"] and "more than once" in r.json()["detail"]
    assert client.post(url, **_binary(plan, tokens[0])).status_code == 200  # not stored before


def test_a_close_failing_after_the_answer_logs_one_line_and_the_ticker_retries(
        round_open: tuple[TestClient, str, list[str], RoundPlan],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Arrange: the database connection dies when the upload path closes the round
    client, task_id, tokens, plan = round_open
    url = f"/v1/tasks/{task_id}/rounds/{plan.round}/uploads"
    real = service.close_if_due
    failures: list[int] = []

    def dying(rt: Any, *, task_id: str, round_id: int) -> Any:
        failures.append(round_id)
        raise OperationalError("UPDATE rounds", {}, Exception("terminating connection due to "
                                                              "administrator command\nmore"))

    monkeypatch.setattr(service, "close_if_due", dying)

    # Act
    with caplog.at_level(logging.INFO):
        answers = [client.post(url, **_binary(plan, t)).status_code for t in tokens]
        monkeypatch.setattr(service, "close_if_due", real)
        closed = _wait_for_version(client, task_id, 1)

    # Assert: both uploads answered 200; one line, no traceback; the ticker closed the round
    assert answers == [200, 200] and failures
    lines = [r for r in caplog.records if "after an upload failed" in r.getMessage()]
    assert len(lines) == len(failures) and all(r.exc_info is None for r in lines)
    assert "\n" not in lines[0].getMessage() and "ticker retries" in lines[0].getMessage()
    assert closed


def _wait_for_version(client: TestClient, task_id: str, version: int) -> bool:
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()["version"] >= version:
            return True
        time.sleep(0.05)
    return False


# -- a streamed body past the limit, against a real server ----------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings: Settings = live_settings(tmp_path_factory.mktemp("live"))
    with serve(create_app(settings)) as base:
        yield base


@pytest.mark.parametrize(("path", "auth", "status"), [
    ("/v1/tasks", True, b"413"), ("/v1/tasks/0123456789abcdef/devices", False, b"413"),
    # an upload's token is checked before its body is read: answered at once, body unread
    ("/v1/tasks/0123456789abcdef/rounds/1/uploads", False, b"401")])
def test_a_chunked_body_past_the_limit_is_refused_early(live: str, path: str, auth: bool,
                                                        status: bytes) -> None:
    # Arrange: a chunked request that would stream 50 MB
    host, port = live.removeprefix("http://").split(":")
    c = socket.create_connection((host, int(port)))
    c.settimeout(10)
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\n"
            + (f"Authorization: Bearer {ADMIN_TOKEN}\r\n" if auth else "") + "\r\n")
    c.sendall(head.encode())
    chunk = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"

    # Act: send megabytes until the server answers (or 50 have gone)
    sent = 0
    while sent < 50 and not select.select([c], [], [], 0)[0]:
        try:
            c.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += 1
    answer = b""
    try:
        while more := c.recv(4096):  # until the server closes the connection
            answer += more
    except ConnectionResetError:  # it closed with our bytes unread: a reset
        pass

    # Assert: refused after a megabyte or two, with the error body, and closed
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:80]
    assert b"connection: close" in answer.lower() and sent < 10
    if status == b"413":
        assert b'"error":"PayloadTooLargeError"' in answer.replace(b" ", b"")
    c.close()
