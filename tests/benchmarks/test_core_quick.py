"""Smoke test of `seedfed bench core --quick`: it runs end to end and writes sane JSON.

No timing assertions: the figures depend on the machine and its load. The targets themselves
are judged by the full benchmark (`seedfed bench core`), not by tests.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REQUIRED = ("inference_peak_mb", "zo_step_peak_mb", "sgd_peak_mb", "adamw_peak_mb", "forward_s",
            "zo_step_s", "replay_mparam_s", "replay_fused_mparam_s",
            "replay_numpy_fused_mparam_s", "mezo_replay_mparam_s", "axpy_mparam_s")


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "core.json"
    code = "from seedfed.cli import app; app()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "bench", "core", "--quick", "--repeats", "1", "--json",
         str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "replay" in proc.stdout  # the table was printed
    return json.loads(Path(out).read_text())


@pytest.mark.slow
def test_quick_bench_writes_every_required_key_as_a_positive_number(quick_result):
    for key in REQUIRED:
        value = quick_result[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)


@pytest.mark.slow
def test_quick_bench_memory_figures_are_ordered_like_the_methods(quick_result):
    r = quick_result
    # Backprop keeps activations and gradients (and AdamW its moments) beyond inference.
    assert r["sgd_peak_mb"] > r["inference_peak_mb"]
    assert r["adamw_peak_mb"] > r["inference_peak_mb"]
    for kind in ("inference", "zo_virtual", "zo_copy", "sgd", "adamw"):
        detail = r["memory_detail"][kind]
        assert detail["peak_mb"] >= detail["baseline_mb"] > 0, kind


@pytest.mark.slow
def test_quick_bench_ratios_and_targets_follow_from_the_figures(quick_result):
    r = quick_result
    assert r["replay_vs_axpy"] == pytest.approx(r["replay_mparam_s"] / r["axpy_mparam_s"])
    assert r["replay_vs_mezo"] == pytest.approx(r["replay_mparam_s"] / r["mezo_replay_mparam_s"])
    assert r["replay_fused_vs_axpy"] == pytest.approx(r["replay_fused_mparam_s"]
                                                      / r["axpy_mparam_s"])
    assert r["zo_step_vs_forward"] == pytest.approx(r["zo_step_s"] / r["forward_s"])
    assert r["zo_vs_inference_mem"] == pytest.approx(r["zo_step_peak_mb"] / r["inference_peak_mb"])
    assert set(r["targets"]) == {"zo_vs_inference_mem", "zo_step_vs_forward", "replay_vs_mezo",
                                 "replay_vs_axpy", "replay_fused_vs_axpy"}
    assert r["replay_fused_seeds"] == 16
    assert r["shape"]["name"] == "llama-quick" and r["quick"] is True
