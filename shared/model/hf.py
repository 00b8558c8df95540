"""Loading a local Hugging Face directory: the frozen base model, its tokenizer, and the pooling
a sentence-transformers directory declares (which makes it a `MeanPoolClassifier`). Any other
directory loads with `AutoModelForSequenceClassification` / `AutoModelForCausalLM`."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from seedfed.shared.model.classifier import MeanPoolClassifier
from seedfed.shared.protocol.task import TaskSpec
from torch import nn


@dataclass(frozen=True)
class PoolingConfig:
    """How a sentence-transformers directory turns token states into a sentence embedding."""

    mean: bool = True
    normalize: bool = False


def sentence_pooling(path: Path) -> PoolingConfig | None:
    """The pooling of a sentence-transformers directory, or None for a plain HF directory."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{modules_file} is not valid JSON: {e}") from e
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = types.get("Pooling")
    if pooling is None:
        return None
    conf_file = path / pooling.get("path", "1_Pooling") / "config.json"
    conf = json.loads(conf_file.read_text(encoding="utf-8")) if conf_file.is_file() else {}
    if not conf.get("pooling_mode_mean_tokens", True):
        return None  # CLS/max pooling: the plain classification head is the closer match
    return PoolingConfig(mean=True, normalize="Normalize" in types)


#: transformers' `from_pretrained` swaps `PreTrainedModel.tie_weights` for a no-op while it loads
#: and puts it back after; two loads in threads (devices of one process) can interleave so the
#: no-op stays, and every model built after that comes out with untied embeddings. One load at a
#: time keeps the class intact.
_LOADING = threading.Lock()


def load_base(spec: TaskSpec) -> tuple[nn.Module, Any]:
    """Load the frozen base model and tokenizer from a local Hugging Face directory."""
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    path = Path(spec.model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    tokenizer = load_tokenizer(path)
    pooling = sentence_pooling(path) if spec.model_kind == "seq_cls" else None
    model: nn.Module
    with _LOADING, _quiet_loading():
        if pooling is not None:
            encoder = AutoModel.from_pretrained(path, dtype=torch.float32,
                                                add_pooling_layer=False)
            model = MeanPoolClassifier(encoder, spec.num_labels, pooling.normalize)
        elif spec.model_kind == "seq_cls":
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=spec.num_labels, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    set_pad_token_id(model, tokenizer)
    return model.eval(), tokenizer


def load_tokenizer(path: Path) -> Any:
    """The directory's tokenizer (None if it has none), with a pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def set_pad_token_id(model: nn.Module, tokenizer: Any) -> None:
    """Give the model's config the tokenizer's pad id when it names none."""
    config = getattr(model, "config", None)
    if tokenizer is not None and config is not None and getattr(config, "pad_token_id",
                                                                None) is None:
        config.pad_token_id = tokenizer.pad_token_id


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """Silence transformers' load report (the sentence-transformers checkpoint carries an unused
    BERT pooler that would be reported as unexpected on every device start)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                             "vocab.txt", "tokenizer.model"))
