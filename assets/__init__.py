"""Dagster room: assets over the outbox (backlog and lag check, per-partition relay; Spark drains, maintenance)."""

from .backlog import outbox_backlog, outbox_lag_slo
from .relay import relayed_outbox

__all__ = ["outbox_backlog", "outbox_lag_slo", "relayed_outbox"]
