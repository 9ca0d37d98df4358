"""What an operator does to a live outbox: dead letters, rewinds and lease releases, switching strategy, partition
upkeep. Each module: docs/architecture.md#operate."""

from . import dead_letters, maintenance, operations
from .dead_letters import DeadLetter, discard_dead_letters, list_dead_letters, malformed_among, retry_dead_letters
from .maintenance import (
    ARCHIVE_COLUMNS,
    BINARY_COLUMNS,
    CHECKSUM_COLUMNS,
    NULL_TEXT,
    TIMESTAMP_COLUMNS,
    DropResult,
    Fingerprint,
    check_relayed,
    create_ahead,
    day_partitions,
    default_rows_by_day,
    drop_partition,
    fetch_archive_rows,
    fingerprint,
    id_slices,
    move_default_rows,
)
from .operations import release_lease, replay_sent, rewind_partition
from .switch import switch_strategy

# maintenance.expired is used through its module; DEFAULT_PARTITION is the store's.
__all__ = [
    "ARCHIVE_COLUMNS",
    "BINARY_COLUMNS",
    "CHECKSUM_COLUMNS",
    "NULL_TEXT",
    "TIMESTAMP_COLUMNS",
    "DeadLetter",
    "DropResult",
    "Fingerprint",
    "check_relayed",
    "create_ahead",
    "day_partitions",
    "dead_letters",
    "default_rows_by_day",
    "discard_dead_letters",
    "drop_partition",
    "fetch_archive_rows",
    "fingerprint",
    "id_slices",
    "list_dead_letters",
    "maintenance",
    "malformed_among",
    "move_default_rows",
    "operations",
    "release_lease",
    "replay_sent",
    "retry_dead_letters",
    "rewind_partition",
    "switch_strategy",
]
