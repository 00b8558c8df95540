"""The coordinator's admin calls (create and list tasks, round metrics, round schedules and
abandonment, revocation) for the operator's command line (`seedfed task`, `seedfed round`,
`seedfed device revoke`).

A subclass of the one HTTP client (`coordinator_client.CoordinatorClient`, which already opens
and closes rounds), so paths, bearer handling and the error type are shared. Answers whose
schema lives in the server (`TaskCreated`, `RoundMetrics`) come back as their JSON objects:
shared/ never imports the server.
"""

from __future__ import annotations

from typing import Any

from seedfed.shared.protocol.coordinator_client import CoordinatorClient
from seedfed.shared.protocol.messages import Routes, TaskStatus


class AdminClient(CoordinatorClient):
    """CoordinatorClient with the admin token and the calls only an operator makes."""

    def create_task(self, spec: dict[str, Any], *, name: str | None = None, quorum: int = 1,
                    round_timeout_s: float = 600.0, devices_per_round: int | None = None,
                    max_devices_per_token: int | None = None, schedule: str | None = None,
                    max_rounds: int | None = None) -> dict[str, Any]:
        """`{task_id, join_token, version, checksum}` of a new task (the join token is shown
        this once). `schedule`: "auto" (the coordinator's default: rounds run back to back,
        until version `max_rounds`) or "manual"."""
        body: dict[str, Any] = {"spec": spec, "quorum": quorum,
                                "round_timeout_s": round_timeout_s}
        for key, value in (("name", name), ("devices_per_round", devices_per_round),
                           ("max_devices_per_token", max_devices_per_token),
                           ("schedule", schedule), ("max_rounds", max_rounds)):
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

    def abandon_round(self, task_id: str, round_number: int, reason: str) -> dict[str, Any]:
        """End an open or aggregating round without a new version: `{task_id, round,
        base_version, version, uploads, reason, abandoned_at}`."""
        return dict(self.request("POST", Routes(task_id).abandon(round_number),
                                 json={"reason": reason}).json())

    def set_schedule(self, task_id: str, *, schedule: str | None = None,
                     max_rounds: int | None = None, clear_limit: bool = False) -> TaskStatus:
        """Who opens the task's rounds ("auto" or "manual"; None keeps it) and the automatic
        schedule's limit (`clear_limit` removes it); the task's status after the change."""
        body: dict[str, Any] = {}
        if schedule is not None:
            body["schedule"] = schedule
        if clear_limit:
            body["max_rounds"] = None
        elif max_rounds is not None:
            body["max_rounds"] = max_rounds
        return TaskStatus.model_validate(
            self.request("PATCH", Routes(task_id).schedule, json=body).json())
