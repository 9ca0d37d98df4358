"""Engine room: the exceptions the outbox raises to its callers.

Every error a caller can fix (bad input, bad configuration) is an ``OutboxError`` with a message that
names the offending value, so a failed enqueue says what to change instead of surfacing a driver error.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Base class for errors raised by outbox_pipeline."""


class InvalidMessageError(OutboxError, ValueError):
    """A message cannot be stored: nothing was written."""


class ConfigurationError(OutboxError):
    """Configuration (environment variables, flags) is missing or malformed."""


class SchemaError(OutboxError):
    """The database schema is missing, too old, or cannot be migrated."""
