"""The exceptions the outbox raises to its callers: every error a caller can fix is an `OutboxError` that names the
offending value. See docs/payloads.md#a-payload-is-json-or-bytes."""

from __future__ import annotations


class OutboxError(Exception):
    """Base class for errors raised by outbox_pipeline."""


class InvalidMessageError(OutboxError, ValueError):
    """A message cannot be stored: nothing was written."""


class ConfigurationError(OutboxError):
    """Configuration (environment variables, flags) is missing or malformed."""


class SchemaError(OutboxError):
    """The database schema is missing, too old, or cannot be migrated."""
