"""What the wal relay holds between the stream and Kafka: the batch and the commits between its messages, so it confirms
to the slot only whole transactions Kafka has. See docs/wal.md#the-relay."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...model import OutboxRecord


@dataclass
class Batch:
    """What arrived and is not confirmed: records in stream order, and the commits between them."""

    records: list[OutboxRecord]
    commits: list[tuple[int, int]]  # (records before this commit's end, the commit's end LSN)

    def confirmable(self, done: int) -> int | None:
        """The end LSN of the last commit whose records (the first ``done``) are delivered, dead-lettered or held."""
        lsn = None
        for count, end in self.commits:
            if count > done:
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

    def drop(self, done: int) -> None:
        """Forget the first ``done`` records and the commits they complete."""
        self.records = self.records[done:]
        self.commits = [(count - done, end) for count, end in self.commits if count > done]
