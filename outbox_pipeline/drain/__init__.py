"""The bulk drain's engine, which the Spark executors call: one frozen range per virtual partition, published with the
relay's publisher and committed at the end; it imports neither Spark nor Dagster. Each module:
docs/architecture.md#drain; the design: docs/spark.md."""

from .engine import (
    backlog_at_least,
    commit_drain,
    drain_leases,
    drainable,
    leases_kept,
    plan_drain,
    release_drain,
)
from .ranges import OWNERSHIP_CHECK_S, fetch_range, publish_range
from .values import (
    DEFAULT_FETCH_ROWS,
    DEFAULT_LEASE_S,
    DRAIN_STRATEGIES,
    OWNER_PREFIX,
    DeliveryError,
    DrainError,
    DrainOutcome,
    DrainPlan,
    LeaseLostError,
    RangeDelivery,
    RangeReport,
    drain_owner,
    no_drain,
)

__all__ = [
    "DEFAULT_FETCH_ROWS",
    "DEFAULT_LEASE_S",
    "DRAIN_STRATEGIES",
    "OWNERSHIP_CHECK_S",
    "OWNER_PREFIX",
    "DeliveryError",
    "DrainError",
    "DrainOutcome",
    "DrainPlan",
    "LeaseLostError",
    "RangeDelivery",
    "RangeReport",
    "backlog_at_least",
    "commit_drain",
    "drain_leases",
    "drain_owner",
    "drainable",
    "fetch_range",
    "leases_kept",
    "no_drain",
    "plan_drain",
    "publish_range",
    "release_drain",
]
