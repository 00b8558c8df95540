"""Smoke test of `seedfed bench catchup --quick`: it runs, writes its JSON, and its crossover is
the decision function's (replay below k*, download above). No timing assertions."""

from __future__ import annotations

import json
import math
from pathlib import Path

from seedfed.client.catchup import choose_catchup

from seedfed.bench import catchup as bench


def test_quick_run_writes_positive_figures_and_a_consistent_crossover(tmp_path: Path) -> None:
    out = tmp_path / "catchup.json"

    code = bench.main(["--quick", "--entries", "1", "--repeats", "1", "--json", str(out)])

    rows = json.loads(out.read_text())["rows"]
    assert code == 0 and rows
    for r in rows:
        assert r["replay_rate"] > 0 and r["load_rate"] > 0 and r["snapshot_bytes"] > 0
        k_star = r["crossover"]["1e+06"]
        below = math.ceil(k_star) - 1  # the largest integer k < k*
        cases = [(below, "replay")] if below >= 1 else []
        for k, expected in (*cases, (math.floor(k_star) + 1, "download")):
            choice = choose_catchup(
                versions_behind=k, replay_bytes=round(k * r["entry_bytes"]),
                replay_seeds=k * 64, scope_numel=r["numel"],
                download_bytes=r["snapshot_bytes"], bandwidth=1e6, latency=0.0,
                replay_rate=r["replay_rate"], load_rate=r["load_rate"])
            assert choice.action == expected, (r["scope"], k, k_star)
