"""CI-sized fleet-size benchmark: `seedfed bench fleet_size` runs `seedfed simulate` for two
fleet sizes with the same devices per round and records each one's round wall and peak memory. The
full run (100 / 1,000 / 10,000 devices, 100 a round, both engines) is its docstring's command;
benchmarks/results/fleet_size.json holds its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleet_helpers import write_sentiment_tsv

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_fleet_sizes_run_and_are_compared(tmp_path: Path) -> None:
    # Arrange
    data = write_sentiment_tsv(tmp_path / "d.tsv", n=2_000)
    out = tmp_path / "fleet_size.json"
    # Act
    proc = subprocess.run(
        [sys.executable, "-m", "seedfed.bench.fleet_size", "--data", str(data),
         "--fleets", "20", "400", "--per-round", "10", "--rounds", "2", "--engines",
         "inprocess", "--cache", str(tmp_path / "features"), "--json", str(out)],
        capture_output=True, text=True, timeout=900, check=False, cwd=ROOT)
    # Assert
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    small, large = result["runs"]
    assert (small["devices"], large["devices"]) == (20, 400)
    assert small["final_version"] == large["final_version"] == 2
    assert all(r["peak_rss_mib"] > 0 and r["round_s_median_after_first"] > 0
               for r in (small, large))
    assert "inprocess" in result["summary"]
    assert str(data) not in json.dumps(result)  # no path of this machine in the figures
