"""Join tokens: a device limit per token, rotation and revocation (admin routes),
and the migration that moves each existing task's token into its own table."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from seedfed.server.app import create_app
from seedfed.server.db import make_engine
from seedfed.server.settings import Settings
from seedfed.shared.protocol.task import TaskSpec

from tests.server.conftest import make_settings
from tests.server.test_api import ADMIN, enroll, new_task


@pytest.fixture
def client(sqlite_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(make_settings(sqlite_url, tmp_path / "store",
                                             tick_interval_s=60))) as c:
        yield c


def try_enroll(client: TestClient, task_id: str, join: str) -> int:
    return client.post(f"/v1/tasks/{task_id}/devices", json={"join_token": join}).status_code


def test_a_join_token_enrolls_at_most_its_limit(client: TestClient, spec: TaskSpec) -> None:
    task_id, join = new_task(client, spec, max_devices_per_token=2)

    codes = [try_enroll(client, task_id, join) for _ in range(3)]

    assert codes == [201, 201, 403]


def test_the_default_limit_comes_from_the_settings(sqlite_url: str, tmp_path: Path,
                                                   spec: TaskSpec) -> None:
    settings: Settings = make_settings(sqlite_url, tmp_path / "store",
                                       max_devices_per_join_token=1)
    with TestClient(create_app(settings)) as client:
        task_id, join = new_task(client, spec)

        codes = [try_enroll(client, task_id, join) for _ in range(2)]
        (info,) = client.get(f"/v1/tasks/{task_id}/join-tokens", headers=ADMIN).json()

    assert codes == [201, 403]
    assert (info["max_devices"], info["enrolled"]) == (1, 1)


def test_rotation_revokes_the_old_token_and_revocation_the_new(client: TestClient,
                                                               spec: TaskSpec) -> None:
    # Arrange
    task_id, old = new_task(client, spec)
    enrolled = enroll(client, task_id, old)

    # Act: rotate, then revoke the new token too
    r = client.post(f"/v1/tasks/{task_id}/join-tokens", json={"max_devices": 5},
                    headers=ADMIN)
    new, new_id = r.json()["join_token"], r.json()["token_id"]
    after_rotation = (try_enroll(client, task_id, old), try_enroll(client, task_id, new))
    gone = client.delete(f"/v1/tasks/{task_id}/join-tokens/{new_id}", headers=ADMIN)
    after_revocation = try_enroll(client, task_id, new)
    tokens = client.get(f"/v1/tasks/{task_id}/join-tokens", headers=ADMIN).json()

    # Assert: the device enrolled with the old token keeps working
    assert r.status_code == 201 and len(r.json()["revoked"]) == 1
    assert after_rotation == (401, 201)
    assert gone.status_code == 204 and after_revocation == 401
    assert [t["revoked_at"] is not None for t in tokens] == [True, True]
    assert client.get(f"/v1/tasks/{task_id}",
                      headers={"Authorization": f"Bearer {enrolled[1]}"}).status_code == 200


def test_join_token_routes_need_the_admin_token(client: TestClient, spec: TaskSpec) -> None:
    task_id, join = new_task(client, spec)

    r = client.post(f"/v1/tasks/{task_id}/join-tokens", json={},
                    headers={"Authorization": f"Bearer {join}"})

    assert r.status_code == 401


def test_migration_moves_an_existing_tasks_join_token(tmp_path: Path) -> None:
    # Arrange: a database at revision 0001 with a task and one enrolled device
    from seedfed.server.db import upgrade
    from seedfed.server.service.tasks import hash_token

    engine = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    upgrade(engine, "0001")
    with engine.begin() as c:
        c.execute(sa.text(
            "INSERT INTO tasks (id, name, spec_json, format, quorum, round_timeout_s, "
            "join_token_hash, secret, current_version, scope_numel, created_at) VALUES "
            "('t1', 't1', '{}', 'fp32', 1, 60, :h, 's', 0, 1, '2026-01-01 00:00:00')"),
            {"h": hash_token("old-join")})
        c.execute(sa.text("INSERT INTO devices (id, task_id, token_hash, created_at) VALUES "
                          "('d1', 't1', 'x', '2026-01-01 00:00:00')"))

    # Act
    upgrade(engine, "head")
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT task_id, token_hash, max_devices, enrolled, "
                                 "revoked_at FROM join_tokens")).all()
    engine.dispose()

    # Assert
    assert rows == [("t1", hash_token("old-join"), None, 1, None)]


def test_a_join_token_reads_its_tasks_definition_and_nothing_else(client: TestClient,
                                                                   spec: TaskSpec) -> None:
    # Arrange: a device checks its data and model against the task before it enrolls
    task_id, join = new_task(client, spec)
    other_id, _ = new_task(client, spec)
    bearer = {"Authorization": f"Bearer {join}"}

    # Act
    read = client.get(f"/v1/tasks/{task_id}/spec", headers=bearer)
    other = client.get(f"/v1/tasks/{other_id}/spec", headers=bearer)
    status = client.get(f"/v1/tasks/{task_id}", headers=bearer)
    devices = client.get(f"/v1/tasks/{task_id}/stats", headers=ADMIN).json()["devices"]
    client.post(f"/v1/tasks/{task_id}/join-tokens", headers=ADMIN, json={})  # rotates
    after_rotation = client.get(f"/v1/tasks/{task_id}/spec", headers=bearer)

    # Assert: the spec, without enrolling; no other task, no other route; not once revoked
    assert read.status_code == 200 and read.json()["model_path"] == spec.model_path
    assert devices == []
    assert (other.status_code, status.status_code, after_rotation.status_code) == (401, 401, 401)
