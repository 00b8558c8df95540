"""The objectives' math (`seedfed.shared.model.objectives`) on tiny causal LMs of four families
(Llama, Qwen2, GPT-2, OPT): label words are a linear head of LM-head rows on the frozen body,
their loss a K-way cross-entropy, the next-token counts what a hand count gives, and the
per-copy losses of stacked copies the single loss of each copy."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from seedfed.client.objective_batches import prompt_batch
from seedfed.client.probes import repeat_batch
from seedfed.shared.model.hf import load_base
from seedfed.shared.model.lora import apply_lora
from seedfed.shared.model.objectives import (
    ANSWER,
    LabelWords,
    causal_lm_loss,
    causal_lm_losses,
    label_word_ids,
    lm_parts,
    next_token_counts,
    word_starts,
)
from seedfed.shared.protocol.objective import Objective
from seedfed.shared.protocol.task import LoraOptions, TaskSpec
from torch import nn

from tests.fleet_helpers import CAUSAL_LM_FAMILIES, write_tiny_causal_lm

TEXTS = ("the film was great", "a sad day", "it is very very very quite dull food", "fine")
LABELS = torch.tensor([1, 0, 0, 1])
OBJECTIVE = Objective("label_words")
MAX_LEN = 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=CAUSAL_LM_FAMILIES)
def lm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
       ) -> tuple[nn.Module, Any]:
    """(model, tokenizer) of one family, loaded as a device loads its base."""
    path = write_tiny_causal_lm(tmp_path_factory.mktemp(request.param) / "model", request.param)
    return load_base(TaskSpec(model_path=str(path), model_kind="causal_lm"))


def _prompts(tokenizer: Any) -> dict[str, torch.Tensor]:
    return prompt_batch(tokenizer, OBJECTIVE, TEXTS, LABELS.numpy(), MAX_LEN)


def _full_model_word_logits(model: nn.Module, batch: dict[str, torch.Tensor],
                            word_ids: list[int]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    rows = torch.arange(logits.shape[0])
    return logits[rows, batch[ANSWER]][:, word_ids].float()


# -- label words -----------------------------------------------------------------------------------
def test_the_label_words_are_the_first_character_of_each_word(lm: tuple[nn.Module, Any]) -> None:
    _, tokenizer = lm

    ids = label_word_ids(tokenizer, OBJECTIVE)

    assert ids == tokenizer.convert_tokens_to_ids(["t", "g"])  # terrible, great


@torch.no_grad()
def test_label_words_are_a_linear_head_of_lm_head_rows_on_the_frozen_body(
        lm: tuple[nn.Module, Any]) -> None:
    # Arrange: a K-row Linear holding the LM head's label-word rows (and bias rows, if any)
    model, tokenizer = lm
    word_ids = label_word_ids(tokenizer, OBJECTIVE)
    batch = _prompts(tokenizer)
    decoder, head = lm_parts(model)
    linear = nn.Linear(head.in_features, len(word_ids), bias=head.bias is not None)
    linear.weight.copy_(head.weight[word_ids])
    if head.bias is not None:
        linear.bias.copy_(head.bias[word_ids])
    hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
    at_answer = hidden[torch.arange(len(TEXTS)), batch[ANSWER]]

    # Act
    got = LabelWords(word_ids).logits(model, batch)

    # Assert
    assert got.shape == (len(TEXTS), 2) and got.dtype == torch.float32
    torch.testing.assert_close(got, linear(at_answer), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, _full_model_word_logits(model, batch, word_ids),
                               rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_label_words_read_through_a_lora_wrapper_match_its_full_logits(
        lm: tuple[nn.Module, Any]) -> None:
    # Arrange: peft adapters (on a copy: the base is shared by the module's tests) with nonzero
    # weights, so the wrapper's forward differs from the base
    model, tokenizer = lm
    wrapped = apply_lora(copy.deepcopy(model), LoraOptions(r=2), "causal_lm")
    gen = torch.Generator().manual_seed(3)
    for name, p in wrapped.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    word_ids = label_word_ids(tokenizer, OBJECTIVE)
    batch = _prompts(tokenizer)

    # Act
    got = LabelWords(word_ids).logits(wrapped, batch)

    # Assert
    torch.testing.assert_close(got, _full_model_word_logits(wrapped, batch, word_ids),
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, LabelWords(word_ids).logits(model, batch), atol=1e-4)


@torch.no_grad()
def test_the_label_words_loss_is_the_cross_entropy_over_the_k_logits(
        lm: tuple[nn.Module, Any]) -> None:
    # Arrange
    model, tokenizer = lm
    word_ids = label_word_ids(tokenizer, OBJECTIVE)
    batch = _prompts(tokenizer)
    logits = _full_model_word_logits(model, batch, word_ids).double().tolist()
    by_hand = sum(math.log(sum(math.exp(v) for v in row)) - row[int(y)]
                  for row, y in zip(logits, LABELS, strict=True)) / len(TEXTS)

    # Act
    loss = LabelWords(word_ids).loss(model, batch)

    # Assert
    assert loss.shape == () and math.isfinite(float(loss))
    assert float(loss) == pytest.approx(by_hand, rel=1e-5)


def test_lm_parts_refuses_a_head_that_scales_its_logits() -> None:
    from tests.shared.conftest import tiny_llama

    model = tiny_llama()
    model.config.logit_scale = 0.5

    with pytest.raises(ValueError, match="logit_scale"):
        lm_parts(model)


# -- prompt batches ------------------------------------------------------------------------------
def test_a_prompt_keeps_the_templates_end_and_answers_at_its_last_token(
        lm: tuple[nn.Module, Any]) -> None:
    # Arrange: one text far longer than the budget, one short
    _, tokenizer = lm
    suffix = tokenizer(" It was", add_special_tokens=False)["input_ids"]
    texts = ("very " * 40 + "good", "bad")

    # Act
    batch = prompt_batch(tokenizer, OBJECTIVE, texts, None, max_len=12)

    # Assert: the long row fills max_len and ends with the suffix; the short one is right-padded
    ids, mask, answer = batch["input_ids"], batch["attention_mask"], batch[ANSWER]
    assert "labels" not in batch
    assert ids.shape == (2, 12)
    assert answer.tolist() == [11, int(mask[1].sum()) - 1]
    for row in range(2):
        end = int(answer[row]) + 1
        assert ids[row, end - len(suffix):end].tolist() == suffix
        assert mask[row, :end].tolist() == [1] * end
        assert mask[row, end:].tolist() == [0] * (12 - end)
        assert set(ids[row, end:].tolist()) <= {tokenizer.pad_token_id}
    short = tokenizer.decode(ids[1, :int(answer[1]) + 1].tolist())
    assert short.replace(" ", "").lower() == "baditwas"


def test_a_max_len_without_room_for_text_is_refused(lm: tuple[nn.Module, Any]) -> None:
    _, tokenizer = lm
    tail = len(tokenizer(" It was", add_special_tokens=False)["input_ids"])

    with pytest.raises(ValueError, match="leaves no room"):
        prompt_batch(tokenizer, OBJECTIVE, ("good",), None, max_len=tail + 1)


# -- next-token counts ---------------------------------------------------------------------------
def test_next_token_counts_score_word_starts_and_skip_ignored_targets() -> None:
    # Arrange: vocabulary of 6, ids 1, 2 and 5 begin words. Row 0's targets (labels shifted by
    # one) are 2 (a word start, the top-1), 3 (no word start), -100 (skipped) and 1 (a word
    # start, third of the top-3); row 1 has no target at all.
    starts = torch.tensor([False, True, True, False, False, True])
    labels = torch.tensor([[0, 2, 3, -100, 1], [4, -100, -100, -100, -100]])
    row0 = [[0.0, 1.0, 5.0, 2.0, 3.0, 4.0],  # -> 2: top-1 and top-3
            [0.0, 1.0, 2.0, 6.0, 3.0, 4.0],  # -> 3: a hit, but not a word start
            [9.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # -> -100
            [5.0, 3.0, 0.0, 4.0, 1.0, 2.0],  # -> 1: third
            [0.0, 0.0, 0.0, 0.0, 0.0, 9.0]]  # the last position predicts nothing
    logits = torch.tensor([row0, [[1.0] * 6] * 5])

    def nll(row: list[float], target: int) -> float:
        return math.log(sum(math.exp(v) for v in row)) - row[target]

    # Act
    counts = next_token_counts(logits, labels, starts)

    # Assert
    assert (counts.tokens, counts.words, counts.top1, counts.top3) == (3, 2, 1, 2)
    assert counts.nll == pytest.approx(nll(row0[0], 2) + nll(row0[1], 3) + nll(row0[3], 1),
                                       rel=1e-6)
    assert counts.perplexity == pytest.approx(math.exp(counts.nll / 3), rel=1e-9)
    assert (counts.top1_accuracy, counts.top3_accuracy) == (0.5, 1.0)


def test_the_word_starts_of_a_character_tokenizer_are_its_space(
        lm: tuple[nn.Module, Any]) -> None:
    _, tokenizer = lm

    starts = word_starts(tokenizer)

    space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    assert starts.shape == (len(tokenizer),)
    assert starts.nonzero().flatten().tolist() == space


# -- per-copy losses -----------------------------------------------------------------------------
@torch.no_grad()
def test_per_copy_label_word_losses_are_each_copys_loss(lm: tuple[nn.Module, Any]) -> None:
    model, tokenizer = lm
    words = LabelWords(label_word_ids(tokenizer, OBJECTIVE))
    batch = _prompts(tokenizer)

    losses = words.losses(model, repeat_batch(batch, 3), 3)

    single = words.loss(model, batch)
    assert losses.shape == (3,)
    torch.testing.assert_close(losses, single.expand(3), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_per_copy_next_token_losses_are_each_copys_loss(lm: tuple[nn.Module, Any]) -> None:
    # Arrange: right-padded texts, padding targets -100
    model, tokenizer = lm
    enc = tokenizer(list(TEXTS), padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
             "labels": labels}

    # Act
    losses = causal_lm_losses(model, repeat_batch(batch, 3), 3)

    # Assert
    single = causal_lm_loss(model, batch)
    assert losses.shape == (3,) and math.isfinite(float(single))
    torch.testing.assert_close(losses, single.expand(3), rtol=1e-5, atol=1e-6)
