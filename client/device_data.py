"""A device's private data: where it comes from, its non-IID share, its local score.

Every device derives the same split and the same Dirichlet partition of the same source from the
same seed and keeps only its own share; nothing about the data leaves the device. Used by both
device front ends (Flower ClientApp and plain HTTP) and by the simulation's evaluator, so they
carve identical splits. No Flower import here: an HTTP-only device does not need flwr.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from seedfed.client import data as data_mod
from seedfed.client import tastes

if TYPE_CHECKING:  # torch loads only to score a torch model: the ORT device shares the data
    from seedfed.shared.model.factory import ModelBundle
    from seedfed.shared.model.objectives import NextTokenCounts

F = TypeVar("F", bound=Callable[..., Any])


def _no_grad(fn: F) -> F:
    """torch.no_grad() around `fn`, importing torch only when it runs."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]


#: Local held-out examples a device scores in the sync phase (at most).
MAX_LOCAL_EVAL = 64


@dataclass(frozen=True)
class DeviceData:
    """Where a device's private examples come from. Overridable per node by node_config keys
    `data`, `partition-id`, `num-partitions`, `alpha`, `data-seed`, `local-eval`, `pool`,
    `label-skew`."""

    # "builtin" (generated preference task, one owner's taste), "tastes" (per-device tastes,
    # client.tastes) or a TSV/JSONL path
    source: str = "builtin"
    partition_id: int = 0
    num_partitions: int = 1
    alpha: float = 0.5
    seed: int = 0
    local_eval_fraction: float = 0.1
    # > 0: the fleet shares only this many training examples (a fixed random subset, the same
    # on every device), e.g. to compare recipes on a benchmark's pool; 0: the whole split.
    pool: int = 0
    # > 0: a label-skewed split instead of the Dirichlet one: device i's majority class
    # (i mod classes) is this fraction of its examples (client.tastes.label_skew_partition)
    label_skew: float = 0.0
    # What a file's labels may be: the task's (a REST device sets them from the task before it
    # enrolls); None: any integer >= 0
    labels: data_mod.LabelSpace | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.label_skew < 1:
            raise ValueError(f"label_skew must be in [0, 1), got {self.label_skew}")
        if self.pool < 0:
            raise ValueError(f"pool must be >= 0, got {self.pool}")
        if self.num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, got {self.num_partitions}")
        if not 0 <= self.partition_id < self.num_partitions:
            raise ValueError(f"partition_id {self.partition_id} is outside "
                             f"[0, {self.num_partitions})")
        if not self.alpha > 0:
            raise ValueError(f"Dirichlet alpha must be positive, got {self.alpha}")
        if not 0 <= self.local_eval_fraction < 1:
            raise ValueError(f"local_eval_fraction must be in [0, 1), got "
                             f"{self.local_eval_fraction}")

    def with_node_config(self, cfg: Mapping[str, Any]) -> DeviceData:
        """This configuration with the node's own settings applied (the node's word wins)."""
        keys = {"data": ("source", str), "partition-id": ("partition_id", int),
                "num-partitions": ("num_partitions", int), "alpha": ("alpha", float),
                "data-seed": ("seed", int), "local-eval": ("local_eval_fraction", float),
                "pool": ("pool", int), "label-skew": ("label_skew", float)}
        changes = {field: cast(cfg[key]) for key, (field, cast) in keys.items() if key in cfg}
        return replace(self, **changes)


def load_device_examples(data: DeviceData) -> tuple[data_mod.Examples, data_mod.Examples]:
    """The device's (train, local held-out) examples: its non-IID share of the training split.

    Every device derives the same partition of the same file from the same seed and keeps only
    its own share; nothing about the data is sent anywhere. The per-device taste task
    (`client.tastes`) generates each device's own examples instead.
    """
    if data.source == tastes.TASTES:
        return tastes.device_examples(data.seed, data.partition_id)
    train, parts = fleet_shares(data.source, data.num_partitions, data.alpha, data.seed,
                                data.pool, data.label_skew, data.labels)
    mine = train.subset(parts[data.partition_id])
    n_eval = min(MAX_LOCAL_EVAL, int(len(mine) * data.local_eval_fraction))
    order = np.random.default_rng([data.seed, data.partition_id]).permutation(len(mine))
    return mine.subset(np.sort(order[n_eval:])), mine.subset(np.sort(order[:n_eval]))


@functools.lru_cache(maxsize=4)
def fleet_shares(source: str, devices: int, alpha: float, seed: int, pool: int = 0,
                 label_skew: float = 0.0, labels: data_mod.LabelSpace | None = None,
                 ) -> tuple[data_mod.Examples, tuple[np.ndarray, ...]]:
    """(the fleet's training examples, every device's indices into them): the partition of a
    data source, computed once per process and fleet (a simulation's devices in one process
    share it; each process of a Ray simulation derives the same one from the seed).
    `data.fleet_partition` gives every device >= 2 examples at any fleet size; a label-skewed
    split (`label_skew` > 0) is `tastes.label_skew_partition`'s."""
    train = dataset_splits(source, labels).train
    if 0 < pool < len(train):
        pick = np.random.default_rng([seed, 1]).permutation(len(train))[:pool]
        train = train.subset(np.sort(pick))
    rng = np.random.default_rng(seed)
    if label_skew > 0:
        parts = tastes.label_skew_partition(train.labels, devices, label_skew, rng)
    else:
        parts = data_mod.fleet_partition(train.labels, devices, alpha, rng, min_size=2)
    for p in parts:
        p.setflags(write=False)  # shared by every device of the fleet in this process
    return train, tuple(parts)


