"""`seedfed protocol check URL` against a real coordinator passes every check (a task's log
replayed from v0 with the reference included), and fails against a service that breaks the
contract; `seedfed protocol vectors --all` prints the whole kit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from seedfed.server.app import create_app
from seedfed.shared.model.conformance import all_vectors
from seedfed.shared.protocol.coordinator_client import CoordinatorClient
from typer.testing import CliRunner

from seedfed.admin_client import AdminClient
from seedfed.cli import app
from seedfed.operator_cli import CreateOptions, build_spec
from tests.fleet_helpers import make_tiny_bert
from tests.live_coordinator import ADMIN_TOKEN, live_settings, serve


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A coordinator whose task has committed two versions (two rounds, two devices)."""
    tmp = tmp_path_factory.mktemp("check")
    model = make_tiny_bert(tmp / "bert")
    with serve(create_app(live_settings(tmp, auto_open_rounds=False))) as url, \
            httpx.Client(base_url=url) as http:
        admin = AdminClient(http, ADMIN_TOKEN)
        spec, _ = build_spec(CreateOptions(recipe=None, model=str(model), scope="lora",
                                           sets=("steps=2", "perturbations=3", "lr=1e-2")))
        created = admin.create_task(spec.to_dict(), quorum=5)
        task_id = created["task_id"]
        tokens = [CoordinatorClient(http).enroll(task_id, created["join_token"])[1]
                  for _ in range(2)]
        rng = np.random.default_rng(0)
        for _ in range(2):
            plan = admin.open_round(task_id)
            for tok in tokens:
                CoordinatorClient(http, tok).upload(
                    task_id, plan.round, plan.version,
                    rng.normal(size=(plan.steps, plan.perturbations)), 10, 0.5)
            admin.close_round(task_id, plan.round)
        yield url, task_id


def test_a_real_coordinator_passes_every_check(live: tuple[str, str]) -> None:
    url, task_id = live

    r = CliRunner().invoke(app, ["protocol", "check", "--url", url, "--json"],
                           env={"SEEDFED_ADMIN_TOKEN": ADMIN_TOKEN})

    result = json.loads(r.stdout)
    assert r.exit_code == 0, r.stdout
    names = {c["name"]: c for c in result["checks"]}
    assert names[f"{task_id}: replay of 2 log entries"]["ok"] is True
    assert names[f"{task_id}: v0 + log = current checksum"]["ok"] is True
    assert all(c["ok"] for c in result["checks"])


def test_without_a_token_only_the_service_checks_run(live: tuple[str, str]) -> None:
    r = CliRunner().invoke(app, ["protocol", "check", live[0]], env={"SEEDFED_ADMIN_TOKEN": ""})

    assert r.exit_code == 0
    assert "skip  tasks" in r.stdout and "ok    body not JSON -> 400 error body" in r.stdout


def test_a_service_that_breaks_the_contract_fails(tmp_path: Path) -> None:
    # Arrange: answers health, but no routes and FastAPI's own error bodies
    bare = FastAPI()

    @bare.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    with serve(bare) as url:
        r = CliRunner().invoke(app, ["protocol", "check", url, "--json"])

    result = json.loads(r.stdout)
    failed = {c["name"] for c in result["checks"] if c["ok"] is False}
    assert r.exit_code == 1
    assert {"GET /readyz", "routes in /openapi.json", "unknown path -> 404 error body"} <= failed


def test_vectors_all_prints_the_kit() -> None:
    r = CliRunner().invoke(app, ["protocol", "vectors", "--all"])

    assert r.exit_code == 0
    assert json.loads(r.stdout) == json.loads(json.dumps(all_vectors(), ensure_ascii=False))


def test_the_positional_url_still_works_and_says_it_is_deprecated(
        live: tuple[str, str]) -> None:
    r = CliRunner().invoke(app, ["protocol", "check", live[0], "--admin-token", ADMIN_TOKEN])

    assert r.exit_code == 0, r.output
    assert "deprecated: use --url" in r.stderr
    assert ADMIN_TOKEN not in r.output
