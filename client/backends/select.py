"""Build the backend a device's `BackendConfig` names, importing only that backend: the ORT
backend never loads torch, the torch backend never loads onnxruntime."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from seedfed.client.backends.base import Backend, BackendConfig
from seedfed.shared.protocol.task import TaskSpec

if TYPE_CHECKING:
    from seedfed.shared.model.features import FeatureStore


def open_backend(spec: TaskSpec, config: BackendConfig,
                 features: FeatureStore | None = None) -> Backend:
    """The task's model on the configured backend. torch: `config.model` (if given) replaces
    the task's model_path (the device's own copy of the base); ort: `config.model` is the
    task's bundle. `features` (torch): a feature store shared beyond this process."""
    if config.kind == "ort":
        from seedfed.client.backends.ort.backend import OrtBackend
        from seedfed.client.backends.ort.runtime import open_model

        assert config.model is not None  # BackendConfig requires it
        return OrtBackend(spec, open_model(config.model, threads=config.threads))
    from seedfed.client.backends.torch import TorchBackend

    if config.model:
        spec = replace(spec, model_path=config.model)
    return TorchBackend(spec, torch_device=config.torch_device, features=features)
