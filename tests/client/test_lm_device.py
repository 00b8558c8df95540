"""A causal-LM device of each family (Llama, Qwen2, GPT-2, OPT) under each objective, scope and
format against the in-process coordinator: two rounds of train, upload and close, and the
device's replay of each new version ends on the coordinator's checksum. The objective changes
only the device's forward, never the wire or the replay."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from seedfed.client.backends.base import FP32, Fetch
from seedfed.client.device import Device
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.objective_batches import prompt_batch
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.model.hf import load_base
from seedfed.shared.model.objectives import ANSWER, label_word_ids
from seedfed.shared.protocol.objective import Objective
from seedfed.shared.protocol.task import Hyper, TaskSpec
from seedfed.shared.protocol.wire import Upload

from tests.fleet_helpers import CAUSAL_LM_FAMILIES, write_sentiment_tsv, write_tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: (objective, scope, format): every objective, a body, adapters, quantized scales and a
#: bf16-published shared model.
CASES = (("label_words", "full", "fp32"), ("next_token", "lora", "fp32"),
         ("next_token", "scales", "int4"), ("label_words", "lora", "int4"),
         ("next_token", "lora", "bf16"))


def _params() -> Iterator[Any]:
    for family in CAUSAL_LM_FAMILIES:
        for objective, scope, fmt in CASES:
            yield pytest.param(family, objective, scope, fmt,
                               id=f"{family}-{objective}-{scope}-{fmt}")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(root holding one model directory per family, labelled TSV)."""
    root = tmp_path_factory.mktemp("lm")
    for family in CAUSAL_LM_FAMILIES:
        write_tiny_causal_lm(root / family, family)
    return root, write_sentiment_tsv(root / "data.tsv")


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                  store_dir=tmp_path / "store"))
    yield c
    c.close()


def _spec(model: Path, objective: str, scope: str, fmt: str) -> TaskSpec:
    return TaskSpec(model_path=str(model), model_kind="causal_lm", scope=scope,
                    format=fmt,  # type: ignore[arg-type]
                    objective=Objective(objective),  # type: ignore[arg-type]
                    max_seq_len=24,
                    hyper=Hyper(lr=1e-3, eps=1e-2, steps=2, perturbations=2, batch_size=4))


def _data(tsv: Path) -> DeviceData:
    return DeviceData(source=str(tsv), partition_id=0, num_partitions=2, alpha=1.0)


def _fetch(coord: Coordinator, task_id: str, version: int, device: Device) -> Fetch:
    fmt = None if device.snapshot_format == FP32 else device.snapshot_format
    return lambda: coord.snapshot(task_id, version, fmt)


@pytest.mark.parametrize("family, objective, scope, fmt", _params())
def test_two_rounds_replay_to_the_coordinators_checksum(
        coord: Coordinator, assets: tuple[Path, Path], family: str, objective: str,
        scope: str, fmt: str) -> None:
    # Arrange
    root, tsv = assets
    spec = _spec(root / family, objective, scope, fmt)
    task_id = coord.create_task(spec)
    device = Device(spec, task_id)
    data = _data(tsv)
    examples = load_device_examples(data)[0]
    first = device.sync(0, fetch=_fetch(coord, task_id, 0, device))
    syncs, checksums, scalars = [], [], []

    # Act: each round syncs to its plan's version (replay from v1 on), trains and uploads
    for number in (1, 2):
        plan = coord.open_round(task_id)
        if number > 1:
            syncs.append(device.sync(plan.version, entries=[
                e.to_entry() for e in coord.log_since(task_id, plan.version - 1)]))
        trained = device.train(plan, examples, data)
        scalars.append(trained.scalars)
        coord.submit(task_id, coord.enroll(task_id)[0],
                     Upload.build(plan, trained.scalars, trained.num_examples, trained.loss))
        coord.close_round(task_id)
        checksums.append(coord.task_status(task_id).checksum)
    syncs.append(device.sync(2, entries=[e.to_entry() for e in coord.log_since(task_id, 1)]))

    # Assert
    assert first.method == "snapshot"
    assert [(s.method, s.version, s.checksum) for s in syncs] == [
        ("replay", 1, checksums[0]), ("replay", 2, checksums[1])]
    assert device.checksum == checksums[1] != checksums[0]
    values = np.concatenate(scalars)
    assert values.shape == (2 * spec.hyper.steps, spec.hyper.perturbations)
    assert np.isfinite(values).all() and np.any(values != 0)


@torch.no_grad()
def test_a_label_words_device_scores_the_argmax_of_the_label_word_logits(
        coord: Coordinator, assets: tuple[Path, Path]) -> None:
    # Arrange: version 0 of a full-scope task is the base model itself
    root, tsv = assets
    spec = _spec(root / "llama", "label_words", "full", "fp32")
    task_id = coord.create_task(spec)
    device = Device(spec, task_id)
    device.sync(0, fetch=_fetch(coord, task_id, 0, device))
    examples = load_device_examples(_data(tsv))[0]
    model, tokenizer = load_base(spec)
    batch = prompt_batch(tokenizer, spec.objective, examples.texts, examples.labels,
                         spec.max_seq_len)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    words = logits[torch.arange(len(examples)), batch[ANSWER]][
        :, label_word_ids(tokenizer, spec.objective)]
    labels = torch.as_tensor(examples.labels)
    want_accuracy = int((words.argmax(-1) == labels).sum()) / len(examples)
    want_loss = float(torch.nn.functional.cross_entropy(words, labels))

    # Act
    accuracy, loss = device.evaluate(examples)

    # Assert
    assert len(examples) > 32  # more than one scoring batch
    assert accuracy == want_accuracy
    assert loss == pytest.approx(want_loss, rel=1e-5)
