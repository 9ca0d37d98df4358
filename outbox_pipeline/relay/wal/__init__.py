"""The wal strategy's relay: a logical slot's messages streamed to Kafka in commit order, one streamer per slot. Each
module: docs/architecture.md#relay; the design: docs/wal.md."""

from . import pgoutput
from .leader import FENCE_MARGIN_S, WAL_LEADER_LOCK_CLASS, LeaderSettings, SlotLeader
from .pgoutput import StreamEvent, decode_pgoutput, format_lsn, parse_lsn, pg_clock_us, standby_status
from .relay import WalRelay
from .stream import (
    DEFAULT_STATUS_INTERVAL_S,
    ReplicationStream,
    ReplicationStreamError,
    SlotInUseError,
    SlotNotFoundError,
)

# pgoutput's message kinds (Begin, Commit, Message, Other) are used through their module.
__all__ = [
    "DEFAULT_STATUS_INTERVAL_S",
    "FENCE_MARGIN_S",
    "WAL_LEADER_LOCK_CLASS",
    "LeaderSettings",
    "ReplicationStream",
    "ReplicationStreamError",
    "SlotInUseError",
    "SlotLeader",
    "SlotNotFoundError",
    "StreamEvent",
    "WalRelay",
    "decode_pgoutput",
    "format_lsn",
    "parse_lsn",
    "pg_clock_us",
    "pgoutput",
    "standby_status",
]
