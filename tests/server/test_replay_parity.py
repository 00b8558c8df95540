"""The coordinator and a device reach the same state from the same entry, for every scope kind.

The coordinator applies an aggregated entry to its fp32 master (`server.aggregation.
apply_entry`); a device replays it (`client.sync.catch_up`). Both must be one arithmetic
(`shared.replay.apply_seeds`): if either side grew its own copy and the copies drifted (say,
one forgot the `compact` form of a ternary device's masked latents), these tests fail.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
from seedfed.client.sync import catch_up
from seedfed.server.aggregation import apply_entry
from seedfed.shared.model.quant import QuantConfig, build_quantized
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.scopes import Scope, build_scope
from seedfed.shared.model.ternary import (
    TernaryScope,
    bitlinear_modules,
    load_published_ternary,
    publish_ternary,
)
from seedfed.shared.protocol.npzo import LogEntry
from torch import nn
from transformers import LlamaConfig

TASK = "parity"
SEEDS = (7, 2**53 - 1, 12345, 0)
COEFS = (1e-3, -2.5e-3, 4e-4, -1e-4)


def _seeded(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _mlp() -> nn.Module:
    return _seeded(nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 8)))


def _with_adapters() -> nn.Module:
    # parameter names as peft's LoRA wrapping produces them ("...lora_A...")
    return _seeded(nn.Sequential(OrderedDict(base=nn.Linear(8, 8), lora_A=nn.Linear(8, 2),
                                             lora_B=nn.Linear(2, 8))))


def _quantized() -> nn.Module:
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return build_quantized(cfg, QuantConfig(bits=4, group_size=32))


#: kind -> (model factory, scope options): the coordinator's and the device's scope alike.
FP32_KINDS: dict[str, tuple[Callable[[], nn.Module], dict[str, object]]] = {
    "full": (_mlp, {}),
    "named": (_mlp, {"patterns": ("1.",)}),
    "lora": (_with_adapters, {}),
    "scales": (_quantized, {}),
}
TERNARY = {"fraction": 0.25, "epoch_rounds": 2}


def _ternary_pair() -> tuple[TernaryScope, TernaryScope]:
    """The coordinator's master (every latent) and a device's packed model (compact masked
    latents), both at the same version 0."""
    master = build_scope("ternary", _mlp(), **TERNARY)
    assert isinstance(master, TernaryScope)
    packed = build_scope("ternary", _mlp(), **TERNARY)
    assert isinstance(packed, TernaryScope)
    for _, m in bitlinear_modules(packed.model):
        m.to_packed(keep_latents=False)
    device = load_published_ternary(packed.model, publish_ternary(master.read(), master),
                                    config=master.config, epoch=0)
    assert all(t.compact for t in device) and not any(t.compact for t in master)
    return master, device


def _pairs() -> list[tuple[str, Scope, Scope]]:
    out: list[tuple[str, Scope, Scope]] = []
    for kind, (factory, options) in FP32_KINDS.items():
        model = factory()
        out.append((kind, build_scope(kind, model, **options),
                    build_scope(kind, copy.deepcopy(model), **options)))
    out.append(("ternary", *_ternary_pair()))
    return out


def _same_state(a: Scope, b: Scope) -> bool:
    ra, rb = a.read(), b.read()
    return ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)


@pytest.mark.parametrize("kind", [*FP32_KINDS, "ternary"])
def test_the_coordinators_master_and_a_device_agree_after_an_entry(kind: str) -> None:
    # Arrange: the two sides of one task at version 0
    _, master, device = next(p for p in _pairs() if p[0] == kind)
    assert checksum(master) == checksum(device)

    # Act: the coordinator applies the round's entry, the device replays what it published
    published = apply_entry(master, SEEDS, COEFS)
    result = catch_up(device, task_id=TASK, version=0, target=1,
                      entries=[LogEntry(TASK, 0, SEEDS, COEFS, published)])

    # Assert: the same bits (catch_up verified the checksum; the values say it again)
    assert result.checksum == published == checksum(device)
    assert _same_state(master, device)


@pytest.mark.parametrize("kind", [*FP32_KINDS, "ternary"])
def test_apply_entry_is_the_devices_replay_on_the_devices_own_form(kind: str) -> None:
    # Arrange: two copies of the device's scope (for ternary: compact masked latents)
    _, _, device = next(p for p in _pairs() if p[0] == kind)
    _, _, twin = next(p for p in _pairs() if p[0] == kind)

    # Act
    coordinator_way = apply_entry(device, SEEDS, COEFS)
    catch_up(twin, task_id=TASK, version=0, target=1,
             entries=[LogEntry(TASK, 0, SEEDS, COEFS, None)])

    # Assert
    assert coordinator_way == checksum(twin)
    assert _same_state(device, twin)
