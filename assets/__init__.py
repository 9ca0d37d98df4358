"""Dagster room: assets over the outbox (backlog observation; Spark drains and maintenance)."""

from .backlog import outbox_backlog

__all__ = ["outbox_backlog"]
