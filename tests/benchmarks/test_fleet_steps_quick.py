"""Smoke test of `seedfed bench fleet_steps --quick`: it runs end to end and writes its JSON
(every scope, the figures, the machine; the head scope's devices also stepped together), and a
fleet's device-steps replay to the checksums a plain Device gets from the same seeds. No
timing assertions: the figures depend on the machine and its load."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from seedfed.client.backends.base import BackendConfig
from seedfed.client.device import Device

from seedfed.bench.coordinator_process import tiny_model
from seedfed.bench.fleet_steps import (
    SCOPES,
    TASK,
    BatchedHeadFleet,
    Fleet,
    plan_for,
    scope_spec,
    verify_batched,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOP_KEYS = {"torch_device", "device_name", "torch", "threads", "devices", "repeats", "warmup",
            "quick", "cross_device_batching", "results"}
ROW_KEYS = {"scope", "model", "P", "batch", "probes_per_forward", "device_steps_per_s",
            "ms_per_device_step", "swap_ms", "trainable_params", "bit_exact_vs_plain_device"}


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "fleet_steps.json"
    code = "from seedfed.cli import app; app()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "bench", "fleet_steps", "--quick", "--device", "cpu",
         "--threads", "1", "--batch-devices", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "device-steps/s" in proc.stdout  # the figures were printed
    return json.loads(Path(out).read_text())


def test_quick_fleet_bench_reports_every_scope_with_positive_rates(quick_result: dict) -> None:
    assert set(quick_result) >= TOP_KEYS
    assert quick_result["torch_device"] == "cpu" and quick_result["threads"] == 1
    rows = quick_result["results"]
    assert [r["scope"] for r in rows] == list(SCOPES)
    for r in rows:
        assert set(r) >= ROW_KEYS
        assert math.isfinite(r["device_steps_per_s"]) and r["device_steps_per_s"] > 0
        assert r["probes_per_forward"] >= 1 and r["P"] >= 1 and r["trainable_params"] > 0
        assert r["bit_exact_vs_plain_device"] is True


def test_quick_fleet_bench_reports_the_batched_head_beside_the_loop(quick_result: dict) -> None:
    assert quick_result["cross_device_batching"] is True
    rows = {r["scope"]: r for r in quick_result["results"]}
    batched = rows["head"]["batched"]
    assert math.isfinite(batched["device_steps_per_s"]) and batched["device_steps_per_s"] > 0
    assert batched["speedup"] > 0
    assert batched["scalars_close"] is True and batched["replay_bit_exact"] is True
    assert "batched" not in rows["lora"] and "batched" not in rows["full"]


def test_fleet_device_steps_replay_to_a_plain_devices_checksums(tmp_path: Path) -> None:
    # Arrange: a head fleet of 2 virtual devices on one shared Device, 2 rounds
    spec = scope_spec("head", str(tiny_model(tmp_path / "model")), 4)
    fleet = Fleet(spec, 2, torch_device="cpu", data="builtin",
                  features_dir=tmp_path / "features")
    for r in range(2):
        fleet.round(r)
    # Act: a plain Device per virtual device, the same plans on the same data
    finals = []
    for i, track in enumerate(fleet.tracks):
        plain = Device(spec, TASK, backend=BackendConfig(torch_device="cpu"))
        plain.load_snapshot(fleet.state0, 0, fleet.checksum0)
        for r, entry in enumerate(track.entries):
            trained = plain.train(plan_for(spec, r, r), fleet.examples[i], fleet.data[i])
            assert np.array_equal(trained.scalars, track.scalars[r]), f"device {i} round {r}"
            # Assert (per round): the replay of the fleet's entry verifies its checksum
            result = plain.sync(r + 1, entries=[replace(entry, checksum=track.checksums[r])])
            assert result.method == "replay"
        finals.append(plain.checksum)
    # Assert: each device moved its own state, and the plain devices ended on it
    assert finals == [t.checksums[-1] for t in fleet.tracks]
    assert finals[0] != finals[1] != fleet.checksum0


def test_batched_head_devices_replay_to_a_plain_devices_checksums(tmp_path: Path) -> None:
    # Arrange: a head fleet of 2 virtual devices stepped together, 2 rounds
    spec = scope_spec("head", str(tiny_model(tmp_path / "model")), 4)
    fleet = Fleet(spec, 2, torch_device="cpu", data="builtin",
                  features_dir=tmp_path / "features")
    batched = BatchedHeadFleet(fleet)
    for r in range(2):
        batched.round(r)

    # Act: a plain Device follows device 0's and device 1's uploads
    checks = [verify_batched(batched, i) for i in range(2)]

    # Assert: scalars to tolerance, every replay on the batched checksums; devices apart
    assert all(close and exact for _, close, exact in checks)
    finals = [t.checksums[-1] for t in batched.tracks]
    assert finals[0] != finals[1] != fleet.checksum0
    # a checksum the replay cannot reach is reported, not passed
    batched.tracks[0].checksums[0] = fleet.checksum0
    assert verify_batched(batched, 0)[2] is False
