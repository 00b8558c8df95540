"""Smoke test of `seedfed bench quant_memory --quick`: every row (float, LoRA, int8/int4, packed
ternary, AdamW) runs in its own process on the tiny Llama and the JSON holds its figures, ratios
and targets. No memory targets are asserted: the figures depend on the machine; the full
benchmark (`--model smollm-135m`) judges them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from seedfed.bench import quant_memory as qm


@pytest.fixture(scope="module")
def quick_point(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "quant_memory.json"
    code = "from seedfed.cli import app; app()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "bench", "quant_memory", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "target <= 1.05" in proc.stdout  # the ratio table was printed with its targets
    report = json.loads(out.read_text())
    assert report["quick"] is True and len(report["points"]) == 1
    point: dict = report["points"][0]
    return point


def _rows(point: dict) -> dict[tuple[str, str], dict]:
    return {(r["spec"]["fmt"], r["spec"]["action"]): r for r in point["rows"]}


@pytest.mark.slow
def test_every_row_runs_and_its_peak_covers_the_resident_model(quick_point: dict) -> None:
    rows = _rows(quick_point)

    assert list(rows) == list(qm.QUICK_ROWS)
    base = rows[("fp32", "infer")]["params"]
    for key, r in rows.items():
        assert "error" not in r, (key, r.get("error"))
        assert r["step_peak_mib"] >= r["ready_mib"] > r["model_mib"] > 0, key
        # one shape, one count (quantized and packed layers by their shape); LoRA adds adapters
        assert r["params"] > base if key[0] == "fp32-lora" else r["params"] == base, key


@pytest.mark.slow
def test_each_zo_row_steps_its_own_scope(quick_point: dict) -> None:
    rows = _rows(quick_point)

    scopes = {fmt: r["scope"] for (fmt, action), r in rows.items() if action == "zo"}

    assert scopes == {"fp32": "full", "fp32-lora": "lora", "int8": "scales", "int4": "scales",
                      "ternary": "ternary"}
    assert rows[("fp32", "zo")]["mode"] == "virtual"
    assert rows[("fp32-lora", "zo")]["mode"] == "copy"
    # the ternary step holds the snapshot's masked latents, which inference-only rows drop
    assert rows[("ternary", "zo")]["scope_numel"] == quick_point["ternary"]["masked_latents"]
    assert rows[("ternary", "zo")]["model_mib"] > rows[("ternary", "infer")]["model_mib"]


@pytest.mark.slow
def test_ratios_and_targets_follow_from_the_step_peaks(quick_point: dict) -> None:
    rows = _rows(quick_point)
    peak = {key: r["step_peak_mib"] for key, r in rows.items()}

    ratios, judged = quick_point["ratios"], quick_point["targets"]

    for label, (a, b) in qm.RATIOS.items():
        assert ratios[label] == pytest.approx(peak[a] / peak[b]), label
    assert set(judged) == set(qm.TARGETS)
    for label, verdict in judged.items():
        assert verdict["target"] == qm.TARGETS[label]
        assert verdict["met"] == (ratios[label] <= qm.TARGETS[label])


def test_targets_judge_only_the_measured_ratios() -> None:
    ratios = {"fp32_zo / fp32_infer": 1.06, "ternary_zo / ternary_infer": 1.02,
              "int4_zo / fp32_zo": 0.6}

    judged = qm.targets(ratios)

    assert judged == {
        "fp32_zo / fp32_infer": dict(ratio=1.06, target=1.05, met=False),
        "ternary_zo / ternary_infer": dict(ratio=1.02, target=1.10, met=True),
    }


def test_a_ternary_row_needs_its_prepared_directory_and_no_other_row_takes_one() -> None:
    with pytest.raises(ValueError, match="prepared directory"):
        qm.Spec("llama-tiny", "ternary", "zo", 1, 64)
    with pytest.raises(ValueError, match="prepared directory"):
        qm.Spec("llama-tiny", "fp32", "zo", 1, 64, directory=str(Path("x")))
    with pytest.raises(ValueError, match="fp32 only"):
        qm.Spec("llama-tiny", "fp32-lora", "adamw", 1, 64)
