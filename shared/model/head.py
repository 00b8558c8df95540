"""A classifier's head: finding the Linear layer that produces the logits, and setting it to
prototypes, the features of each label's description (a model that separates the classes before
any training)."""

from __future__ import annotations

from typing import Any

import torch
from seedfed.shared.model.classifier import MeanPoolClassifier
from seedfed.shared.protocol.errors import ScopeError
from torch import nn

#: Logit scale of a prototype head on L2-normalized features (a cosine-similarity temperature).
PROTOTYPE_SCALE = 20.0
#: Separates alternative descriptions of one label in `TaskSpec.label_texts` ("bad|awful"):
#: the label's prototype is the mean of their embeddings.
ALTERNATIVES = "|"


def classifier_module(model: nn.Module) -> nn.Linear:
    """The final Linear layer producing class logits (BERT's `classifier`, Llama's `score`)."""
    for name in ("classifier", "score"):
        for mod_name, mod in model.named_modules():
            if mod_name.endswith(name) and isinstance(mod, nn.Linear) and "original_module" \
                    not in mod_name:
                return mod
    raise ScopeError(f"{type(model).__name__} has no classifier/score Linear head")


@torch.no_grad()
def label_features(model: nn.Module, tokenizer: Any, label_texts: tuple[str, ...],
                   ) -> torch.Tensor:
    """The feature the head sees for each label description (alternatives averaged)."""
    groups = [[t.strip() for t in text.split(ALTERNATIVES) if t.strip()] or [text]
              for text in label_texts]
    flat = [t for g in groups for t in g]
    enc = tokenizer(flat, padding=True, return_tensors="pt")
    enc = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask",
                                                 "token_type_ids")}
    if isinstance(model, MeanPoolClassifier):
        feats = model.embed(**enc)
    else:
        head = classifier_module(model)
        captured: list[torch.Tensor] = []
        handle = head.register_forward_hook(
            lambda _m, args, _o: captured.append(args[0].detach()))
        try:
            model(**enc)
        finally:
            handle.remove()
        feats = captured[-1]
    feats = feats.float()
    out, start = [], 0
    for g in groups:
        out.append(feats[start:start + len(g)].mean(dim=0))
        start += len(g)
    return torch.stack(out)


@torch.no_grad()
def init_prototype_head(model: nn.Module, tokenizer: Any, label_texts: tuple[str, ...],
                        scale: float = PROTOTYPE_SCALE) -> None:
    """Set each class row of the head to the centred, normalized feature of its description.

    ZO crawls from a random head (docs/accuracy.md, "Why each setting"); starting from
    prototypes gives a model that already separates the classes before any training.
    Centring removes the direction all descriptions share, so logits differ only along what
    tells labels apart.
    """
    head = classifier_module(model)
    feats = label_features(model, tokenizer, label_texts)
    feats = feats - feats.mean(dim=0, keepdim=True)
    feats = feats / feats.norm(dim=1, keepdim=True).clamp_min(1e-8)
    head.weight.copy_(scale * feats)
    if head.bias is not None:
        head.bias.zero_()
