"""Scoring a device's own model from its state directory: `seedfed evaluate --device DIR`.

A REST device (`seedfed device`) keeps in its state directory the task definition it serves
(`task.json`), the shared version it stands at (`state.safetensors`, verified against the
checksum in `device.json`) and its personal part (`personal.safetensors`). This scores, on a
labelled file the device owner holds, the shared model alone and the device's personalized
model (shared + personal), without contacting the coordinator.

An ORT device (`seedfed device --backend ort`; `backend: ort` in its device.json, or a
directory without task.json) keeps no personal part: its shared state is scored on the bundle
it runs (device.json's `bundle`, or `--model BUNDLE`), as the device itself scores, without
torch's model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seedfed.client import data as data_mod
from seedfed.client.backends.base import BackendConfig, DeviceStateError
from seedfed.client.data import load_labelled
from seedfed.client.device import Device
from seedfed.client.evaluate import load_task
from seedfed.client.http_device import META_FILE, STATE_FILE, TASK_FILE, DirectoryStore
from seedfed.client.personal import PersonalConfig, PersonalPart, PersonalScores
from seedfed.shared.protocol.errors import ChecksumMismatchError
from seedfed.shared.protocol.npzo import np_checksum


@dataclass(frozen=True)
class DeviceScore:
    version: int
    scores: PersonalScores
    personal_trained: bool  # False: no personal part stored (or refused): personal = shared
    refused: str | None  # why a stored personal part was not applied, if it was not


def evaluate_device(state_dir: str | Path, data: str | Path, *, model: str | None = None,
                    personal: PersonalConfig | None = None,
                    limit: int | None = None) -> DeviceScore:
    """Shared and personalized accuracy of the device whose state directory is `state_dir`;
    `model`: the device's base model copy (an ORT device: its bundle)."""
    state_dir = Path(state_dir)
    if not (state_dir / META_FILE).is_file():
        raise FileNotFoundError(f"{state_dir} is not a device state directory (needs "
                                f"{META_FILE}; run `seedfed device` first)")
    meta = _meta(state_dir)
    task_id = str(meta["task_id"])
    if meta.get("backend") == "ort" or not (state_dir / TASK_FILE).is_file():
        return _evaluate_ort(state_dir, meta, data, bundle=model, limit=limit)
    spec = load_task(state_dir / TASK_FILE)
    device = Device(spec, task_id, DirectoryStore(state_dir, task_id),
                    personal=personal or PersonalConfig(), backend=BackendConfig(model=model))
    if not device.resume() or device.version is None:
        raise DeviceStateError(f"{state_dir} holds no shared state of task {task_id} yet")
    examples = _examples(data, limit, spec.num_labels)
    scores = device.evaluate_personal(examples)
    part = device.personal
    if scores is None or not isinstance(part, PersonalPart):
        raise ValueError(f"{data} holds no examples")
    return DeviceScore(device.version, scores, part.personal is not None, part.refused)


def _meta(state_dir: Path) -> dict[str, Any]:
    try:
        meta = json.loads((state_dir / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{state_dir / META_FILE} is unreadable ({e})") from e
    if not isinstance(meta, dict) or not meta.get("task_id"):
        raise ValueError(f"{state_dir / META_FILE} names no task")
    return meta


def _examples(data: str | Path, limit: int | None, num_labels: int) -> data_mod.Examples:
    examples = load_labelled(data)
    if limit is not None:
        examples = examples.subset(range(min(limit, len(examples))))
    if examples.num_labels > num_labels:
        raise ValueError(f"{data} has label {examples.num_labels - 1}, the task only "
                         f"{num_labels} labels")
    if not len(examples):
        raise ValueError(f"{data} holds no examples")
    return examples


def _evaluate_ort(state_dir: Path, meta: dict[str, Any], data: str | Path, *,
                  bundle: str | None, limit: int | None) -> DeviceScore:
    """An ORT device's shared state, scored on its bundle: no personal part (personal =
    shared), the version and checksum of its device.json verified. A directory without
    task.json is scored against the task its bundle was exported for."""
    from seedfed.client.backends.ort.backend import read_state, score_state
    from seedfed.client.backends.ort.runtime import OrtModel

    root = bundle or meta.get("bundle")
    if not root:
        raise FileNotFoundError(f"{state_dir} is an ORT device's directory that names no "
                                "bundle: give --model BUNDLE (the directory the device ran "
                                "with `--backend ort --model`)")
    ort_model = OrtModel(root)
    if (state_dir / TASK_FILE).is_file():
        ort_model.manifest.check_spec(load_task(state_dir / TASK_FILE))
    stored = DirectoryStore(state_dir, str(meta["task_id"])).load()
    if stored is None or stored.state is None:
        raise DeviceStateError(f"{state_dir} holds no shared state of task "
                               f"{meta['task_id']} yet")
    state = read_state(stored.state, ort_model)
    if np_checksum(state) != stored.checksum:
        raise ChecksumMismatchError(f"{state_dir / STATE_FILE} does not hash to the checksum "
                                    f"in {state_dir / META_FILE}; run the device to resync it")
    examples = _examples(data, limit, int(ort_model.manifest.spec["num_labels"]))
    accuracy, _ = score_state(ort_model, state, examples)
    return DeviceScore(stored.version, PersonalScores(accuracy, accuracy, None, len(examples)),
                       False, None)
