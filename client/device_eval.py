"""Scoring a device's own model from its state directory: `seedfed evaluate --device DIR`.

A REST device (`seedfed device`) keeps in its state directory the task definition it serves
(`task.json`), the shared version it stands at (`state.safetensors`, verified against the
checksum in `device.json`) and its personal part (`personal.safetensors`). This scores, on a
labelled file the device owner holds, the shared model alone and the device's personalized
model (shared + personal), without contacting the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from seedfed.client.data import load_labelled
from seedfed.client.device import Device, DeviceStateError
from seedfed.client.evaluate import load_task
from seedfed.client.http_device import META_FILE, TASK_FILE, DirectoryStore
from seedfed.client.personal import PersonalConfig, PersonalScores


@dataclass(frozen=True)
class DeviceScore:
    version: int
    scores: PersonalScores
    personal_trained: bool  # False: no personal part stored (or refused): personal = shared
    refused: str | None  # why a stored personal part was not applied, if it was not


def evaluate_device(state_dir: str | Path, data: str | Path, *, model: str | None = None,
                    personal: PersonalConfig | None = None,
                    limit: int | None = None) -> DeviceScore:
    """Shared and personalized accuracy of the device whose state directory is `state_dir`."""
    state_dir = Path(state_dir)
    if not (state_dir / META_FILE).is_file() or not (state_dir / TASK_FILE).is_file():
        raise FileNotFoundError(f"{state_dir} is not a device state directory (needs "
                                f"{META_FILE} and {TASK_FILE}; run `seedfed device` first)")
    spec = load_task(state_dir / TASK_FILE)
    if model:
        spec = replace(spec, model_path=model)
    task_id = str(DirectoryStore.read_task_id(state_dir))
    device = Device(spec, task_id, DirectoryStore(state_dir, task_id),
                    personal=personal or PersonalConfig())
    if not device.resume() or device.version is None:
        raise DeviceStateError(f"{state_dir} holds no shared state of task {task_id} yet")
    examples = load_labelled(data)
    if limit is not None:
        examples = examples.subset(range(min(limit, len(examples))))
    if examples.num_labels > spec.num_labels:
        raise ValueError(f"{data} has label {examples.num_labels - 1}, the task only "
                         f"{spec.num_labels} labels")
    scores = device.evaluate_personal(examples)
    if scores is None or device.personal is None:
        raise ValueError(f"{data} holds no examples")
    return DeviceScore(device.version, scores, device.personal.personal is not None,
                       device.personal.refused)
