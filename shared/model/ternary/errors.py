"""Typed errors of the packed-ternary format. Each names the bad value so a caller can report it."""

from __future__ import annotations

from seedfed.shared.protocol.errors import ChecksumMismatchError, SeedfedError


class TernaryFormatError(SeedfedError, ValueError):
    """A ternary file is truncated, not safetensors, holds invalid codes, or lacks a tensor."""


class TernaryChecksumError(TernaryFormatError, ChecksumMismatchError):
    """The tensors of a ternary file do not hash to the checksum recorded in its metadata."""
