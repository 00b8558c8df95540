"""Scoring a model version on labelled text: `seedfed evaluate`.

A model version is the task definition (`task.json`, a TaskSpec) plus the trainable state of
that version (a safetensors file of the scope's tensors, flat float32 under their canonical
names, as `Scope.read()` returns them). A simulation's run directory holds both:

    run_dir/task.json                      the TaskSpec (TaskSpec.to_dict as JSON)
    run_dir/snapshots/<version>.safetensors trainable state of each published version

`--run DIR` takes the latest snapshot (highest integer stem, else newest file); `--snapshot FILE
--task FILE` names them directly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from seedfed.client.data import Examples, load_labelled, tokenize
from seedfed.shared.model.factory import ModelBundle, build_model
from seedfed.shared.protocol.task import TaskSpec

#: Texts per forward when scoring; sorted by length so padding stays small.
EVAL_BATCH = 128


@dataclass(frozen=True)
class Score:
    accuracy: float
    examples: int
    correct: int


@torch.no_grad()
def predict(bundle: ModelBundle, examples: Examples, batch_size: int = EVAL_BATCH,
            ) -> torch.Tensor:
    """Predicted class per example (in the examples' order)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model = bundle.model.eval()
    order = sorted(range(len(examples)), key=lambda i: len(examples.texts[i]))
    preds = torch.empty(len(examples), dtype=torch.long)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = tokenize(bundle.tokenizer, [examples.texts[i] for i in idx], None,
                         bundle.spec.max_seq_len)
        preds[torch.tensor(idx)] = model(**batch).logits.argmax(dim=-1)
    return preds


def accuracy(bundle: ModelBundle, examples: Examples, batch_size: int = EVAL_BATCH) -> Score:
    """The version's accuracy under the task's objective: a classifier's and a label-words
    LM's class accuracy per example; a next-token LM's next-word top-3 accuracy (`correct`:
    that share of the examples, rounded)."""
    if len(examples) == 0:
        raise ValueError("cannot score an empty example set")
    if bundle.spec.model_kind == "causal_lm":
        from seedfed.client.device_data import local_accuracy

        acc = local_accuracy(bundle, examples)[0]
        return Score(acc, len(examples), round(acc * len(examples)))
    preds = predict(bundle, examples, batch_size)
    correct = int((preds == torch.as_tensor(examples.labels)).sum())
    return Score(correct / len(examples), len(examples), correct)


def load_task(path: str | Path) -> TaskSpec:
    path = Path(path)
    try:
        return TaskSpec.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a task definition ({e})") from e


def load_snapshot(bundle: ModelBundle, path: str | Path) -> None:
    """Write a safetensors snapshot of the trainable state into the bundle's scope."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no snapshot at {path}")
    bundle.scope.write(load_file(str(path)))


def latest_snapshot(run_dir: str | Path) -> Path:
    """The run's newest snapshot: highest integer version in the file stem, else newest mtime."""
    snaps = sorted(Path(run_dir, "snapshots").glob("*.safetensors"))
    if not snaps:
        raise FileNotFoundError(f"{run_dir}/snapshots holds no .safetensors snapshot")

    def version(p: Path) -> tuple[int, float]:
        m = re.search(r"(\d+)$", p.stem)
        return (int(m.group(1)) if m else -1, p.stat().st_mtime)

    return max(snaps, key=version)


def evaluate(data: str | Path, *, task: str | Path | None = None,
             snapshot: str | Path | None = None, run: str | Path | None = None,
             limit: int | None = None) -> Score:
    """Score a model version on a labelled TSV/JSONL file (see the module docstring)."""
    if run is not None:
        task = task or Path(run, "task.json")
        snapshot = snapshot or latest_snapshot(run)
    if task is None:
        raise ValueError("name the task definition (--task FILE) or a run directory (--run DIR)")
    spec = load_task(task)
    examples = load_labelled(data)
    if limit is not None:
        examples = examples.subset(range(min(limit, len(examples))))
    if examples.num_labels > spec.num_labels:
        raise ValueError(f"{data} has label {examples.num_labels - 1}, the task only "
                         f"{spec.num_labels} labels")
    if spec.scope == "ternary" and snapshot is not None:
        return accuracy(packed_bundle(spec, snapshot), examples)
    bundle = build_model(spec, initialize=snapshot is None)
    if snapshot is not None:
        load_snapshot(bundle, snapshot)
    return accuracy(bundle, examples)


def packed_bundle(spec: TaskSpec, snapshot: str | Path) -> ModelBundle:
    """A ternary task's version as a device holds it: the packed model loaded from a published
    ternary snapshot `v{N}.safetensors`, verified against `v{N}.sha256` beside it."""
    from seedfed.client.ternary import PackedTernary

    path = Path(snapshot)
    chk_file = path.with_suffix(".sha256")
    if not chk_file.is_file():
        raise FileNotFoundError(f"no checksum {chk_file} beside the ternary snapshot {path}")
    m = re.search(r"(\d+)$", path.stem)
    packed = PackedTernary(spec)
    packed.load_snapshot(path.read_bytes(), int(m.group(1)) if m else 0,
                         chk_file.read_text(encoding="utf-8").strip())
    return packed.bundle
