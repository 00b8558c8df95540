"""The coordinator's admin calls (create and list tasks, round metrics, revocation) for the
operator's command line (`seedfed task`, `seedfed round`, `seedfed device revoke`).

A subclass of the one HTTP client (`coordinator_client.CoordinatorClient`, which already opens
and closes rounds), so paths, bearer handling and the error type are shared. Answers whose
schema lives in the server (`TaskCreated`, `RoundMetrics`) come back as their JSON objects:
shared/ never imports the server.
"""

from __future__ import annotations

from typing import Any

from .coordinator_client import CoordinatorClient
from .messages import Routes, TaskStatus


class AdminClient(CoordinatorClient):
    """CoordinatorClient with the admin token and the calls only an operator makes."""

    def create_task(self, spec: dict[str, Any], *, name: str | None = None, quorum: int = 1,
                    round_timeout_s: float = 600.0, devices_per_round: int | None = None,
                    max_devices_per_token: int | None = None) -> dict[str, Any]:
        """`{task_id, join_token, version, checksum}` of a new task (the join token is shown
        this once)."""
        body: dict[str, Any] = {"spec": spec, "quorum": quorum,
                                "round_timeout_s": round_timeout_s}
        for key, value in (("name", name), ("devices_per_round", devices_per_round),
                           ("max_devices_per_token", max_devices_per_token)):
            if value is not None:
                body[key] = value
        return dict(self.request("POST", Routes.ROOT, json=body).json())

    def list_tasks(self) -> list[TaskStatus]:
        return [TaskStatus.model_validate(t) for t in self.request("GET", Routes.ROOT).json()]

    def round_metrics(self, task_id: str) -> list[dict[str, Any]]:
        """Per round: number, version, base_version, state, participants, loss, bytes, times."""
        return list(self.request("GET", Routes(task_id).rounds).json())

    def revoke_device(self, task_id: str, device_id: str) -> None:
        self.request("DELETE", Routes(task_id).device(device_id))
