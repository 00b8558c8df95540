"""The REST device on a causal-LM task against the real coordinator app: next-token training
with a personal vocabulary bias, its held-out next-word scores reported, its personal state
kept across a restart, and every version reached by replay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from seedfed.client.device_data import DeviceData
from seedfed.client.http_device import DeviceConfig, HttpDevice
from seedfed.client.personal import PersonalConfig
from seedfed.client.personal_lm import LMPersonalPart
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.protocol.objective import Objective
from seedfed.shared.protocol.task import Hyper, TaskSpec

from tests.fleet_helpers import replay_when_allowed, write_sentiment_tsv, write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_next_token_device_trains_personalizes_and_replays(tmp_path: Path) -> None:
    # Arrange
    model = write_tiny_llama(tmp_path / "llama", tokenizer=True)
    data = write_sentiment_tsv(tmp_path / "data.tsv", n=200)
    spec = TaskSpec(model_path=str(model), model_kind="causal_lm", scope="lora",
                    objective=Objective("next_token"), max_seq_len=24,
                    hyper=Hyper(lr=1e-2, eps=1e-2, steps=2, perturbations=2, batch_size=4))
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                      store_dir=tmp_path / "store"))
    task, join = coord.create_task_with_token(spec, quorum=50)
    with TestClient(create_app(runtime=coord.rt)) as client:
        def device() -> HttpDevice:
            cfg = DeviceConfig(url="http://testserver", task_id=task, join_token=join,
                               state_dir=tmp_path / "dev", model=str(model), poll_s=0.05,
                               data=DeviceData(source=str(data), num_partitions=1),
                               personal=PersonalConfig(steps=2, batch_size=8))
            return replay_when_allowed(HttpDevice(cfg, client=client))

        dev = device()
        dev.enroll()
        # Act
        outcomes = []
        for _ in range(2):
            outcomes.append(dev.train_and_upload(coord.open_round(task)))
            coord.close_round(task)
        synced = dev.sync()
        restarted = device()
        restarted.enroll()
        # Assert
        status = coord.task_status(task)
        assert [o.sync for o in outcomes] == ["snapshot", "replay"]
        assert synced.checksum == status.checksum
        assert all(o.upload_bytes == 16 + 4 * 2 * 2 for o in outcomes)
        sent = outcomes[-1].metrics
        assert sent is not None and sent.personal_accuracy is not None
        (row,) = coord.device_metrics(task, 2)
        assert (row.shared_accuracy, row.personal_accuracy) == (sent.shared_accuracy,
                                                                sent.personal_accuracy)
        again = restarted.load_device()
        assert again.personal is not None and dev.device is not None
        again.resume()
        kept, trained = again.personal, dev.device.personal
        assert isinstance(kept, LMPersonalPart) and isinstance(trained, LMPersonalPart)
        assert kept.rounds == trained.rounds == 2 and kept.refused is None
        assert torch.equal(kept.bias, trained.bias)
    coord.close()
