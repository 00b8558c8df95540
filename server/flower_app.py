"""The Flower ServerApp of a deployment (`seedfed.server.flower_app:app`).

A SuperLink starts it for `flwr run`; it drives rounds with `SeedfedStrategy` against a
coordinator reached one of two ways:

- over REST (`coordinator-url` in the run config, or SEEDFED_COORDINATOR_URL): the usual
  deployment, next to a running `seedfed coordinator`. The admin token comes from the
  environment (SEEDFED_ADMIN_TOKEN), never from the run config, which the SuperLink stores; the
  task's join token (SEEDFED_JOIN_TOKEN or `join-token`) enrolls the Flower devices.
- in process (`db-url` and `store-dir`): the ServerApp owns the database for the run (no other
  coordinator process may run on it meanwhile).

Run config keys: `task-id`, `num-rounds`, `min-devices`, `devices-per-round` (0: all),
`round-timeout` (0: the task's), `sync` (push each new entry and verify checksums),
`report` (a JSON file to write the per-round records to; empty: none).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from seedfed.server.errors import CoordinatorError
from seedfed.server.flower_strategy import CoordinatorPort, FleetConfig, SeedfedStrategy
from seedfed.shared.protocol.coordinator_client import CoordinatorClient, CoordinatorHttpError
from seedfed.shared.protocol.errors import SeedfedError
from seedfed.shared.protocol.messages import CatchupPlan, TaskStatus
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import DeviceMetrics, LogEntryWire, RoundPlan, Upload

log = logging.getLogger(__name__)


class RestCoordinator:
    """The strategy's CoordinatorPort over the coordinator's REST API (`shared.
    coordinator_client`, the client the REST device uses too), as the admin."""

    def __init__(self, url: str, admin_token: str, join_token: str | None,
                 client: httpx.Client | None = None, timeout_s: float = 60.0) -> None:
        self.http = client or httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)
        self.api = CoordinatorClient(self.http, admin_token)
        self.join = join_token
        self._tokens: dict[str, str] = {}
        self._plans: dict[str, RoundPlan] = {}

    def open_round(self, task_id: str) -> RoundPlan:
        plan = self.api.open_round(task_id)
        self._plans[task_id] = plan
        return plan

    def enroll(self, task_id: str) -> tuple[str, str]:
        if not self.join:
            raise CoordinatorError("enrolling Flower devices needs the task's join token "
                                   "(SEEDFED_JOIN_TOKEN or run config join-token)")
        device_id, token = self.api.enroll(task_id, self.join)
        self._tokens[device_id] = token
        return device_id, token

    def submit(self, task_id: str, device_id: str, upload: Upload,
               wire_bytes: int | None = None) -> int:
        """Forward a device's upload in the binary form (the coordinator counts its body);
        returns the body's bytes."""
        return self.api.upload(task_id, upload.round, upload.version, upload.matrix(),
                        upload.num_examples, upload.loss, token=self._tokens[device_id])

    def submit_many(self, task_id: str, uploads: Sequence[tuple[str, Upload, int | None]],
                    ) -> list[int | Exception]:
        """Forward a round's uploads one request each; per upload its body's bytes, or the
        error that refused it."""
        out: list[int | Exception] = []
        for device_id, upload, wire_bytes in uploads:
            try:
                out.append(self.submit(task_id, device_id, upload, wire_bytes))
            except (SeedfedError, KeyError, TypeError, ValueError) as e:
                out.append(e)
        return out

    def record_metrics(self, task_id: str, device_id: str, round_number: int,
                       metrics: DeviceMetrics) -> None:
        """Forward a device's held-out scores, as that device (the route takes device tokens)."""
        self.api.report_metrics(task_id, round_number, metrics, token=self._tokens[device_id])

    def close_round(self, task_id: str) -> LogEntryWire:
        plan = self._plans[task_id]
        try:
            return self.api.close_round(task_id, plan.round)
        except CoordinatorHttpError as e:
            if e.status != 409:
                raise
            # the coordinator's own ticker may have closed it at quorum: find its entry
            for entry in self.log_since(task_id, plan.version):
                if entry.base_version == plan.version:
                    return entry
            raise

    def log_since(self, task_id: str, version: int) -> list[LogEntryWire]:
        return self.api.log_since(task_id, version)

    def snapshot(self, task_id: str, version: int, fmt: str | None = None,
                 ) -> tuple[bytes, str]:
        return self.api.snapshot(task_id, version, fmt)

    def task_status(self, task_id: str) -> TaskStatus:
        return self.api.status(task_id)

    def task_spec(self, task_id: str) -> TaskSpec:
        return TaskSpec.from_dict(self.api.spec(task_id), stored=True)  # the coordinator's own

    def catchup(self, task_id: str, from_version: int) -> CatchupPlan:
        return self.api.catchup(task_id, from_version)

    def close(self) -> None:
        self.http.close()


def _open_coordinator(cfg: dict[str, Any]) -> tuple[CoordinatorPort, Any]:
    """(the port, the object to close) from the run config and the environment."""
    url = str(cfg.get("coordinator-url") or os.environ.get("SEEDFED_COORDINATOR_URL", ""))
    if url:
        admin = os.environ.get("SEEDFED_ADMIN_TOKEN")
        if not admin:
            raise CoordinatorError("SEEDFED_ADMIN_TOKEN must be set in the SuperLink's "
                                   "environment to drive rounds over REST")
        join = str(cfg.get("join-token") or os.environ.get("SEEDFED_JOIN_TOKEN", "")) or None
        rest = RestCoordinator(url, admin, join)
        return rest, rest
    if not cfg.get("db-url"):
        raise CoordinatorError("set coordinator-url (REST) or db-url and store-dir (in "
                               "process) in the run config")
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.settings import Settings

    coord = Coordinator.open(Settings(database_url=str(cfg["db-url"]),
                                      store_dir=Path(str(cfg["store-dir"]))))
    return coord, coord


def run_fleet(grid: Grid, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Drive `num-rounds` rounds of `task-id` over the grid; returns the round records."""
    port, closer = _open_coordinator(cfg)
    try:
        task_id = str(cfg["task-id"])
        status = port.task_status(task_id)
        overrides: dict[str, Any] = {"min_devices": int(cfg.get("min-devices", 1)),
                                     "sync_after_round": bool(cfg.get("sync", True))}
        if int(cfg.get("devices-per-round", 0)):
            overrides["devices_per_round"] = int(cfg["devices-per-round"])
        if float(cfg.get("round-timeout", 0)):
            overrides["round_timeout_s"] = float(cfg["round-timeout"])
        fleet = FleetConfig.from_status(status, **overrides)
        strategy = SeedfedStrategy(port, task_id, fleet)
        strategy.start(grid, ArrayRecord(), num_rounds=int(cfg.get("num-rounds", 3)),
                       timeout=fleet.round_timeout_s)
        records = [asdict(r) for r in strategy.history]
        if cfg.get("report"):
            Path(str(cfg["report"])).write_text(json.dumps(records, indent=2, default=str))
        return records
    finally:
        closer.close()


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_fleet(grid, dict(context.run_config))
