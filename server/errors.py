"""Typed domain errors of the coordinator. The app maps them to HTTP statuses in one place
(`seedfed.server.app._STATUS`); the in-process facade raises them as is."""

from __future__ import annotations

from seedfed.shared.errors import SeedfedError


class CoordinatorError(SeedfedError):
    """Base of the coordinator's own errors."""


class NotFoundError(CoordinatorError, LookupError):
    """A task, device, round or version that does not exist."""


class AuthenticationError(CoordinatorError):
    """Missing, unknown or revoked credentials."""


class PermissionDeniedError(CoordinatorError):
    """Valid credentials that do not grant this action (e.g. a device of another task)."""


class ConflictError(CoordinatorError):
    """The request contradicts the current state (closed round, stale version, second upload)."""


class RoundClosedError(ConflictError):
    """The round is not open for uploads any more (aggregating, closed or expired)."""


class StaleVersionError(ConflictError):
    """An upload computed at a version other than the round's base version."""


class DuplicateUploadError(ConflictError):
    """A second, different upload from the same device in the same round."""


class EmptyRoundError(ConflictError):
    """Closing a round that received no upload."""


class MalformedRequestError(CoordinatorError, ValueError):
    """A body that is not even syntactically valid (broken JSON, missing binary headers)."""


class InvalidUploadError(CoordinatorError, ValueError):
    """An upload that parses but breaks the round's rules (shape, bound, task, round)."""


class InvalidTaskError(CoordinatorError, ValueError):
    """A task definition that cannot be served (bad spec, unknown format, missing model)."""


class PayloadTooLargeError(CoordinatorError):
    """A request body above the configured limit."""


class StoreError(CoordinatorError):
    """A model store file is missing or does not match the checksum the database recorded."""
