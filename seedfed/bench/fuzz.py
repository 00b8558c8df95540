"""Schemathesis against a real coordinator: no 5xx, and every answer inside the OpenAPI contract.

Target: 0 5xx over >= 30,000 schemathesis requests. A `seedfed coordinator` process
serves on loopback (SQLite or PostgreSQL); one task (a tiny BERT) with an enrolled device and an
open round is the fixed data the requests reach. Schemathesis loads the coordinator's own
/openapi.json and generates requests for every operation, positive (inside the schema) and
negative (outside it), with the task's id fixed in most of them, the open round's number and
the current version in half, and the admin token, the device token, a forged token or none,
by the operation's role. Every answer is checked: not a 5xx, a documented status, a
documented content type and headers, a body matching the documented schema, and schema-
invalid data refused with a 4xx. After the run the server's log is searched for tracebacks.

    seedfed bench fuzz --requests 30000 --json benchmarks/results/fuzz.json
    seedfed bench fuzz --db postgres --requests 30000

Prints one JSON document (requests, statuses, 5xx, violations by check, tracebacks in the
server log, wall time) and exits 1 when a 5xx, a violation or a traceback was seen.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from seedfed.bench.coordinator_process import coordinator, database, tiny_model
from seedfed.bench.registry import bench_parser
from seedfed.bench.report import write_json

ADMIN = "fuzz-admin-token-" + "x" * 16
# Operations only the admin may call; the others take a device token (or the admin's).
ADMIN_ONLY = {("POST", "/v1/tasks"), ("GET", "/v1/tasks"), ("GET", "/v1/tasks/{task_id}/stats"),
              ("GET", "/v1/tasks/{task_id}/rounds"), ("POST", "/v1/tasks/{task_id}/rounds"),
              ("POST", "/v1/tasks/{task_id}/rounds/{round_number}/close"),
              ("DELETE", "/v1/tasks/{task_id}/devices/{device_id}")}
DEVICE_ONLY = {("POST", "/v1/tasks/{task_id}/rounds/{round_number}/uploads")}


def task_spec(model: Path) -> dict[str, Any]:
    from seedfed.shared.protocol.task import Hyper, LoraOptions, TaskSpec

    return TaskSpec(model_path=str(model), num_labels=2, label_texts=("negative", "positive"),
                    scope="lora", lora=LoraOptions(r=2),
                    hyper=Hyper(lr=1e-2, eps=1e-3, steps=2, perturbations=3,
                                batch_size=4)).to_dict()


class World:
    """The fixed data: one task, a device of it, a device of another task, an open round."""

    def __init__(self, base: str, model: Path) -> None:
        import httpx

        self.http = httpx.Client(base_url=base, timeout=60)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        self.admin = admin
        r = self.http.post("/v1/tasks", json={"spec": task_spec(model), "quorum": 3,
                                              "name": "fuzz"}, headers=admin)
        r.raise_for_status()
        self.task_id, join = r.json()["task_id"], r.json()["join_token"]
        r = self.http.post(f"/v1/tasks/{self.task_id}/devices", json={"join_token": join})
        r.raise_for_status()
        self.device_id, self.device_token = r.json()["device_id"], r.json()["token"]
        other = self.http.post("/v1/tasks", json={"spec": task_spec(model)}, headers=admin)
        other.raise_for_status()
        r = self.http.post(f"/v1/tasks/{other.json()['task_id']}/devices",
                           json={"join_token": other.json()["join_token"]})
        r.raise_for_status()
        self.foreign_token = r.json()["token"]
        # One real round first, so the log, the catch-up plan and the snapshots have a
        # version 1 to serve; the fuzzed device has not uploaded to the round left open.
        self.http.post(f"/v1/tasks/{self.task_id}/rounds", headers=admin).raise_for_status()
        for _ in range(2):
            r = self.http.post(f"/v1/tasks/{self.task_id}/devices", json={"join_token": join})
            r.raise_for_status()
            self.upload(r.json()["token"])
        self.http.post(f"/v1/tasks/{self.task_id}/rounds/1/close",
                       headers=admin).raise_for_status()
        self.http.post(f"/v1/tasks/{self.task_id}/rounds", headers=admin).raise_for_status()

    def upload(self, token: str) -> None:
        import numpy as np

        from seedfed.shared.protocol.wire import RoundPlan, Upload

        auth = {"Authorization": f"Bearer {token}"}
        plan = RoundPlan.model_validate(self.http.get(
            f"/v1/tasks/{self.task_id}/rounds/current", headers=auth).json())
        g = np.random.default_rng(plan.round).normal(size=(plan.steps, plan.perturbations))
        self.http.post(f"/v1/tasks/{self.task_id}/rounds/{plan.round}/uploads",
                       content=Upload.build(plan, g, 4, 0.5).model_dump_json(),
                       headers={**auth, "Content-Type": "application/json"}
                       ).raise_for_status()

    def state(self) -> tuple[int, int]:
        """(latest round, current version); reopens a round when none is open."""
        status = self.http.get(f"/v1/tasks/{self.task_id}", headers=self.admin).json()
        if status["state"] == "idle":
            self.http.post(f"/v1/tasks/{self.task_id}/rounds", headers=self.admin)
            status = self.http.get(f"/v1/tasks/{self.task_id}", headers=self.admin).json()
        return int(status["round"] or 0), int(status["version"])


def checks() -> list[Callable[..., Any]]:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    return [not_a_server_error, status_code_conformance, content_type_conformance,
            response_headers_conformance, response_schema_conformance, negative_data_rejection]


def fuzz(base: str, world: World, *, requests: int, seed: int, batch: int = 50,
         progress: bool = False, doc: dict[str, Any] | None = None,
         only: set[str] | None = None) -> dict[str, Any]:
    """Send at least `requests` schemathesis requests; counts of statuses and violations.

    `doc`: an OpenAPI document to use instead of the server's (a test's doctored copy, to show
    the checks fail when the document is wrong); `only`: "METHOD /path" operations to fuzz."""
    import requests as rq
    import schemathesis
    from hypothesis import HealthCheck, Phase, given
    from hypothesis import seed as hseed
    from hypothesis import settings as hsettings
    from schemathesis.config import SchemathesisConfig
    from schemathesis.core.result import Ok
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(base + "/openapi.json", config=SchemathesisConfig()) \
        if doc is None else schemathesis.openapi.from_dict(doc, config=SchemathesisConfig())
    ops = [r.ok() for r in schema.get_all_operations() if isinstance(r, Ok)]
    if only is not None:
        ops = [op for op in ops if f"{op.method.upper()} {op.path}" in only]
    rng = random.Random(seed)
    session = rq.Session()
    to_check = checks()
    statuses: Counter[int] = Counter()
    by_op: Counter[str] = Counter()
    violations: Counter[str] = Counter()
    examples: dict[str, str] = {}
    generation_errors: Counter[str] = Counter()
    sent = 0
    started = time.perf_counter()
    last_print = started

    # Drawn, not taken from the loop index: with 21 operations, `i % 3` would give each
    # operation the same mode in every cycle (every operation must see both).
    def token_for(key: tuple[str, str]) -> str | None:
        admin_only = key in ADMIN_ONLY or "/join-tokens" in key[1]
        if rng.random() < 0.2:  # the wrong credentials: refused with a documented 401/403
            return rng.choice([None, "forged-token", world.foreign_token,
                               world.device_token if admin_only else ADMIN])
        if admin_only:
            return ADMIN
        if key in DEVICE_ONLY:
            return world.device_token
        return rng.choice([ADMIN, world.device_token])

    current = {"mode": ""}  # what the generated cases of this batch are (for the counts)
    i = 0
    while sent < requests:
        op = ops[i % len(ops)]
        key = (op.method.upper(), op.path)
        round_number, version = world.state()
        fixed: dict[str, Any] = {}
        names = {p.name for p in op.path_parameters}
        if "task_id" in names and rng.random() < 0.85:
            fixed["task_id"] = world.task_id
        if rng.random() < 0.5:
            if "round_number" in names:
                fixed["round_number"] = round_number
            if "version" in names:
                fixed["version"] = version
            if "device_id" in names and rng.random() < 0.2:
                fixed["device_id"] = world.device_id  # rarely: revoking it ends its uploads
        token = token_for(key)
        headers = {"Authorization": f"Bearer {token}"} if token is not None else None
        mode = GenerationMode.NEGATIVE if rng.random() < 1 / 3 else GenerationMode.POSITIVE
        current["mode"] = mode.value
        media = None
        if key in DEVICE_ONLY:
            media = rng.choice(["application/json", "application/octet-stream"])
        strategy = op.as_strategy(generation_mode=mode, path_parameters=fixed or None,
                                  headers=headers, media_type=media)
        n = min(batch, requests - sent)

        @hsettings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
                   suppress_health_check=list(HealthCheck))
        @hseed(rng.getrandbits(64))
        @given(strategy)
        def one(case: Any) -> None:
            nonlocal sent
            response = case.call(base_url=base, session=session, timeout=60)
            sent += 1
            label = f"{case.operation.method.upper()} {case.operation.path}"
            statuses[response.status_code] += 1
            by_op[f"{label} {current['mode']}"] += 1
            try:
                case.validate_response(response, checks=to_check)
            except BaseException as e:  # noqa: BLE001 - a check's failure is data here
                failures = getattr(e, "exceptions", None) or [e]
                for f in failures:
                    name = f"{label}: {getattr(f, 'title', type(f).__name__)}"
                    violations[name] += 1
                    if name not in examples:
                        examples[name] = (f"{case.as_curl_command()}\n-> "
                                          f"{response.status_code} {response.text[:300]}\n"
                                          f"{str(f)[:600]}")
                        if progress:
                            print(f"violation: {name}\n{examples[name]}", file=sys.stderr,
                                  flush=True)

        try:
            one()
        except Exception as e:  # generation can be impossible (e.g. nothing left to negate)
            generation_errors[f"{key[0]} {key[1]} {mode.value}: {type(e).__name__}"] += 1
        i += 1
        if progress and time.perf_counter() - last_print > 30:
            last_print = time.perf_counter()
            print(f"  {sent} requests, {sum(v for k, v in statuses.items() if k >= 500)} 5xx, "
                  f"{sum(violations.values())} violations, "
                  f"{sent / (last_print - started):.0f} req/s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    return {"requests": sent, "wall_s": round(wall, 1), "requests_per_s": round(sent / wall, 1),
            "server_errors": sum(v for k, v in statuses.items() if k >= 500),
            "violations": sum(violations.values()),
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "violations_by_check": dict(violations.most_common()),
            "violation_examples": examples, "requests_by_operation": dict(sorted(by_op.items())),
            "generation_errors": dict(generation_errors), "operations": len(ops),
            "seed": seed}


@contextlib.contextmanager
def serve(db: str) -> Iterator[tuple[str, World, Path]]:
    """(base URL, the fixed data, the server's log file) of a fresh coordinator."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = tiny_model(tmp / "model")
        log_path = tmp / "coordinator.log"
        with database(db, tmp, "seedfed_fuzz") as url, coordinator(
                url, tmp / "store", ADMIN, log_path, env={"OMP_NUM_THREADS": "1"},
                timeout=120) as (base, _):
            yield base, World(base, model), log_path


def tracebacks(log_path: Path) -> tuple[int, str | None]:
    """How many tracebacks the server logged, and the first one."""
    log = log_path.read_text(errors="replace")
    marker = "Traceback (most recent call last)"
    at = log.find(marker)
    return log.count(marker), None if at < 0 else log[max(0, at - 300):at + 3000]


def run(*, db: str, requests: int, seed: int, progress: bool = False) -> dict[str, Any]:
    with serve(db) as (base, world, log_path):
        result = fuzz(base, world, requests=requests, seed=seed, progress=progress)
        result["db"] = db
        count, first = tracebacks(log_path)
    result["server_tracebacks"] = count
    if first is not None:
        result["first_traceback"] = first
    return result


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("fuzz")
    p.add_argument("--requests", type=int, default=30_000)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    result = run(db=args.db, requests=args.requests, seed=args.seed, progress=True)
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(args.json, result)
    clean = not (result["server_errors"] or result["violations"] or result["server_tracebacks"])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
