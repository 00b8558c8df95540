"""Where a device's personal part has evidence, and where it should leave the shared model alone.

A personal part is trained on the device's own examples only, and a device's owner labels only
part of what the device will see (on the per-device-taste task: 3 of 6 topics). On inputs far
from anything the owner labelled, the personal part has learnt nothing about the owner, yet it
still moves the logits: measured on the taste task's validation fleets, a residual trained to
100% on a device's seen topics took its unseen topics from the shared model's 0.70 / 0.71 / 0.68
to 0.70 / 0.68 / 0.61 (docs/personalization.md, "The evidence gate"). The shared model, which
learnt those topics from the devices that did label them, is the better answer there.

The gate is a nearest-neighbour test in the head's feature space, with no parameter to tune:

- anchors: the L2-normalized features of the examples the personal part trained on in its last
  round (at most `MAX_ANCHORS`, an even stride through them);
- radius: the smallest, over the anchors, of an anchor's cosine similarity to its nearest other
  anchor -- how far apart the owner's own examples lie;
- an input is covered when its cosine similarity to its nearest anchor is at least the radius:
  it is as close to the owner's data as the owner's least typical example is to the rest.

A device whose examples are spread out (SST-2 sentences: radius ~0.23) covers nearly every
input, so a personal part that learnt the owner's class prior keeps applying everywhere; a
device whose examples form tight clusters (the taste task's topics: radius ~0.5-0.8) covers its
own clusters only. Uncovered inputs get the shared model's logits, unchanged.

The anchors are features the device computes anyway (the personal round's batch), kept in the
personal state beside the heads: never sent, like everything personal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

#: Anchors kept at most (the personal round's default batch: 16 steps x 32 examples). 512 x 384
#: float32 is 768 KiB, within the device's memory budget (docs/personalization.md).
MAX_ANCHORS = 512


@dataclass(frozen=True)
class EvidenceGate:
    """Anchors (N, H), L2-normalized, and the radius (cosine similarity) they define."""

    anchors: torch.Tensor
    radius: float

    def __post_init__(self) -> None:
        a = self.anchors
        if a.dtype != torch.float32 or a.dim() != 2 or a.shape[0] < 2 \
                or not bool(torch.isfinite(a).all()):
            raise ValueError("gate anchors must be >= 2 finite float32 rows")
        if not (math.isfinite(self.radius) and -1.0 <= self.radius <= 1.0):
            raise ValueError(f"gate radius must be a cosine similarity in [-1, 1], got "
                             f"{self.radius}")

    @classmethod
    def of(cls, feats: torch.Tensor) -> EvidenceGate | None:
        """The gate of the examples with these features, or None with fewer than two (no
        spread to measure: the personal part then applies everywhere)."""
        if feats.shape[0] > MAX_ANCHORS:
            feats = feats[torch.linspace(0, feats.shape[0] - 1, MAX_ANCHORS).long()]
        if feats.shape[0] < 2:
            return None
        anchors = nn.functional.normalize(feats.detach().float(), dim=-1).contiguous()
        sims = anchors @ anchors.T
        sims.fill_diagonal_(-math.inf)
        return cls(anchors, float(sims.max(dim=1).values.min()))

    def covers(self, feats: torch.Tensor) -> torch.Tensor:
        """(B,) bool: which inputs lie within the radius of some anchor."""
        unit = nn.functional.normalize(feats.float(), dim=-1)
        return (unit @ self.anchors.T).max(dim=1).values >= self.radius


def gated(personal: torch.Tensor, shared: torch.Tensor, gate: EvidenceGate | None,
          feats: torch.Tensor) -> torch.Tensor:
    """Personalized logits (B, L) where the gate covers the input, the shared model's elsewhere
    (everywhere personalized without a gate)."""
    if gate is None:
        return personal
    return torch.where(gate.covers(feats)[:, None], personal, shared)


__all__ = ["MAX_ANCHORS", "EvidenceGate", "gated"]
