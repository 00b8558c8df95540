"""The backend config: validated where it is made, every field with help text; the REST
device's config carries it."""

from __future__ import annotations

from pathlib import Path

import pytest
from seedfed.client.backends.base import BackendConfig
from seedfed.client.http_device import DeviceConfig


def test_every_backend_and_device_field_has_help_text() -> None:
    assert all(BackendConfig.help().values())
    assert all(DeviceConfig.help().values())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"kind": "tflite"}, "backend must be one of"),
    ({"kind": "ort"}, "bundle"),
    ({"torch_device": "cuda:x"}, "torch_device"),
    ({"threads": 0}, "threads"),
])
def test_a_bad_backend_config_is_refused_when_made(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BackendConfig(**kwargs)


def test_the_device_config_names_its_backend(tmp_path: Path) -> None:
    config = DeviceConfig(url="http://h:1", task_id="t", state_dir=tmp_path, backend="ort",
                          model="bundle/", threads=2)

    assert config.backend_config() == BackendConfig(kind="ort", model="bundle/", threads=2)
    with pytest.raises(ValueError, match="bundle"):
        DeviceConfig(url="http://h:1", task_id="t", state_dir=tmp_path, backend="ort")
