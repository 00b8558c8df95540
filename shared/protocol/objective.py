"""What a task's loss is: a classifier's head, label words through a causal LM's head, or
next-token language modelling on the device's own text.

- `head` (every `seq_cls` task): cross-entropy of the classification head's logits.
- `label_words` (a causal LM on labelled data; MeZO / LM-BFF's prompt objective): each example
  is put into `template` (its `{text}` replaced by the sentence) and the model reads the
  logits of its LM head at the last prompt token; the loss is the cross-entropy over the label
  words' logits only (label k -> `words[k]`, the first token of " word"), the prediction their
  argmax. The task is phrased as the model's own next-token objective, so no new head exists.
- `next_token` (a causal LM on text): mean next-token cross-entropy over the device's text;
  scored by perplexity and next-word top-1 / top-3 accuracy (the keyboard metric).

The objective changes what a device's forward computes, never the wire or replay: a device
still uploads one scalar per seed, and the coordinator rebuilds the model from seeds alone.
The math is `seedfed.shared.model.objectives` (torch); this module is the definition both sides
validate and store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from seedfed.shared.protocol.ranges import check_names, help_of

ObjectiveKind = Literal["head", "label_words", "next_token"]
OBJECTIVES: tuple[str, ...] = ("head", "label_words", "next_token")
#: MeZO's SST-2 prompt (LM-BFF): "<sentence> It was great".
DEFAULT_TEMPLATE = "{text} It was"
#: MeZO's SST-2 verbalizer, the label words of a two-class task that names none.
DEFAULT_WORDS: tuple[str, ...] = ("terrible", "great")
#: The placeholder a template puts the example's text in.
TEXT_FIELD = "{text}"
MAX_TEMPLATE_LEN = 1024


def default_kind(model_kind: str) -> str:
    """The objective a model kind trains unless the task says otherwise."""
    return "next_token" if model_kind == "causal_lm" else "head"


@dataclass(frozen=True)
class Objective:
    """A task's objective (module docstring). `kind` None: the model kind's default
    (`default_kind`), resolved by TaskSpec."""

    kind: ObjectiveKind | None = field(default=None, metadata={
        "help": "head (seq_cls), label_words or next_token (causal_lm); none: the model "
                "kind's default"})
    template: str = field(default=DEFAULT_TEMPLATE, metadata={
        "help": "label_words: the prompt, with {text} where the example goes; the label word "
                "follows it"})
    words: tuple[str, ...] = field(default=(), metadata={
        "help": "label_words: one word per label, in label order (default for two labels: "
                "terrible, great)"})

    @classmethod
    def help(cls) -> dict[str, str]:
        return help_of(cls)

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got "
                             f"{self.kind!r}")
        if not isinstance(self.template, str) or self.template.count(TEXT_FIELD) != 1:
            raise ValueError(f"objective template must hold {TEXT_FIELD} exactly once, got "
                             f"{self.template!r}")
        if len(self.template) > MAX_TEMPLATE_LEN:
            raise ValueError(f"objective template is longer than {MAX_TEMPLATE_LEN} characters")
        object.__setattr__(self, "words", tuple(self.words))
        check_names("objective.words", self.words)
        if any(not w.strip() for w in self.words):
            raise ValueError("objective words must not be blank")
        if len(set(self.words)) != len(self.words):
            raise ValueError(f"objective words must differ, got {list(self.words)}")

    def resolved(self, model_kind: str, num_labels: int) -> Objective:
        """The objective with its kind set and checked against the model kind and labels."""
        kind = self.kind or default_kind(model_kind)
        if model_kind == "seq_cls" and kind != "head":
            raise ValueError(f"objective {kind!r} needs a causal LM (model_kind causal_lm); a "
                             "seq_cls task trains its head")
        if model_kind == "causal_lm" and kind == "head":
            raise ValueError("a causal LM has no classification head: objective label_words "
                             "or next_token")
        if kind == "label_words":
            if num_labels < 2:
                raise ValueError(f"objective label_words needs num_labels >= 2, got "
                                 f"{num_labels}")
            if not self.words and num_labels != len(DEFAULT_WORDS):
                raise ValueError(f"objective label_words on {num_labels} labels needs "
                                 f"{num_labels} words (set objective.words)")
            if self.words and len(self.words) != num_labels:
                raise ValueError(f"{len(self.words)} label words for {num_labels} labels")
        return Objective(kind, self.template, self.words)  # type: ignore[arg-type]

    @property
    def label_words(self) -> tuple[str, ...]:
        """The words of a label_words objective (its own, else DEFAULT_WORDS)."""
        return self.words or DEFAULT_WORDS

    def prompt(self, text: str) -> str:
        """The example `text` in the template."""
        return self.template.replace(TEXT_FIELD, text)

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "template": self.template, "words": list(self.words)}
