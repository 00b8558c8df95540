"""Bit-exactness must not depend on the CPU's vector extensions.

torch.randn and numpy's normal samplers change with the SIMD path a library picks at run time
(that is how x86 and ARM disagree); the seed stream and replay must not. Each setting runs in a
fresh interpreter, since torch and numpy choose their kernels once at import: torch through
ATEN_CPU_CAPABILITY, numpy through NPY_DISABLE_CPU_FEATURES (its dispatch targets this CPU
has, switched off down to the compiled baseline).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]


def _integer_values(n: int, salt: int) -> np.ndarray:
    """Float32 values built by integer arithmetic only (k / 2**20), so no sampler or SIMD
    path can change the starting state itself."""
    k = (np.arange(n, dtype=np.int64) * 2654435761 + salt * 40503) % (1 << 21) - (1 << 20)
    return (k.astype(np.float32) * np.float32(2.0**-20)).astype(np.float32)


def probe() -> dict[str, Any]:
    """Everything the contract fixes bit for bit, hashed: runs inside each subprocess."""
    import torch
    from seedfed.shared.model import stream
    from seedfed.shared.model.replay import checksum, replay
    from seedfed.shared.model.scopes import build_scope
    from seedfed.shared.protocol.npzo import LogEntry, update_coefficients
    from seedfed.shared.protocol.vectors import compute_vectors
    from torch import nn

    model = nn.Module()
    # 300,001 elements spans two replay chunks and ends mid-block; the matrix is small and odd.
    model.register_parameter("big", nn.Parameter(torch.from_numpy(_integer_values(300_001, 1))))
    model.register_parameter(
        "small", nn.Parameter(torch.from_numpy(_integer_values(37 * 129, 2).reshape(37, 129))))
    scope = build_scope("full", model)
    entries = []
    for e in range(3):
        seeds = tuple(int(s) for s in (np.arange(5, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                                       + np.uint64(e)))
        g = ((np.arange(5) - 2.0) * (e + 1) * 0.37).astype(np.float32)
        coefs = tuple(float(c) for c in update_coefficients(g, 1e-3, 5))
        entries.append(LogEntry("cpu-cap", e, seeds, coefs))
    replay(scope, entries, task_id="cpu-cap", version=0, verify=False)
    x = torch.from_numpy(_integer_values(70_000, 3))
    idx = torch.tensor([0, 5, 255, 256, 69_999, 12_345], dtype=torch.int64)
    digests = {
        "replay_checksum": checksum(scope),
        "perturbed": hashlib.sha256(stream.perturbed(x, "p", 7, 1e-3).numpy()).hexdigest(),
        "rademacher_at": stream.rademacher_at(9, "q", idx, 0.5).tolist(),
    }
    return {"torch_capability": torch.backends.cpu.get_cpu_capability(),
            "vectors": compute_vectors(), **digests}


def _run(env_extra: dict[str, str]) -> dict[str, Any]:
    env = {**os.environ, **env_extra}
    code = "import json, tests.shared.model.test_cpu_capability as m; print(json.dumps(m.probe()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"probe with {env_extra} failed:\n{proc.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _numpy_dispatch_targets() -> list[str]:
    """numpy's runtime-dispatch targets that this CPU supports (what NPY_DISABLE_CPU_FEATURES
    can turn off; the compiled baseline cannot be)."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    return [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]


def _settings() -> dict[str, dict[str, str]]:
    settings: dict[str, dict[str, str]] = {"torch-default": {"ATEN_CPU_CAPABILITY": "default"}}
    if platform.machine().lower() in ("x86_64", "amd64"):
        settings["torch-avx2"] = {"ATEN_CPU_CAPABILITY": "avx2"}
    targets = _numpy_dispatch_targets()
    for k in range(len(targets)):  # drop the best targets first, down to the baseline
        off = " ".join(targets[k:])
        settings[f"numpy-no-{targets[k]}-up"] = {"NPY_DISABLE_CPU_FEATURES": off}
    if targets:
        settings["both-baseline"] = {"ATEN_CPU_CAPABILITY": "default",
                                     "NPY_DISABLE_CPU_FEATURES": " ".join(targets)}
    return settings


@pytest.mark.slow
def test_stream_and_replay_identical_under_every_cpu_capability():
    # Arrange
    settings = {"native": {}, **_settings()}
    # Act
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(settings, pool.map(_run, settings.values()), strict=True))
    # Assert
    for name, env in settings.items():
        if "ATEN_CPU_CAPABILITY" in env:  # the override really took effect
            assert results[name]["torch_capability"].lower() == env["ATEN_CPU_CAPABILITY"]
    from seedfed.shared.protocol.vectors import committed_vectors

    assert results["native"]["vectors"] == committed_vectors()
    reference = {k: v for k, v in results["native"].items() if k != "torch_capability"}
    for name, got in results.items():
        assert {k: v for k, v in got.items() if k != "torch_capability"} == reference, name
