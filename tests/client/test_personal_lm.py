"""A language-model device's personal vocabulary bias: exact forward-only training, the
evidence check, its stored state, and scores against the shared model and the local bigram."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from seedfed.client.data import Examples
from seedfed.client.personal import PersonalConfig
from seedfed.client.personal_lm import LMPersonalPart
from seedfed.shared.model.factory import build_model
from seedfed.shared.protocol.task import TaskSpec

from tests.fleet_helpers import write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> TaskSpec:
    model = write_tiny_llama(tmp_path_factory.mktemp("lm") / "model", tokenizer=True)
    return TaskSpec(model_path=str(model), model_kind="causal_lm", scope="full", max_seq_len=24)


def _owner_text(n: int, seed: int = 0) -> Examples:
    """An owner who writes a few words over and over (what a bias can learn)."""
    rng = np.random.default_rng(seed)
    words = ["zebra", "quiz", "jazz", "fizz"]
    texts = tuple(" ".join(rng.choice(words, size=3)) for _ in range(n))
    return Examples(texts, np.zeros(n, dtype=np.int64))


def _part(spec: TaskSpec, task: str = "t1", **config: float) -> LMPersonalPart:
    bundle = build_model(spec, initialize=True)
    cfg = PersonalConfig(**{"steps": 8, "lr": 0.1, "batch_size": 16, **config})
    return LMPersonalPart.of(cfg, bundle, task)


def test_the_gradient_is_the_exact_one_of_the_biased_cross_entropy(spec: TaskSpec) -> None:
    # Arrange
    part = _part(spec, decay=0.0)
    logits = torch.randn(4, part.vocab, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([3, 4, -100, 6])
    keep = labels != -100
    b = torch.zeros(part.vocab, requires_grad=True)
    torch.nn.functional.cross_entropy(logits[keep] + b, labels[keep]).backward()
    # Act: Adam's first step from zero moves each entry by lr against its gradient's sign
    part._step(logits[keep], labels[keep])
    # Assert
    assert b.grad is not None
    moved = b.grad.abs() > 1e-7
    assert torch.equal(torch.sign(part.bias[moved]), -torch.sign(b.grad[moved]))
    assert torch.allclose(part.bias[moved].abs(), torch.full_like(part.bias[moved], 0.1),
                          atol=1e-4)


def test_the_bias_learns_the_owners_words_and_beats_the_shared_model(spec: TaskSpec) -> None:
    # Arrange
    part = _part(spec)
    train, held = _owner_text(200, seed=1), _owner_text(40, seed=2)
    # Act
    for r in range(3):
        part.train(train, np.random.default_rng(r))
    scores = part.scores(held)
    # Assert
    assert scores is not None and scores.local is not None
    assert part.active
    assert scores.personal.perplexity < scores.shared.perplexity
    assert scores.personal.top3_accuracy > scores.shared.top3_accuracy
    assert scores.local.top3_accuracy > scores.shared.top3_accuracy


def test_a_bias_that_does_not_help_on_held_back_text_is_not_applied(spec: TaskSpec) -> None:
    # Arrange: a huge lr makes the bias overshoot and hurt
    part = _part(spec, lr=50.0, steps=2)
    train = _owner_text(100, seed=3)
    # Act
    part.train(train, np.random.default_rng(0))
    scores = part.scores(_owner_text(20, seed=4))
    # Assert: inactive means scored as the shared model
    assert scores is not None
    if not part.active:
        assert scores.personal == scores.shared


def test_the_state_round_trips_and_another_tasks_state_is_refused(spec: TaskSpec) -> None:
    # Arrange
    part = _part(spec)
    part.train(_owner_text(60), np.random.default_rng(0))
    data = part.to_bytes()
    # Act
    same, other = _part(spec), _part(spec, task="t2")
    same.restore(data)
    other.restore(data)
    # Assert
    assert torch.equal(same.bias, part.bias) and same.active == part.active
    assert other.refused is not None and "another task" in other.refused
    assert not other.bias.any()


def test_a_corrupt_state_is_refused_and_rebuilt(spec: TaskSpec, tmp_path: Path) -> None:
    # Arrange
    part = _part(spec)
    # Act
    part.restore(b"not a safetensors file")
    # Assert
    assert part.refused is not None and part.rounds == 0


def test_a_packed_ternary_lm_device_keeps_a_personal_bias(tmp_path: Path) -> None:
    # Arrange: a ternary next-token task, one device holding the packed model
    from seedfed.client.device import Device, MemoryStore
    from seedfed.client.device_data import DeviceData, load_device_examples
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.settings import Settings
    from seedfed.shared.protocol.wire import Upload

    from tests.fleet_helpers import ternary_spec, write_sentiment_tsv

    spec = ternary_spec(write_tiny_llama(tmp_path / "llama", tokenizer=True))
    data = DeviceData(source=str(write_sentiment_tsv(tmp_path / "d.tsv", n=120)))
    examples = load_device_examples(data)[0]
    with Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                   store_dir=tmp_path / "store")) as coord:
        task = coord.create_task(spec)
        device = Device(spec, task, MemoryStore(), PersonalConfig(steps=2, batch_size=8))
        plan = coord.open_round(task)
        device.sync(plan.version, fetch=lambda: coord.snapshot(task, plan.version, "ternary"))
        # Act
        trained = device.train(plan, examples, data)
        coord.submit(task, coord.enroll(task)[0],
                     Upload.build(plan, trained.scalars, trained.num_examples, trained.loss))
        # Assert
        part = device.personal
        assert isinstance(part, LMPersonalPart) and part.rounds == 1 and part.bias.any()
        scores = part.scores(examples.subset(range(10)))
        assert scores is not None and scores.local is not None


def test_a_label_words_device_learns_its_owners_label_prior(tmp_path: Path) -> None:
    # Arrange: an owner whose examples are 90% label 1
    from seedfed.client.personal_lm import LabelPersonalPart

    model = write_tiny_llama(tmp_path / "llama", tokenizer=True)
    spec = TaskSpec(model_path=str(model), model_kind="causal_lm", scope="lora",
                    objective={"kind": "label_words"}, max_seq_len=24)  # type: ignore[arg-type]
    part = LabelPersonalPart(PersonalConfig(steps=16, lr=0.2, batch_size=16),
                             build_model(spec, initialize=True), "t1")
    rng = np.random.default_rng(0)
    labels = (rng.random(200) < 0.9).astype(np.int64)
    texts = tuple(f"review number {i}" for i in range(200))
    train, held = Examples(texts[:150], labels[:150]), Examples(texts[150:], labels[150:])
    # Act
    for r in range(3):
        part.train(train, np.random.default_rng(r))
    scores = part.score(held)
    data = part.to_bytes()
    again = LabelPersonalPart(PersonalConfig(), build_model(spec, initialize=True), "t1")
    again.restore(data)
    # Assert
    assert scores is not None and scores.local is not None
    assert part.active and part.bias[1] > part.bias[0]
    assert scores.personal >= scores.shared and scores.personal >= 0.8
    assert scores.local == pytest.approx(float((held.labels == 1).mean()))
    assert again.refused is None and torch.equal(again.bias, part.bias)
