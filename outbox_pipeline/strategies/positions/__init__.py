"""The position strategies' shared machinery (partitioned, serialized): one offsets row per partition, leased to one
worker, advanced by compare-and-set (docs/strategies.md). Each module: docs/architecture.md#strategies."""

from .discovery import Discovery
from .offsets import discover, partition_pairs
from .sharing import DEAL_INTERVAL_S, STEAL_AFTER_S, UNSCOPED_KIND, deal
from .strategy import PositionStrategy

__all__ = [
    "DEAL_INTERVAL_S",
    "STEAL_AFTER_S",
    "UNSCOPED_KIND",
    "Discovery",
    "PositionStrategy",
    "deal",
    "discover",
    "partition_pairs",
]
