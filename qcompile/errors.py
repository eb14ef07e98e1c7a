"""Error types that carry the command-line exit code they map to (design.md §8).

Every error a user can cause is one of these; the CLI prints ``str(err)`` as one line and exits with
``err.exit_code``. Anything else escaping is an internal error (exit 1).
"""

from __future__ import annotations


class QCompileError(Exception):
    """Base class: a user-facing error with a one-line message and an exit code."""

    exit_code = 1


class UsageError(QCompileError):
    """The command line asked for something that does not exist or does not fit together."""

    exit_code = 2


class NumericsError(QCompileError):
    """A numerical equivalence check failed."""

    exit_code = 3


class VerificationError(QCompileError):
    """The IR verifier found a malformed graph."""

    exit_code = 4


class CheckpointError(QCompileError):
    """Unreadable or malformed checkpoint, or a config that does not match the tensors."""

    exit_code = 65


def one_line(text: str) -> str:
    """Collapse whitespace so that a message always prints as a single line."""
    return " ".join(str(text).split())
