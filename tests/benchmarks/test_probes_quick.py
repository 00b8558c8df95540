"""Smoke test of `seedfed bench probes --quick`: it runs end to end and writes its JSON (every
case, mode and P, each row's figures, the memory peaks and the targets). No timing assertions:
the figures depend on the machine and its load."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROW_KEYS = {"model", "scope", "mode", "P", "ms_per_scalar", "peak_mb"}


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "probes.json"
    code = "from seedfed.cli import app; app()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "bench", "probes", "--quick", "--p", "1,2", "--repeats", "1",
         "--threads", "1", "--no-sweep", "--json", str(out)],
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "batched" in proc.stdout  # the table was printed
    return json.loads(Path(out).read_text())


@pytest.mark.slow
def test_quick_probe_bench_has_every_case_mode_and_p(quick_result: dict) -> None:
    rows = quick_result["results"]
    seen = {(r["scope"], r["mode"], r["P"]) for r in rows}
    for scope in ("head", "lora_top", "lora_all", "int8_scales_top", "lora_r8"):
        for mode in ("sequential", "batched"):
            assert {(scope, mode, 1), (scope, mode, 2)} <= seen
        # MeZO's whole-model probes are the MiniLM cases' baseline; the Llama has no cache
        assert ((scope, "mezo", 2) in seen) == (scope != "lora_r8")
    for r in rows:
        assert set(r) >= ROW_KEYS
        assert math.isfinite(r["ms_per_scalar"]) and r["ms_per_scalar"] > 0
        assert r["peak_mb"] > 0


@pytest.mark.slow
def test_quick_probe_bench_reports_inference_peaks_and_targets(quick_result: dict) -> None:
    peaks = quick_result["inference_peak_mb"]
    assert len(peaks) == 5 and all(v > 0 for v in peaks.values())
    assert set(quick_result["targets"]) == {"lora_top_batched_vs_sequential",
                                            "lora_top_batched_vs_mezo",
                                            "batched_peak_vs_inference"}
    batched = [r for r in quick_result["results"] if r["mode"] == "batched" and r["P"] == 2]
    assert all(r["copies_per_forward"] >= 1 for r in batched)