def fleet_texts(data: DeviceData) -> tuple[str, ...]:
    """Every distinct sentence some device of `data`'s fleet holds (training and local
    held-out): what a simulation encodes once before round 1 (`seedfed.features.prefill`)."""
    if data.source == tastes.TASTES:
        seen = dict.fromkeys(t for p in range(data.num_partitions)
                             for ex in tastes.device_examples(data.seed, p) for t in ex.texts)
        return tuple(seen)
    train, parts = fleet_shares(data.source, data.num_partitions, data.alpha, data.seed,
                                data.pool, data.label_skew)
    held = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
    return tuple(train.texts[i] for i in held)


@functools.lru_cache(maxsize=4)
def dataset_splits(source: str, labels: data_mod.LabelSpace | None = None) -> data_mod.Splits:
    """The fixed train/validation/test split of a data source, the same on every device and
    in the evaluator: SST-2-sized files keep `data.split`'s sizes, small files a 10%/20% cut.
    Cached per process (Examples are immutable): the virtual devices of a simulation in one
    process parse the file once, not once each. `labels`: what a file's labels may be
    (`data.load_labelled`)."""
    if source == "builtin":
        from seedfed.client import preference

        return data_mod.Splits(train=preference.preference_examples(4000, seed=1),
                               validation=preference.preference_examples(500, seed=2),
                               test=preference.preference_examples(1000, seed=3))
    examples = data_mod.load_labelled(source, labels)
    n = len(examples)
    try:
        return data_mod.split(examples, validation=min(1000, n // 10), test=min(2000, n // 5))
    except ValueError as e:  # too few distinct sentences for a split
        raise data_mod.DataFormatError(f"{source}: {e}", "give more distinct examples") from e



def on_model_device(batch: dict[str, Any], model: Any) -> dict[str, Any]:
    """A tokenized batch (drawn on the CPU: the same ids everywhere) where the model's
    parameters are (the torch backend's `torch_device`)."""
    device = next(iter(model.parameters())).device
    if device.type == "cpu":
        return batch
    return {k: v.to(device) for k, v in batch.items()}


@_no_grad
def local_accuracy(bundle: ModelBundle, examples: data_mod.Examples,
                   batch_size: int = 32) -> tuple[float, float]:
    """(accuracy, mean loss) of the model on labelled examples under the task's objective;
    (0, 0) for none. A classifier and a label-words LM: accuracy of the class prediction and
    mean cross-entropy per example; a next-token LM: next-word top-3 accuracy (the keyboard
    metric) and mean next-token loss per token (`next_token_scores` has perplexity and
    top-1)."""
    import torch
    from seedfed.client.objective_batches import task_batches
    from seedfed.shared.model.objectives import LabelWords, label_word_ids

    if len(examples) == 0:
        return 0.0, 0.0
    spec = bundle.spec
    if spec.objective.kind == "next_token":
        counts = next_token_scores(bundle, examples, batch_size)
        return counts.top3_accuracy, (counts.nll / counts.tokens if counts.tokens else 0.0)
    words = (LabelWords(label_word_ids(bundle.tokenizer, spec.objective))
             if spec.objective.kind == "label_words" else None)
    correct, loss_sum = 0, 0.0
    for start in range(0, len(examples), batch_size):
        sl = slice(start, start + batch_size)
        batch = on_model_device(task_batches(spec, bundle.tokenizer, examples.texts[sl],
                                             examples.labels[sl]), bundle.model)
        if words is not None:
            logits = words.logits(bundle.model, batch)
        else:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            logits = bundle.model(**inputs).logits.float()
        loss_sum += float(torch.nn.functional.cross_entropy(logits, batch["labels"],
                                                            reduction="sum"))
        correct += int((logits.argmax(-1) == batch["labels"]).sum())
    return correct / len(examples), loss_sum / len(examples)


@_no_grad
def next_token_scores(bundle: ModelBundle, examples: data_mod.Examples, batch_size: int = 32,
                      bias: Any = None) -> NextTokenCounts:
    """Perplexity and next-word top-1 / top-3 counts of a causal LM on the examples' texts;
    `bias` (a (V,) tensor, a personal part's) is added to every position's logits."""
    from seedfed.shared.model.objectives import NextTokenCounts, next_token_counts, word_starts

    counts = NextTokenCounts()
    starts = word_starts(bundle.tokenizer)
    for raw in data_mod.eval_batches(examples, bundle.tokenizer, batch_size,
                                     bundle.spec.max_seq_len):
        batch = on_model_device(data_mod.lm_targets(raw), bundle.model)
        logits = bundle.model(input_ids=batch["input_ids"],
                              attention_mask=batch.get("attention_mask")).logits
        if bias is not None:
            logits = logits.float() + bias.to(logits.device)
        counts.add(next_token_counts(logits, batch["labels"], starts))
    return counts
