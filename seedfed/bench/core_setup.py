"""What every core-benchmark process builds the same way: the model, the batch, the RSS probes.

Peak memory is compared across processes, so each one does the identical setup (imports, model,
batch) before its measured region; the high-water mark is reset after setup, so the figure is the
peak of the measured work on top of that common baseline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class ModelShape:
    """A Llama shape and the batch it is measured on."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch: int
    seq_len: int

    def __post_init__(self) -> None:
        for field_name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab",
                           "batch", "seq_len"):
            value = getattr(self, field_name)
            if value < 1:
                raise ValueError(f"{self.name}: {field_name} must be >= 1, got {value}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: hidden {self.hidden}, heads {self.heads} and kv heads "
                             f"{self.kv_heads} must divide evenly")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


#: SmolLM-135M (HuggingFaceTB) hyperparameters, built from config: no weights are downloaded.
SMOLLM_135M = ModelShape("smollm-135m", hidden=576, layers=30, heads=9, kv_heads=3,
                         intermediate=1536, vocab=49152, batch=8, seq_len=128)
#: A small Llama of the same family for the under-a-minute smoke run.
QUICK = ModelShape("llama-quick", hidden=128, layers=4, heads=4, kv_heads=2,
                   intermediate=384, vocab=4096, batch=4, seq_len=64)
SHAPES: dict[str, ModelShape] = {"full": SMOLLM_135M, "quick": QUICK}


def shape_named(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError as e:
        raise ValueError(f"unknown benchmark shape {name!r}; known: {sorted(SHAPES)}") from e


def build_model(shape: ModelShape, seed: int = 0) -> nn.Module:
    """A float32 LlamaForCausalLM with tied embeddings, in eval mode, randomly initialized.

    transformers initializes from torch's global generator; fork_rng keeps that draw from
    leaking into (or depending on) anything else in the process.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, vocab_size=shape.vocab,
        max_position_embeddings=max(2048, shape.seq_len), rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float().eval()


def make_batch(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _status_kb(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in {_STATUS}")


def rss_mb() -> float:
    """Resident set size now."""
    return _status_kb("VmRSS") / 1024


def peak_rss_mb() -> float:
    """High-water mark of the resident set since start or the last `reset_peak`."""
    return _status_kb("VmHWM") / 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses, in which
    case the peak includes the setup's own transient peak (reported as such)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return abs(peak_rss_mb() - rss_mb()) < 1.0
