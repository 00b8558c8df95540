"""`seedfed protocol check --url URL`: a self-test of a live coordinator against the protocol.

It checks what a device depends on, with the reference implementation as the judge:

- liveness and readiness answer; `/openapi.json` lists every route of docs/protocol.md section 8;
- errors carry the one body (`detail` + `error`) with the documented statuses: an unknown path
  is a 404, a missing token a 401 (with `WWW-Authenticate`), a body that is not JSON a 400;
- for each task the token can read (one task with `--task`, every task for the admin token):
  the snapshot of version 0 hashes to its `X-Seedfed-Checksum`, replaying the whole log on it
  (`shared/replay.apply_seeds`) reproduces every entry's checksum and the task's current
  checksum, and the current snapshot hashes to that checksum too.

A ternary task's fp32 snapshot is its coordinator's master (every latent, not the masked
state the log's checksums cover), so its replay check is skipped with a note.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from safetensors.torch import load as load_safetensors
from torch import nn

from seedfed.shared.model.replay import apply_seeds, checksum, state_checksum
from seedfed.shared.model.scopes import Scope, ScopedTensor
from seedfed.shared.protocol.coordinator_client import (
    CoordinatorClient,
    CoordinatorHttpError,
    CoordinatorUnreachableError,
)
from seedfed.shared.protocol.messages import Routes
from seedfed.shared.protocol.redact import redact_url, remember
from seedfed.shared.protocol.task import TaskSpec

#: The paths (parameters written `{}`) a device calls (docs/protocol.md section 8).
_EXAMPLE = Routes("{}")
DEVICE_ROUTES: tuple[str, ...] = (
    _EXAMPLE.task, _EXAMPLE.spec, _EXAMPLE.devices, _EXAMPLE.catchup, _EXAMPLE.log,
    _EXAMPLE.current_round, _EXAMPLE.snapshot(0).replace("/0", "/{}"),
    _EXAMPLE.uploads(0).replace("/0/", "/{}/"), "/healthz", "/readyz",
)
#: Scopes whose fp32 snapshot is not the state the log's checksums cover.
NO_REPLAY_SCOPES = frozenset({"ternary"})


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: skipped
    detail: str = ""


def _error_body(resp: httpx.Response, status: int) -> str | None:
    """Why `resp` is not a `status` answer with the one error body (None: it is)."""
    if resp.status_code != status:
        return f"status {resp.status_code}, expected {status}"
    try:
        body = resp.json()
    except ValueError:
        return f"body is not JSON: {resp.text[:80]!r}"
    if not (isinstance(body, dict) and isinstance(body.get("detail"), str)
            and isinstance(body.get("error"), str)):
        return f"body lacks detail/error strings: {str(body)[:120]}"
    return None


def _service_checks(http: httpx.Client) -> Iterator[Check]:
    for path in ("/healthz", "/readyz"):
        r = http.get(path)
        yield Check(f"GET {path}", r.status_code == 200, f"{r.status_code} {r.text[:80]}")
    r = http.get("/openapi.json")
    if r.status_code != 200:
        yield Check("routes in /openapi.json", False, f"status {r.status_code}")
    else:
        paths = {re.sub(r"\{[^}]*\}", "{}", p) for p in r.json().get("paths", {})}
        missing = [p for p in DEVICE_ROUTES if p not in paths]
        yield Check("routes in /openapi.json", not missing,
                    f"missing {missing}" if missing else f"all {len(DEVICE_ROUTES)} device routes")
    cases: tuple[tuple[str, Callable[[], httpx.Response], int], ...] = (
        ("unknown path -> 404 error body", lambda: http.get("/v1/no-such-route"), 404),
        ("no token -> 401 error body", lambda: http.get(Routes("t").task), 401),
        ("body not JSON -> 400 error body", lambda: http.post(
            Routes("t").devices, content=b"{not json", headers={"Content-Type":
                                                                "application/json"}), 400),
    )
    for name, call, status in cases:
        why = _error_body(call(), status)
        yield Check(name, why is None, why or "")


def _replay_from_v0(api: CoordinatorClient, task_id: str, spec: TaskSpec, version: int,
                    current: str) -> Iterator[Check]:
    data, header = api.snapshot(task_id, 0)
    state = {k: v.to(torch.float32).reshape(-1).clone()
             for k, v in load_safetensors(data).items()}
    got = state_checksum(state)
    yield Check(f"{task_id}: snapshot v0 checksum", got == header,
                f"file hashes to {got[:16]}..., header {header[:16]}...")
    scope = Scope(nn.Module(), [ScopedTensor(name, t) for name, t in state.items()])
    if spec.step_scales:
        scope.set_step_scales(spec.step_scales)
    entries = api.log_since(task_id, 0)
    bad = []
    for wire in entries:
        e = wire.to_entry()
        apply_seeds(scope, e.seeds, e.coefs)
        if checksum(scope) != e.checksum:
            bad.append(e.version)
    yield Check(f"{task_id}: replay of {len(entries)} log entries", not bad and
                len(entries) == version,
                f"checksum differs after v{bad[:5]}" if bad else
                f"{len(entries)} entries for version {version}")
    final = checksum(scope)
    yield Check(f"{task_id}: v0 + log = current checksum", final == current,
                f"{final[:16]}... vs {current[:16]}...")


def _task_checks(api: CoordinatorClient, task_id: str) -> Iterator[Check]:
    status = api.status(task_id)
    spec = TaskSpec.from_dict(api.spec(task_id))
    yield Check(f"{task_id}: status and spec", True, f"v{status.version}, scope {spec.scope}")
    data, header = api.snapshot(task_id, status.version)
    got = state_checksum({k: v.to(torch.float32).reshape(-1)
                          for k, v in load_safetensors(data).items()})
    if spec.scope in NO_REPLAY_SCOPES:
        yield Check(f"{task_id}: replay from v0", None,
                    f"scope {spec.scope}: the fp32 snapshot is the coordinator's master")
        return
    yield Check(f"{task_id}: current snapshot checksum",
                got == header == status.checksum,
                f"file {got[:16]}..., header {header[:16]}..., status {status.checksum[:16]}...")
    yield from _replay_from_v0(api, task_id, spec, status.version, status.checksum)


def run_checks(http: httpx.Client, token: str | None = None, task: str | None = None,
               ) -> list[Check]:
    """Every check against the coordinator `http` points at (its base_url)."""
    checks = list(_service_checks(http))
    if token is None:
        checks.append(Check("tasks", None, "no token given: only the service checks ran"))
        return checks
    api = CoordinatorClient(http, token)
    try:
        ids = [task] if task else [str(t["task_id"]) for t in
                                   api.request("GET", Routes.ROOT).json()]
    except CoordinatorHttpError as e:
        return [*checks, Check("list tasks", False, str(e))]
    for task_id in ids:
        try:
            checks.extend(_task_checks(api, task_id))
        except (CoordinatorHttpError, ValueError, KeyError) as e:
            checks.append(Check(f"{task_id}: readable", False, f"{type(e).__name__}: {e}"))
    return checks


def check_coordinator(url: str, token: str | None = None, task: str | None = None,
                      timeout_s: float = 120.0) -> list[Check]:
    """`run_checks` against the coordinator at `url`; one that does not answer at all raises
    CoordinatorUnreachableError (its URL, never a header) instead of a list of failures."""
    remember(token)
    base = url.rstrip("/")
    try:
        with httpx.Client(base_url=base, timeout=timeout_s) as http:
            return run_checks(http, token=token, task=task)
    except httpx.TransportError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CoordinatorUnreachableError(redact_url(base), reason) from None


def summary(checks: list[Check]) -> dict[str, Any]:
    return {"ok": all(c.ok is not False for c in checks),
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks]}
