"""The token memo pads batches to the tensors the tokenizer itself returns and tokenizes each
text once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from seedfed.client.data import tokenize
from seedfed.shared.model.tokens import TokenMemo, memo_for
from transformers import AutoTokenizer

from tests.fleet_helpers import make_tiny_bert


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(str(make_tiny_bert(tmp_path_factory.mktemp("tok"))))


TEXTS = ["a good film", "bad", "", "the plot is thin but the cast is warm and funny",
         "x " * 80, "a good film"]


@pytest.mark.parametrize("max_len", [4, 16, 64])
def test_memo_batches_equal_the_tokenizers_own(tokenizer, max_len: int) -> None:  # noqa: ANN001
    rng = np.random.default_rng(0)
    for _ in range(30):
        texts = [TEXTS[i] for i in rng.integers(0, len(TEXTS), size=int(rng.integers(1, 9)))]

        mine = tokenize(tokenizer, texts, None, max_len)

        ref = tokenizer(texts, padding=True, truncation=True, max_length=max_len,
                        return_tensors="pt")
        assert set(mine) == {k for k in ref if k in mine} and "input_ids" in mine
        for k, v in mine.items():
            assert v.dtype == ref[k].dtype and torch.equal(v, ref[k]), k


def test_each_text_is_tokenized_once(tokenizer) -> None:  # noqa: ANN001
    calls = []

    class Counting:
        pad_token_id, pad_token_type_id, padding_side = 0, 0, "right"

        def __call__(self, texts: list[str], **kwargs: object) -> dict:
            calls.append(list(texts))
            return tokenizer(texts, **kwargs)

    memo = TokenMemo(Counting(), 16)

    memo.batch(["a", "b"])
    memo.batch(["b", "a", "c"])

    assert calls == [["a", "b"], ["c"]]


def test_a_left_padding_tokenizer_gets_no_memo(tokenizer) -> None:  # noqa: ANN001
    class Left:
        pad_token_id, padding_side = 0, "left"

    assert memo_for(Left(), 16) is None and memo_for(tokenizer, 16) is not None
