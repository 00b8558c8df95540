"""The body scope of the SST-2 body recipe on a tiny sentence BERT: LoRA on the top layer's FFN
output projection with step scales, on fp32 and on an int8/int4 base (float adapters over
quantized base weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from seedfed.client.probes import ProbeEngine, engine_step
from seedfed.shared.model.estimator import ZOConfig, spsa_step
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.objectives import classification_loss, classification_losses
from seedfed.shared.model.quant.model import QuantLinear
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.protocol.task import Hyper, LoraOptions, TaskSpec

from tests.fleet_helpers import make_tiny_sentence_bert

SEEDS = [21, 22, 23]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_sentence_bert(tmp_path_factory.mktemp("body") / "bert")


def _spec(model: Path, fmt: str) -> TaskSpec:
    return TaskSpec(model_path=str(model), model_kind="seq_cls", num_labels=2,
                    label_texts=("bad", "good"), scope="lora", format=fmt,  # type: ignore[arg-type]
                    lora=LoraOptions(r=4, alpha=8, target_modules=("layer.1.output.dense",)),
                    step_scales=(("lora_", 0.05),), hyper=Hyper(lr=1.0, perturbations=3),
                    max_seq_len=16)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 27, (4, 7), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.tensor([0, 1, 1, 0])}


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
def test_body_scope_is_lora_on_one_projection_plus_the_head(bert_dir: Path, fmt: str) -> None:
    bundle = build_model(_spec(bert_dir, fmt), initialize=True)

    names = bundle.scope.names
    assert {n.rsplit(".", 2)[0].split("encoder.")[-1] for n in names if "lora_" in n} == {
        "layer.1.output.dense.lora_A", "layer.1.output.dense.lora_B"}
    assert any("classifier" in n for n in names)
    assert all(t.step_scale == (0.05 if "lora_" in t.name else 1.0) for t in bundle.scope)
    quant = [n for n, m in bundle.model.named_modules() if isinstance(m, QuantLinear)]
    if fmt == "fp32":
        assert quant == []
    else:
        assert any(n.endswith("layer.1.output.dense.base_layer") for n in quant)
        assert not any("lora_" in n or "classifier" in n for n in quant)


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_device_and_coordinator_bundles_replay_to_one_checksum(bert_dir: Path, fmt: str) -> None:
    device = build_model(_spec(bert_dir, fmt), initialize=True)
    coordinator = build_model(_spec(bert_dir, fmt), initialize=True)
    config = ZOConfig(lr=1.0, eps=1e-3, perturbations=len(SEEDS))
    batch = _batch()

    engine = ProbeEngine(device.model, device.scope, classification_loss, classification_losses)
    result = engine_step(engine, batch, SEEDS, config)
    apply_seeds(coordinator.scope, SEEDS, (-(1.0 / len(SEEDS)) * result.g.astype(np.float64))
                .astype(np.float32).tolist())

    assert checksum(device.scope) == checksum(coordinator.scope)


def test_batched_body_probes_match_sequential_probes(bert_dir: Path) -> None:
    bundle = build_model(_spec(bert_dir, "fp32"), initialize=True)
    with torch.no_grad():  # B starts at zero; make A matter too
        for t in bundle.scope:
            if "lora_B" in t.name:
                t.tensor.copy_(torch.randn(t.tensor.shape, generator=torch.Generator()
                                           .manual_seed(1)) * 0.1)
    config = ZOConfig(lr=1.0, eps=1e-3, perturbations=len(SEEDS))
    batch, start = _batch(), bundle.scope.read()
    with torch.no_grad():
        ref = spsa_step(bundle.scope, lambda: float(classification_loss(bundle.model, batch)),
                        SEEDS, config).g
    bundle.scope.write(start)

    engine = ProbeEngine(bundle.model, bundle.scope, classification_loss, classification_losses)
    got = engine_step(engine, batch, SEEDS, config).g

    np.testing.assert_allclose(got, ref, atol=2e-3, rtol=1e-3)
    assert engine.stats.shared_modules > 0
