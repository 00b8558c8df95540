"""Scoring a simulation's versions: the held-out accuracy after the rounds, outside the fleet.

`Evaluator` scores a committed version as the devices hold it (a ternary task: the packed
model from its published snapshot; every other on the fp32 state), `RoundScorer` is the
strategy's `evaluate_fn` that turns each round's record into a report row, and `score_version`
is `seedfed evaluate --run DIR --version V`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from seedfed.personal_report import DeviceRow, fleet_accuracy
from seedfed.shared.protocol.task import TaskSpec
from seedfed.simulate.config import SimulationConfig
from seedfed.simulate.report import Report, RoundRow


class Evaluator:
    """Scores committed versions on the held-out test split, outside the fleet."""

    def __init__(self, spec: TaskSpec, examples: Any, features: Any = None) -> None:
        """`features`: the run's shared feature store (None: the evaluator's own cache)."""
        from seedfed.shared.model.classifier import expect_texts, share_features
        from seedfed.shared.model.factory import build_model

        self.examples = examples
        self.packed: Any = None
        #: The snapshot format scored: a ternary task is scored as its devices hold it (the
        #: packed model from the published ternary snapshot), every other on the fp32 state.
        self.fmt: str | None = None
        if spec.scope == "ternary":
            from seedfed.client.ternary import SNAPSHOT_FORMAT, PackedTernary

            self.packed, self.fmt = PackedTernary(spec), SNAPSHOT_FORMAT
        else:
            self.bundle = build_model(spec, initialize=False)
            share_features(self.bundle.model, features)
            # the held-out texts fill the feature cache's canonical groups (speed only)
            expect_texts(self.bundle.model, self.bundle.tokenizer, examples.texts,
                         spec.max_seq_len)

    def __call__(self, snapshot: bytes, chk: str, version: int = 0) -> float:
        """The version's held-out accuracy under the task's objective
        (`client.evaluate.accuracy`)."""
        from seedfed.client.evaluate import accuracy
        from seedfed.client.sync import load_state

        if self.packed is not None:
            self.packed.load_snapshot(snapshot, version, chk)
            bundle = self.packed.bundle
        else:
            load_state(self.bundle.scope, snapshot, chk)
            bundle = self.bundle
        return accuracy(bundle, self.examples).accuracy

    def score(self, coordinator: Any, task_id: str, version: int) -> float:
        """Accuracy of the coordinator's `version` of the task."""
        data, chk = coordinator.snapshot(task_id, version, self.fmt)
        return self(data, chk, version)


class RoundScorer:
    """The strategy's `evaluate_fn`: scores the committed version on the held-out split after
    every round (round 0: version 0) and turns the strategy's record into a report row."""

    def __init__(self, config: SimulationConfig, report: Report, coordinator: Any,
                 task_id: str, strategy: Any, evaluator: Evaluator | None,
                 on_round: Callable[[RoundRow, int], None] | None,
                 times: Any = None) -> None:
        self.config, self.report, self.coordinator = config, report, coordinator
        self.times = times
        self.task_id, self.strategy, self.evaluator = task_id, strategy, evaluator
        self.on_round = on_round
        self.round_started = time.perf_counter()

    def __call__(self, server_round: int, _arrays: Any) -> Any:
        from flwr.app import MetricRecord

        acc = None
        due = server_round % self.config.eval_every == 0 or server_round == self.config.rounds
        if self.evaluator is not None and due:
            st = self.coordinator.task_status(self.task_id)
            acc = self.evaluator.score(self.coordinator, self.task_id, st.version)
        if server_round == 0:
            self.report.initial_accuracy = acc
            row = RoundRow(0, 0, 0, None, acc, 0, 0, 0.0, None, 0.0)
        else:
            rec = self.strategy.history[-1]
            row = RoundRow(round=rec.round, version=rec.version, participants=rec.participants,
                           loss=rec.loss, accuracy=acc, upload_bytes=rec.upload_bytes,
                           download_bytes=rec.download_bytes,
                           upload_bytes_per_device=(rec.upload_bytes / rec.participants
                                                    if rec.participants else 0.0),
                           local_accuracy=rec.local_accuracy,
                           seconds=time.perf_counter() - self.round_started,
                           device_compute_s=None if self.times is None else self.times.take())
            fleet_accuracy(row, rec.device_accuracy)
            self.report.rounds.append(row)
            self.report.device_checksums = {str(n): c for n, c in rec.device_checksums.items()}
            if rec.device_accuracy:
                self.report.devices = [DeviceRow(n, *acc) for n, acc
                                       in sorted(rec.device_accuracy.items())]
        self.round_started = time.perf_counter()
        if self.on_round is not None:
            self.on_round(row, self.config.rounds)
        return None if acc is None else MetricRecord({"accuracy": acc})


def score_version(run_dir: Path, version: int, data: str | Path | None = None,
                  limit: int | None = None) -> Any:
    """`seedfed evaluate --run DIR --version V`: score version V (0: the base the fleet
    started from) of a simulation's task, read from the run's own coordinator (its database
    and model store), in the format its devices load; `data` defaults to the run's test.tsv."""
    from seedfed.client.data import load_labelled
    from seedfed.client.evaluate import Score
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.settings import Settings

    run_dir = Path(run_dir)
    try:
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
        spec = TaskSpec.from_dict(json.loads((run_dir / "task.json").read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError) as e:
        raise FileNotFoundError(f"{run_dir} is not a finished simulation run: {e}") from e
    examples = load_labelled(data or run_dir / "test.tsv")
    if limit is not None:
        examples = examples.subset(range(min(limit, len(examples))))
    db = report.get("config", {}).get("db") or f"sqlite:///{run_dir.resolve() / 'coordinator.db'}"
    coordinator = Coordinator.open(Settings(database_url=db, store_dir=run_dir.resolve() / "store"))
    try:
        latest = coordinator.task_status(report["task_id"]).version
        if not 0 <= version <= latest:
            raise ValueError(f"version {version} is not in 0..{latest} (the run's versions)")
        acc = Evaluator(spec, examples).score(coordinator, report["task_id"], version)
    finally:
        coordinator.close()
    return Score(acc, len(examples), round(acc * len(examples)))
