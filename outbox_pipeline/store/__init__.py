"""The outbox in PostgreSQL: what a row is, how services write it, and the schema it lives in. The layers and each
module: docs/architecture.md#store."""

from . import indexes, schema, strategy_record, wal, wire_arrays
from .database_encoding import database_codec, unholdable
from .enqueue import Enqueued, Message, enqueue, enqueue_many
from .header_rules import RESERVED_HEADERS, UnencodableHeaders, decode_headers
from .indexes import INDEXES, indexes_for, require_indexes
from .migrations import (
    DEFAULT_DAYS_AHEAD,
    DEFAULT_TOPIC_ROW,
    DEFAULT_VIRTUAL_PARTITIONS,
    LATEST_VERSION,
    MIGRATIONS,
    notify_channel,
)
from .partition_counts import BEHIND_POSITION
from .record_headers import CloudEvents, Headers, RecordHeaders, cloud_events_from_env
from .record_size import WIDEST_ID, RecordLimit, record_bytes
from .relayable import keeps_positions, other_orders, require_relayable
from .routing import SERIALIZED_LOCK_CLASS
from .schema import (
    DEFAULT_PARTITION,
    current_version,
    ensure_partitions,
    init_db,
    move_into_own_partition,
    partition_name,
    require_current,
    set_topic_partitions,
)
from .strategy_record import BY_INIT_DB, BY_POSITIONS, StrategyMismatch
from .topic_names import TOPIC_CHECK_PATTERN, is_valid_topic
from .tracing import BatchSpan, start_batch_span

# Generic names (indexes.build, strategy_record.claim, messages.validate, ...) are used through their module.
__all__ = [
    "BEHIND_POSITION",
    "BY_INIT_DB",
    "BY_POSITIONS",
    "DEFAULT_DAYS_AHEAD",
    "DEFAULT_PARTITION",
    "DEFAULT_TOPIC_ROW",
    "DEFAULT_VIRTUAL_PARTITIONS",
    "INDEXES",
    "LATEST_VERSION",
    "MIGRATIONS",
    "RESERVED_HEADERS",
    "SERIALIZED_LOCK_CLASS",
    "TOPIC_CHECK_PATTERN",
    "WIDEST_ID",
    "BatchSpan",
    "CloudEvents",
    "Enqueued",
    "Headers",
    "Message",
    "RecordHeaders",
    "RecordLimit",
    "StrategyMismatch",
    "UnencodableHeaders",
    "cloud_events_from_env",
    "current_version",
    "database_codec",
    "decode_headers",
    "enqueue",
    "enqueue_many",
    "ensure_partitions",
    "indexes",
    "indexes_for",
    "init_db",
    "is_valid_topic",
    "keeps_positions",
    "move_into_own_partition",
    "notify_channel",
    "other_orders",
    "partition_name",
    "record_bytes",
    "require_current",
    "require_indexes",
    "require_relayable",
    "schema",
    "set_topic_partitions",
    "start_batch_span",
    "strategy_record",
    "unholdable",
    "wal",
    "wire_arrays",
]
