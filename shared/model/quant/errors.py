"""Typed errors of the quantized formats. Each names the bad value so a caller can report it."""

from __future__ import annotations

from seedfed.shared.protocol.errors import ChecksumMismatchError, SeedfedError


class QuantError(SeedfedError, ValueError):
    """Base of the errors raised while quantizing, saving or loading a quantized model."""


class NoQuantizableLayersError(QuantError):
    """The model has no nn.Linear layer left to quantize once the skipped ones are set aside."""


class GroupSizeError(QuantError):
    """A group size that the format cannot use, or that does not divide a layer's input
    dimension while padding is refused (`QuantConfig(pad=False)`)."""


class QuantFileError(QuantError):
    """A quantized file is truncated, not safetensors, or lacks what the format requires."""


class QuantChecksumError(QuantFileError, ChecksumMismatchError):
    """The tensors of a quantized file do not hash to the checksum recorded in its metadata."""
