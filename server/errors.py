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


class RoundFullError(ConflictError):
    """An upload beyond the round's devices_per_round (the task's cap on participants)."""


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


class UnavailableError(CoordinatorError):
    """A dependency failed in a way that passes (database down or locked, model store disk
    full): 503 with a Retry-After, nothing half-written, the same request works once it is back."""


class DatabaseUnavailableError(UnavailableError):
    """The database refused or lost the connection, or stayed locked past the busy timeout."""


class StoreUnavailableError(UnavailableError):
    """The model store could not write a file (disk full, read-only, I/O error)."""
