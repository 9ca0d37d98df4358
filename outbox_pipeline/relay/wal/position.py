"""The positions the wal relay confirms to the slot and records in the outbox, so that neither a crash of PostgreSQL nor
a restored snapshot makes it skip or silently lose messages. See docs/wal.md#recorded-positions."""

from __future__ import annotations

import logging
import time

from ...config import OutboxTable
from ...store.wal import position
from ...store.wal.position import RECORD_WAL_BYTES, Recorded
from .leader import SlotLeader
from .stream import ReplicationStream, Resume

log = logging.getLogger(__name__)

#: The least time between two positions confirmed to the slot while messages flow (each is a message the walsender
#: handles; 200 batches a second need not be 200 of them).
CONFIRM_INTERVAL_S = 0.05
#: The least time between two positions recorded while positions move within the bound.
RECORD_INTERVAL_S = 1.0
#: The least time between two records while positions wait for a bound (a backlog caught up faster than the margin).
GATED_RECORD_S = 0.1
#: The margin of a bound: this many seconds of the pace since the last record.
MARGIN_S = 2.0


def resume_from(recorded: Recorded) -> Resume | None:
    """Where a stream starts when its server is the one that recorded (ReplicationStream.open checks)."""
    return None if recorded.system is None else Resume(recorded.system, recorded.timeline, recorded.lsn)


class RecordedConfirms:
    """Positions confirmed to the slot at most every CONFIRM_INTERVAL_S and never past the last recorded bound; the
    last one goes before the relay waits or backs off (past the bound: at its next turn, once recorded), and
    ``flush(final=True)`` records and confirms it at once (the relay stops, or its run is over)."""

    def __init__(self, stream: ReplicationStream, leader: SlotLeader, table: OutboxTable, recorded: Recorded) -> None:
        self._stream = stream
        self._leader = leader
        self._table = table
        same = (recorded.system, recorded.timeline) == stream.server
        self._recorded = recorded.lsn if same else 0
        self._bound = recorded.bound if same else 0  # confirmed no further (a record first)
        self._quiet = 0  # up to here, past the recorded position, is only the last record's own WAL
        self._recorded_at = 0.0
        self._margin = 0  # how far past the WAL's end a bound goes (MARGIN_S)
        self._sent = stream.confirmed
        self._pending: int | None = None
        self._confirm_due = 0.0
        if same and recorded.slot_confirmed is not None and recorded.slot_confirmed > recorded.bound:
            self._gap(recorded.lsn, recorded.slot_confirmed)

    def confirm(self, lsn: int) -> None:
        if lsn <= self._sent:
            return
        self._pending = lsn if self._pending is None else max(self._pending, lsn)
        if time.monotonic() >= self._confirm_due:
            self.flush()

    def flush(self, final: bool = False) -> None:
        pending = self._pending
        if pending is None:
            return
        now = time.monotonic()
        since = now - self._recorded_at
        moved = pending > max(self._recorded, self._quiet)  # not only the last record's own WAL
        if (pending > self._bound and since >= GATED_RECORD_S) or (moved and (final or since >= RECORD_INTERVAL_S)):
            self._record(pending, now)
        lsn = min(pending, self._bound)
        if lsn > self._sent:
            self._stream.confirm(lsn)
            self._sent = lsn
            self._confirm_due = now + CONFIRM_INTERVAL_S
        if pending <= self._bound:
            self._pending = None

    def _record(self, lsn: int, now: float) -> None:
        pace = (lsn - self._recorded) / max(now - self._recorded_at, GATED_RECORD_S)  # bytes a second
        # Doubling, up to the pace: a burst does not widen the bound at once, steady traffic does within a second.
        self._margin = min(2 * self._margin + RECORD_WAL_BYTES, int(pace * MARGIN_S)) if self._recorded else 0
        conn = self._leader.connection
        self._bound, self._quiet = position.record(conn, self._table, self._stream.server, lsn, self._margin)
        self._recorded, self._recorded_at = lsn, now

    def _gap(self, start: int, end: int) -> None:
        """The slot is past the last position a relay recorded: made again (or advanced by hand) since."""
        conn = self._leader.connection
        position.record_gap(conn, self._table, start, end)
        log.error("replication slot %s: %s", self._stream.slot, position.describe_gap(conn, self._table, start, end))
