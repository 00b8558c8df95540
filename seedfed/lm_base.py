"""`seedfed lm-base`: make a small pretrained causal LM (a Llama) from a data file's sentences.

No pretrained causal LM can be downloaded here, so the language-model fleets (docs/llm.md) start
from one made here: a byte-level BPE tokenizer and a Llama-shaped model (`CausalLMConfig`),
pretrained first-order on next-token loss over the training split's sentences (labels dropped).
The sentences are the *first* `sentences` of `ternarize.training_order`: a fleet that needs
text the base never saw takes it from the end of that order (`client.lm_fleet`).

The result is a normal Hugging Face causal-LM directory with its tokenizer; `lm_base.json`
records the settings key, the wall time and the validation perplexity. A directory whose key
matches is reused (`ensure_lm_base`), so tests, demos and benchmarks pay for it once. The
ternary base of the same settings distils from it (`ternarize.ternarize_causal(teacher=...)`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from seedfed.ternarize import (
    CausalLMConfig,
    build_causal_lm,
    causal_settings_key,
    perplexity,
    pretrain,
    train_tokenizer,
    training_order,
)

#: Metadata file of a pretrained base.
LM_META_FILE = "lm_base.json"

#: The demonstration base of docs/llm.md: about 5M parameters, <= 30 minutes on 2 cores.
DEMO_CONFIG = CausalLMConfig(vocab=4096, hidden=256, layers=4, heads=4, intermediate=704,
                             sentences=30000, max_len=32, batch_size=32, pretrain_epochs=2,
                             pretrain_lr=2e-3)


def read_lm_meta(out: Path) -> dict[str, Any] | None:
    path = out / LM_META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def pretrain_lm_base(data: Path, out: Path, config: CausalLMConfig,
                     on_step: Callable[[int, int, float], None] | None = None,
                     ) -> dict[str, Any]:
    """Tokenizer + fp32 next-token pretraining on the training split of `data`, saved at
    `out`; returns the metadata written to `out/lm_base.json`."""
    from seedfed.client.device_data import dataset_splits

    splits = dataset_splits(str(data))
    order = training_order(len(splits.train), config.seed)
    texts = [splits.train.texts[i] for i in order[:config.sentences]]
    held = list(splits.validation.texts[:config.eval_size])
    started, cpu = time.perf_counter(), time.process_time()
    tokenizer = train_tokenizer(texts, config.vocab)
    model = pretrain(build_causal_lm(config, tokenizer), tokenizer, texts, config, on_step)
    meta = {"model_kind": "causal_lm", "data": data.name, "config": asdict(config),
            "key": causal_settings_key(data, config),
            "pretrain_seconds": round(time.perf_counter() - started, 1),
            "pretrain_cpu_seconds": round(time.process_time() - cpu, 1),
            "threads": torch.get_num_threads(), "sentences": len(texts),
            "parameters": sum(p.numel() for p in model.parameters()),
            "perplexity": perplexity(model, tokenizer, held, config.max_len),
            "scored_on": f"validation split ({len(held)} sentences)"}
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)  # type: ignore[operator]
    (out / LM_META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def ensure_lm_base(data: Path, out: Path, config: CausalLMConfig = DEMO_CONFIG,
                   on_step: Callable[[int, int, float], None] | None = None,
                   ) -> dict[str, Any]:
    """`pretrain_lm_base`, unless `out` already holds a base made with the same settings."""
    meta = read_lm_meta(out)
    if meta is not None and meta.get("key") == causal_settings_key(data, config) and \
            (out / "model.safetensors").is_file():
        return meta
    return pretrain_lm_base(data, out, config, on_step)


def run_with_progress(data: Path, out: Path, config: CausalLMConfig,
                      force: bool = False) -> dict[str, Any]:
    """`ensure_lm_base` (or `pretrain_lm_base` with `force`) with a progress bar."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    columns = [TextColumn("[bold]pretrain {task.completed}/{task.total}"), BarColumn(),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("pretrain", total=None, loss="-")

        def on_step(step: int, total: int, loss: float) -> None:
            progress.update(bar, completed=step, total=total, loss=f"{loss:.4f}")

        fn = pretrain_lm_base if force else ensure_lm_base
        meta = fn(data, out, config, on_step)
    console.print(f"causal-LM base {out}: {meta['parameters']:,} parameters, validation "
                  f"perplexity {meta['perplexity']:.2f}, {meta['pretrain_seconds']:.0f} s")
    return meta
