"""The wal strategy's outbox, which keeps no rows: the messages writers emit, the slot and the SQL around it. Each
module: docs/architecture.md#store; the design: docs/wal.md."""

from . import format, grants, objects, position, refusals, slot
from .format import MALFORMED_TOPIC, NOT_RETRIABLE_TOPICS, UNSTORABLE_TOPIC, MalformedMessage, WalMessage
from .grants import emit_function
from .objects import WAL_SINCE_SERVER_VERSION, drop_by_hand, drop_slot, names_of, slot_holder
from .position import RECORD_WAL_BYTES, Recorded, gap_report
from .refusals import stored_rows, stored_rows_problem
from .slot import SlotState, SlotUnusable, require_streamable, slot_state, unusable_reason

# format.encode/decode/record and the like are used through their module.
__all__ = [
    "MALFORMED_TOPIC",
    "NOT_RETRIABLE_TOPICS",
    "RECORD_WAL_BYTES",
    "UNSTORABLE_TOPIC",
    "WAL_SINCE_SERVER_VERSION",
    "MalformedMessage",
    "Recorded",
    "SlotState",
    "SlotUnusable",
    "WalMessage",
    "drop_by_hand",
    "drop_slot",
    "emit_function",
    "format",
    "gap_report",
    "grants",
    "names_of",
    "objects",
    "position",
    "refusals",
    "require_streamable",
    "slot",
    "slot_holder",
    "slot_state",
    "stored_rows",
    "stored_rows_problem",
    "unusable_reason",
]
