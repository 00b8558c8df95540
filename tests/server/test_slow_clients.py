"""Slow clients cannot hold a real coordinator's connections: 100 stalled request bodies on the
unauthenticated enrolment route are closed (the oldest at once, beyond the anonymous cap; the
rest answered 408 after `body_timeout_s`) while honest devices keep uploading at their usual
latency. A `seedfed coordinator` process, as deployed (uvicorn with the guarded protocol)."""

from __future__ import annotations

import select
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from seedfed.bench.coordinator_process import coordinator, enroll_fleet, tiny_model

ADMIN = "slow-client-admin-" + "k" * 16
STALLED = 100
CAP = 60  # anonymous connections: 40 of the 100 stalled ones are evicted at once
BODY_TIMEOUT_S = 2.0
UPLOADS = 30  # honest uploads before the flood and as many during it


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, str, list[str], list[str]]]:
    """(base URL, task id, device tokens, upload bodies) of a coordinator process."""
    from seedfed.shared.protocol.task import Hyper, LoraOptions, TaskSpec
    from seedfed.shared.protocol.wire import Upload

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        spec = TaskSpec(model_path=str(tiny_model(tmp / "model")),
                        label_texts=("negative", "positive"), lora=LoraOptions(r=2),
                        hyper=Hyper(steps=1, perturbations=64))
        url = f"sqlite:///{tmp / 'c.db'}"
        task_id, devices, plan = enroll_fleet(url, tmp / "store", ADMIN, spec, quorum=1000,
                                              devices=2 * UPLOADS, open_round=True)
        assert plan is not None
        rng = np.random.default_rng(0)
        bodies = [Upload.build(plan, rng.normal(size=(1, 64)), 8, 0.5).model_dump_json()
                  for _ in devices]
        env = {"SEEDFED_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
               "SEEDFED_MAX_ANONYMOUS_CONNECTIONS": str(CAP), "OMP_NUM_THREADS": "1"}
        with coordinator(url, tmp / "store", ADMIN, tmp / "c.log", env=env) as (base, _):
            yield base, task_id, [t for _, t in devices], bodies


def _uploads(client: httpx.Client, task_id: str, tokens: list[str], bodies: list[str]
             ) -> list[float]:
    """Seconds per honest upload (each device its own token, one keep-alive connection)."""
    out = []
    for token, body in zip(tokens, bodies, strict=True):
        t0 = time.perf_counter()
        r = client.post(f"/v1/tasks/{task_id}/rounds/1/uploads", content=body,
                        headers={"Authorization": f"Bearer {token}",
                                 "Content-Type": "application/json"})
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    return out


def _stall(base: str, task_id: str) -> socket.socket:
    """An enrolment whose body stops after 1 of its declared 100 bytes."""
    host, port = base.removeprefix("http://").split(":")
    c = socket.create_connection((host, int(port)))
    c.sendall((f"POST /v1/tasks/{task_id}/devices HTTP/1.1\r\nHost: x\r\n"
               "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode())
    return c


def _fate(c: socket.socket) -> tuple[str, float]:
    """How a stalled connection ended ("408" or "closed") and when (monotonic)."""
    c.setblocking(False)
    data = b""
    try:
        while chunk := c.recv(4096):
            data += chunk
    except (BlockingIOError, ConnectionResetError):
        pass
    return ("408" if data.startswith(b"HTTP/1.1 408") else "closed"), time.monotonic()


@pytest.mark.slow
def test_stalled_bodies_are_dropped_while_honest_uploads_keep_their_latency(
        served: tuple[str, str, list[str], list[str]]) -> None:
    base, task_id, tokens, bodies = served
    with httpx.Client(base_url=base, timeout=30) as client:
        before = _uploads(client, task_id, tokens[:UPLOADS], bodies[:UPLOADS])

        # Act: 100 stalled bodies, then honest uploads while they hang
        started = time.monotonic()
        stalled = [_stall(base, task_id) for _ in range(STALLED)]
        during = _uploads(client, task_id, tokens[UPLOADS:], bodies[UPLOADS:])
        ended: dict[int, tuple[str, float]] = {}
        deadline = started + BODY_TIMEOUT_S + 10
        while len(ended) < STALLED and time.monotonic() < deadline:
            ready, _, _ = select.select([c for i, c in enumerate(stalled) if i not in ended],
                                        [], [], 0.2)
            for c in ready:
                ended[stalled.index(c)] = _fate(c)

    for c in stalled:
        c.close()
    # Assert: every stalled connection ended, none held past the body deadline (+ slack)
    assert len(ended) == STALLED, f"{STALLED - len(ended)} stalled bodies still held"
    late = max(t for _, t in ended.values()) - started
    assert late < BODY_TIMEOUT_S + 5
    # the 40 oldest went at once to make room (cap 60); the others were answered 408
    evicted = [i for i, (how, t) in ended.items() if how == "closed" and t - started < 1.5]
    timed_out = [i for i, (how, _) in ended.items() if how == "408"]
    assert len(evicted) >= STALLED - CAP - 5 and len(timed_out) >= CAP - 5, (evicted, timed_out)
    # honest uploads: every one answered 200 (in _uploads), at their usual latency
    p50_before, p50_during = statistics.median(before), statistics.median(during)
    assert p50_during < max(3 * p50_before, p50_before + 0.05), (p50_before, p50_during)

