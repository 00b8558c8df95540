"""The recording pass and the task-creation check both sides run: a scope the loss never
reads is refused, stacked copies beyond the memory budget are refused, and the recorder keeps
exactly the outputs no scoped tensor reaches."""

from __future__ import annotations

import pytest
import torch
from seedfed.shared.model.probe_check import (
    ForwardRecorder,
    ProbeMemoryError,
    check_task_probes,
)
from seedfed.shared.model.scopes import build_scope
from seedfed.shared.protocol.errors import ScopeError
from torch import nn

from tests.shared.conftest import lora_llama, tiny_llama


def test_a_scope_the_loss_never_reads_is_refused() -> None:
    model = tiny_llama()
    model.extra = nn.Linear(2, 2)  # registered, never called by the forward

    with pytest.raises(ScopeError, match="influences"):
        check_task_probes(model, build_scope("named", model, patterns=("extra",)),
                          batch_size=2, seq_len=8, copies=None, budget_mb=64)


def test_task_check_refuses_copies_beyond_the_memory_budget() -> None:
    model, scope = lora_llama(("q_proj", "v_proj"))
    est = check_task_probes(model, scope, batch_size=4, seq_len=32, copies=1, budget_mb=0)

    assert est.reaches_loss and est.per_copy_bytes > 0
    with pytest.raises(ProbeMemoryError, match="probe_copies=8"):
        check_task_probes(model, scope, batch_size=4, seq_len=32, copies=8,
                          budget_mb=est.bytes_for(8) / 2**20 / 2)


def test_the_recorder_keeps_the_layers_below_the_scope_and_sees_it_reach_the_loss() -> None:
    # Arrange: LoRA on the top layer's attention of a 2-layer Llama
    model, scope = lora_llama(("layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"))
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    # Act
    with torch.no_grad():
        rec = ForwardRecorder(model, scope).record(
            batch, lambda: model(**batch).logits.float().square().mean())

    # Assert: layer 0 is kept whole, nothing that holds a scoped tensor is
    shared = {id(c.module) for c in rec.plan.shared}
    base = model.base_model.model.model
    assert rec.reaches_loss
    assert id(base.layers[0]) in shared
    assert id(base.layers[1]) not in shared
    assert all(c.output is not None for c in rec.plan.shared)
    assert rec.plan.shared_bytes > 0 and rec.plan.per_copy_bytes > 0
