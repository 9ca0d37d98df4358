"""Engine room (relay, wal): what the wal relay holds between the stream and Kafka: the batch, with the commits
between its messages (what may be confirmed once Kafka has them), and the positions it confirms to the slot."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ...strategies.base import OutboxRecord
from .stream import ReplicationStream

# The least time between two positions confirmed to the slot while messages flow (Confirms).
CONFIRM_INTERVAL_S = 0.05


@dataclass
class Batch:
    """What arrived and is not confirmed: records in stream order, and the commits between them."""

    records: list[OutboxRecord]
    commits: list[tuple[int, int]]  # (records before this commit's end, the commit's end LSN)

    def confirmable(self, settled: int) -> int | None:
        """The end LSN of the last commit whose records (the first ``settled``) are all settled."""
        lsn = None
        for count, end in self.commits:
            if count > settled:
                break
            lsn = end
        return lsn

    def withhold(self, held: Callable[[OutboxRecord], bool]) -> list[OutboxRecord]:
        """Take the records ``held`` says are held out of the batch (commits keep their places); returns them."""
        kept: list[OutboxRecord] = []
        taken: list[OutboxRecord] = []
        before = [0]  # kept records among the first i
        for record in self.records:
            (taken if held(record) else kept).append(record)
            before.append(len(kept))
        if taken:
            self.records = kept
            self.commits = [(before[count], end) for count, end in self.commits]
        return taken

    def drop(self, settled: int) -> None:
        """Forget the first ``settled`` records and the commits they complete."""
        self.records = self.records[settled:]
        self.commits = [(count - settled, end) for count, end in self.commits if count > settled]


class Confirms:
    """Positions confirmed to the slot at most every CONFIRM_INTERVAL_S under steady traffic (each is a message the
    walsender handles; 200 batches a second need not be 200 of them); the last one always goes before the relay waits,
    backs off or stops. A crash between two loses nothing: what comes again is at most that interval's messages."""

    def __init__(self, stream: ReplicationStream) -> None:
        self._stream = stream
        self._pending: int | None = None
        self._sent = 0
        self._due = 0.0

    def confirm(self, lsn: int) -> None:
        if lsn <= self._sent:
            return
        self._pending = lsn if self._pending is None else max(self._pending, lsn)
        if time.monotonic() >= self._due:
            self.flush()

    def flush(self) -> None:
        if self._pending is not None:
            self._stream.confirm(self._pending)
            self._sent, self._pending = self._pending, None
            self._due = time.monotonic() + CONFIRM_INTERVAL_S
