"""Typed errors of the protocol core. Each names the bad value so a caller can report it as is."""


class SeedfedError(Exception):
    """Base of every error seedfed raises on purpose."""


class UnknownScopeError(SeedfedError, ValueError):
    """A task asked for a trainable scope that no registered builder provides."""


class ScopeError(SeedfedError, ValueError):
    """A scope cannot be built on this model (no matching tensors, wrong dtype, ...)."""


class MissingTensorError(SeedfedError, KeyError):
    """A state or snapshot lacks a tensor the scope needs, or carries one it does not know."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "missing tensor"


class NonFiniteScalarError(SeedfedError, ValueError):
    """A projected gradient or coefficient is NaN or infinite."""


class ShapeError(SeedfedError, ValueError):
    """A scalar matrix does not have the shape the round plan fixes."""


class LogEntryMismatchError(SeedfedError, ValueError):
    """A log entry belongs to another task, or does not follow the state's version."""


class ChecksumMismatchError(SeedfedError, ValueError):
    """The trainable state after a replay does not hash to the checksum the log recorded."""


class WireFormatError(SeedfedError, ValueError):
    """Bytes or JSON on the wire do not follow the schema."""


class UserError(SeedfedError):
    """An error the user can fix: `what` went wrong, naming the file, URL or option, and `hint`,
    what to do. Command lines print it as one line (`seedfed.cli_errors`)."""

    def __init__(self, what: str, hint: str = "") -> None:
        super().__init__(f"{what}; {hint}" if hint else what)
        self.what, self.hint = what, hint
