"""Tokenized text, memoized: a device tokenizes the same sentences every round.

A device's batches, its personal part's batches and its held-out scoring all tokenize texts
from one fixed set of a few thousand sentences, ~2-3 ms a batch with a fast tokenizer. The
memo tokenizes each text once per (tokenizer, max_len) and pads batches from the stored ids,
to the tensors the tokenizer itself returns (tests/shared/model/test_tokens.py compares them); the
feature cache's `expect_texts` fills it with a device's whole set in one call.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch only where a batch becomes tensors (the ORT device has none)
    import torch

#: The tokenizer outputs a batch keeps.
BATCH_KEYS = ("input_ids", "attention_mask", "token_type_ids")


class TokenMemo:
    """Unpadded encodings of texts (one tokenizer, one max_len), padded into batches."""

    #: Texts held before the memo starts over (a simulation's process serves every device:
    #: SST-2's 67k sentences are ~15 MB here).
    LIMIT = 200_000

    def __init__(self, tokenizer: Any, max_len: int) -> None:
        self.tokenizer, self.max_len = tokenizer, max_len
        self.pad = {"input_ids": tokenizer.pad_token_id, "attention_mask": 0,
                    "token_type_ids": getattr(tokenizer, "pad_token_type_id", 0)}
        self.rows: dict[str, dict[str, np.ndarray]] = {}

    def unpadded(self, texts: Sequence[str]) -> list[dict[str, np.ndarray]]:
        """Each text's encoding (int64 arrays by output name), tokenizing only new texts."""
        new = [t for t in dict.fromkeys(texts) if t not in self.rows]
        if new:
            if len(self.rows) + len(new) > self.LIMIT:
                self.rows.clear()
            enc = self.tokenizer(new, truncation=True, max_length=self.max_len)
            keys = [k for k in BATCH_KEYS if k in enc]
            for i, t in enumerate(new):
                self.rows[t] = {k: np.asarray(enc[k][i], dtype=np.int64) for k in keys}
        return [self.rows[t] for t in texts]

    def batch(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The padded batch `tokenizer(texts, padding=True, truncation=True,
        max_length=max_len, return_tensors="pt")` returns (right padding)."""
        import torch

        rows = self.unpadded(texts)
        width = max(len(r["input_ids"]) for r in rows)
        out = {}
        for k in rows[0]:
            arr = np.full((len(rows), width), self.pad[k], dtype=np.int64)
            for i, r in enumerate(rows):
                arr[i, :len(r[k])] = r[k]
            out[k] = torch.from_numpy(arr)
        return out


_MEMOS: weakref.WeakKeyDictionary[Any, dict[int, TokenMemo]] = weakref.WeakKeyDictionary()


def memo_for(tokenizer: Any, max_len: int) -> TokenMemo | None:
    """The tokenizer's memo (None: a tokenizer this padding does not reproduce)."""
    if (getattr(tokenizer, "padding_side", "right") != "right"
            or getattr(tokenizer, "pad_token_id", None) is None):
        return None
    try:
        memos = _MEMOS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no memo
        return None
    if max_len not in memos:
        memos[max_len] = TokenMemo(tokenizer, max_len)
    return memos[max_len]
