"""The wal strategy's relay: the slot's messages to Kafka in commit order, confirmed to the slot only once Kafka has
them. See docs/wal.md#the-relay."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psycopg

from ...config import OutboxTable
from ...model import AckResult, OutboxRecord, PublishOutcome
from ...store.wal import position as wal_position
from ...store.wal.format import MalformedMessage
from ...store.wal.format import record as wal_record
from ...store.wal.objects import names_of
from ...store.wal.slot import require_streamable
from ...strategies.quarantine import OnPoison
from ..publisher import KafkaPublisher, PendingBatch
from ..relay_settings import Backoff, Pacer, RelaySettings
from ..stats import NullInstruments, RelayInstruments, RelayStats, database_error
from .batches import Batch
from .failures import is_dead_letter, malformed, progress_of
from .holds import WalHolds, dead_letters_not_confirmed
from .leader import FENCE_MARGIN_S, LeaderSettings, SlotLeader
from .pgoutput import Begin, Commit, Keepalive, Message
from .position import RecordedConfirms, resume_from
from .stream import DEFAULT_STATUS_INTERVAL_S, ReplicationStream, SlotInUseError

log = logging.getLogger(__name__)

# How often a relay with held keys looks for keys an operator released.
RELEASE_CHECK_INTERVAL_S = 1.0


# The longest wait for the stream when nothing is pending.
READ_TIMEOUT_S = 0.5


@dataclass
class _Streaming:
    """What streaming the slot carries from one read to the next."""

    stream: ReplicationStream
    leader: SlotLeader
    confirms: RecordedConfirms
    pacer: Pacer
    batch: Batch = field(default_factory=lambda: Batch([], []))
    in_flight: PendingBatch | None = None  # the one batch in Kafka; the stream is read while it is
    commit: str = "0"  # the transaction being read: its commit position (a record's transaction_id, holds.py)
    reached: int = 0  # the furthest position the server said it has sent


class WalRelay:
    """Streams the outbox's slot while it leads (leader.py), publishing with ``publisher``."""

    name = "wal"

    def __init__(
        self,
        dsn: str,
        table: OutboxTable,
        publisher: KafkaPublisher,
        settings: RelaySettings,
        stop: threading.Event | None = None,
        *,
        worker_id: str = "wal",
        on_poison: OnPoison = "quarantine",
        observer: Callable[[PublishOutcome], None] | None = None,
        instruments: RelayInstruments | None = None,
    ) -> None:
        self.dsn = dsn
        self.table = table
        self.publisher = publisher
        self.settings = settings
        self.stop = stop or threading.Event()
        self.worker_id = worker_id
        self.stats = RelayStats()
        self._names = names_of(table)
        self._prefix = self._names.prefix.encode()
        self.holds = WalHolds(table, on_poison, worker_id)
        self.observer = observer
        self.instruments = instruments or NullInstruments()  # /metrics and /healthz, as for the table relay
        self.registered = threading.Event()  # set while this relay streams the slot (a run's tag, a test's wait)
        self._backoff = Backoff(settings)
        self._releases_due = 0.0
        self._heartbeat_due = 0.0
        self._led_at = 0.0  # monotonic: when the last heartbeat was sent (no relay took over before that)
        self._dead: set[int] = set()  # dead letters the stream may send again (not confirmed past): never published

    @property
    def _until_idle(self) -> bool:
        """Stop once everything written before the stream opened is published (tests, drains)."""
        return self.settings.until_idle or self.settings.until_empty

    @property
    def _leader_settings(self) -> LeaderSettings:
        """A frozen predecessor's queue expires ``fence_s`` after it was taken over (leader.py)."""
        return LeaderSettings(
            poll_s=self.settings.wal_leader_poll_s,
            takeover_after_s=self.settings.wal_takeover_s,
            fence_s=self.publisher.message_timeout_s + FENCE_MARGIN_S,
        )

    def prepare(self) -> None:
        """Start the producer (the slot's lock is taken in ``run``)."""
        self.publisher.warm_up()

    def run(self) -> RelayStats:
        max_s = self.settings.max_seconds
        deadline = time.monotonic() + max_s if max_s else None
        leader = SlotLeader(self.dsn, self.table, self.stop, self._leader_settings)
        self.prepare()
        try:
            while self._running(deadline):
                try:
                    if not self._lead(leader, deadline) or self._stream(leader, deadline):
                        break
                except (psycopg.OperationalError, SlotInUseError) as exc:
                    self._database_down(exc, leader)
        finally:
            leader.release()
            self.publisher.close()  # as the table relay does: the run owns its publisher to the end
        return self.stats

    def _running(self, deadline: float | None) -> bool:
        return not self.stop.is_set() and (deadline is None or time.monotonic() < deadline)

    def _lead(self, leader: SlotLeader, deadline: float | None) -> bool:
        """Wait to be the slot's streamer; False when stopped or past ``max_seconds`` first (then say why)."""
        if not leader.acquire(deadline, self._alive):
            if not self.stop.is_set():
                self.stats.remaining = [
                    f"another relay streams the slot {self._names.slot}: this one waited for it until its --max-seconds"
                ]
            return False
        require_streamable(leader.connection, self.table)
        return True

    def _database_down(self, exc: psycopg.OperationalError | SlotInUseError, leader: SlotLeader) -> None:
        """Give up the lead and everything not yet in Kafka (the lock may be another relay's by now: none of it may
        follow theirs), then try again after a back-off."""
        reason = database_error(self.stats, self.instruments, exc)
        if isinstance(exc, SlotInUseError):  # a process the lock does not know of: wait for it
            log.warning("%s; trying again", reason)
        else:
            log.warning("database unavailable (%s); reconnecting", reason)
        self.publisher.purge()
        leader.release()
        self.stop.wait(self._backoff.next_s())

    def _stream(self, leader: SlotLeader, deadline: float | None) -> bool:
        try:
            return self._stream_slot(leader, deadline)
        finally:
            self.registered.clear()

    def _stream_slot(self, leader: SlotLeader, deadline: float | None) -> bool:
        """Stream until stopped (True: the run is over) or the stream breaks (an OperationalError)."""
        row = leader.connection.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
        idle_at = int(row[0]) if row and self._until_idle else None  # until_idle: the WAL to get past
        self.holds.load(leader.connection)
        self._dead = dead_letters_not_confirmed(leader.connection, self.table, self._names.slot)
        # Where Kafka has everything before, as the database remembers it (a crash, a restore: position.py).
        recorded = wal_position.read(leader.connection, self.table, self._names.slot)
        with ReplicationStream.open(
            self.dsn,
            self._names.slot,
            self._names.publication,
            status_interval_s=self._alive_every_s,
            resume=resume_from(recorded),
        ) as stream:
            log.info("streaming the slot %s", self._names.slot)
            self.registered.set()
            self._backoff.reset()
            confirms = RecordedConfirms(stream, leader, self.table, recorded)
            pacer = Pacer(self.settings.wal_linger_s, full_rows=1)
            return self._stream_events(_Streaming(stream, leader, confirms, pacer), deadline, idle_at)

    def _stream_events(self, s: _Streaming, deadline: float | None, idle_at: int | None) -> bool:
        """The stream's events, published in order. One batch at a time is in Kafka, and the stream is read while it
        is: a backlog's next batch is decoded while the producer sends the last one; steady traffic goes out once the
        linger has passed (the Pacer)."""
        while self._running(deadline):
            self._alive()
            self._heartbeat(s.leader)
            sending = len(s.in_flight.records) if s.in_flight is not None else 0
            events = s.stream.read(self._read_timeout(s))
            self._take(s, events)
            if events and self._gathering(s, sending):
                continue  # more is waiting: gather it (while Kafka works on what is out)
            if s.in_flight is not None and not self._finish_in_flight(s):
                continue  # Kafka is down: backed off, the rest is published again
            if s.batch.records:
                self._send(s)
            elif self._caught_up(s, idle_at):
                return True
        self._last_batch(s)
        return True

    def _read_timeout(self, s: _Streaming) -> float:
        """No wait with a batch in Kafka; the linger's rest while commits gather; else until the stream says more."""
        if s.in_flight is not None:
            return 0.0
        if s.batch.records:
            return max(0.0, s.pacer.pause_s())
        s.confirms.flush()  # before the relay waits: the slot holds nothing it need not
        return READ_TIMEOUT_S

    def _take(self, s: _Streaming, events: Sequence[object]) -> None:
        """The events read into the batch: our messages in commit order (a held key's to its hold), each
        transaction's end, and how far the server has sent."""
        records = s.batch.records
        prefix = self._prefix
        holds = self.holds
        held: list[OutboxRecord] = []
        for event in events:
            if type(event) is Message:
                if event.prefix == prefix and (record := self._record(event, s.commit, s.leader)) is not None:
                    (held if holds.keys and holds.holds(record) else records).append(record)
            elif type(event) is Begin:
                s.commit = str(event.final_lsn)
            elif type(event) is Commit:
                s.batch.commits.append((len(records), event.end_lsn))
                s.reached = max(s.reached, event.end_lsn)
            elif type(event) is Keepalive:
                s.reached = max(s.reached, event.wal_end)
                if not records and not s.batch.commits and s.in_flight is None:
                    s.confirms.confirm(event.wal_end)  # nothing of ours before it: the slot may move past it
        holds.keep(s.leader.connection, held)  # before the slot is confirmed past them

    def _gathering(self, s: _Streaming, sending: int) -> bool:
        """Whether to read again before anything else: the batch has room and Kafka has not settled the last one."""
        unsent = len(s.batch.records) - sending
        return unsent < self.settings.wal_batch_max and (s.in_flight is None or not self.publisher.settled())

    def _finish_in_flight(self, s: _Streaming) -> bool:
        """The batch in Kafka settled: the slot confirmed up to what Kafka took; False when the transport failed
        (after a back-off: what it did not take is published again)."""
        assert s.in_flight is not None
        done, down = self._finish(s.in_flight, s.stream, s.leader)
        s.in_flight = None
        if (lsn := s.batch.confirmable(done)) is not None:
            s.confirms.confirm(lsn)
        s.batch.drop(done)
        if self.holds.keys:  # a key held now: its messages not yet published wait in outbox_held
            self.holds.keep(s.leader.connection, s.batch.withhold(self.holds.holds))
        if down:
            s.confirms.flush()
            self._back_off(s.stream, s.leader)
            return False
        self._backoff.reset()
        self._release(s.stream, s.leader)
        return True

    def _send(self, s: _Streaming) -> None:
        """Hand the batch to Kafka once the linger has passed (the read waits it out) or it is full."""
        records, batch_max = s.batch.records, self.settings.wal_batch_max
        if len(records) < batch_max and s.pacer.pause_s() > 0:
            return
        whole = len(records) < batch_max  # all there was: the next batch waits out the linger
        s.pacer.claimed(time.monotonic(), min(len(records), batch_max), took_all=whole)
        s.in_flight = self._start(s.leader, records[:batch_max])

    def _caught_up(self, s: _Streaming, idle_at: int | None) -> bool:
        """Nothing unsent, nothing in Kafka: all the server sent is settled, up to its last keepalive too (a slot
        confirmed only to its last commit of ours would keep the WAL written since, for nothing). True: an
        ``until_idle`` run is done."""
        self._release(s.stream, s.leader)
        s.batch.commits.clear()
        if s.reached:
            s.confirms.confirm(s.reached)
        if idle_at is not None and s.reached >= idle_at:
            s.confirms.flush(final=True)
            return True
        return False

    def _last_batch(self, s: _Streaming) -> None:
        """Stopping: confirm what Kafka took."""
        if s.in_flight is not None:
            done, _ = self._finish(s.in_flight, s.stream, s.leader)
            if (lsn := s.batch.confirmable(done)) is not None:
                s.confirms.confirm(lsn)
        s.confirms.flush(final=True)

    def _finish(self, pending: PendingBatch, stream: ReplicationStream, leader: SlotLeader) -> tuple[int, bool]:
        """Wait for the batch; how many of its records from the first are done (delivered, dead-lettered or held),
        and whether the transport failed (the rest is published again). A broker that is down keeps the batch
        unsettled for up to message.timeout.ms: meanwhile the streamer goes on saying it is alive, to its walsender
        and on its session, or a waiting relay would take it for frozen (leader.py)."""
        records = pending.records
        self._wait_settled(stream, leader)
        outcome = self.publisher.finish(pending)
        dead = [f for f in outcome.failed if is_dead_letter(f)]
        self._count(pending, outcome, len(dead))
        if not outcome.failed:
            self.stats.acked += len(records)
            return len(records), False
        if dead:
            self.holds.dead_letter(leader.connection, dead)
        progress = progress_of(records, outcome, dead, self.holds.holds)
        self.stats.acked += progress.acked
        self.holds.keep(leader.connection, progress.withheld)
        return progress.done, progress.again

    def _count(self, pending: PendingBatch, outcome: PublishOutcome, dead: int) -> None:
        """A settled batch in the relay's counts, its observer and its instruments."""
        self.stats.batches += 1
        self.stats.claimed += len(pending.records)
        self.stats.published += len(outcome.delivered)
        self.stats.dead_lettered += dead
        self.stats.busy_s += time.monotonic() - pending.started
        if self.observer is not None:
            self.observer(outcome)
        self.instruments.acked_batch(
            time.monotonic() - pending.started,
            0.0,
            outcome,
            AckResult(acked=len(outcome.delivered), dead_lettered=dead),
        )

    def _wait_settled(self, stream: ReplicationStream, leader: SlotLeader) -> None:
        """Until the producer holds nothing unsettled, the streamer saying it is alive meanwhile (``_finish``)."""
        if not self.publisher.settled():
            slice_s = min(1.0, self._alive_every_s / 2)
            self.publisher.producer.flush(slice_s)  # the usual case: settled in milliseconds
            while not self.publisher.settled():
                stream.confirm(stream.confirmed)  # a status update (no new position)
                self._heartbeat(leader)
                self.publisher.producer.flush(slice_s)

    def _alive(self) -> None:
        """The loop turns and the database answers (the last statement or read did not raise): /healthz."""
        self.instruments.loop()
        self.instruments.database_ok()

    def _release(self, stream: ReplicationStream, leader: SlotLeader) -> None:
        """Publish the messages held behind keys an operator released, in order, and let those keys flow again (with
        no batch in Kafka: a released key's later messages are still held, and go after these). From the first one
        Kafka did not take, the key stays held: behind it as its new dead letter if Kafka refused it (holds.py),
        to be tried again if Kafka was down (meanwhile the streamer says it is alive, as in ``_finish``)."""
        now = time.monotonic()
        if not self.holds.keys or now < self._releases_due:
            return
        self._releases_due = now + RELEASE_CHECK_INTERVAL_S
        conn = leader.connection
        for topic, key in self.holds.released(conn):
            records = self.holds.held(conn, topic, key)
            pending = self._start(leader, records)
            self._wait_settled(stream, leader)
            outcome = self.publisher.finish(pending)
            self.stats.published += len(outcome.delivered)
            if self.observer is not None:
                self.observer(outcome)
            if not outcome.failed:
                self.stats.acked += len(records)
                self.holds.end(conn, topic, key, [r.id for r in records])
                log.info("key %r of %s released: %d held messages published", key, topic, len(records))
                continue
            failed = {f.record.id: f for f in outcome.failed}
            first = next(i for i, r in enumerate(records) if r.id in failed)
            stopped = failed[records[first].id]
            self.holds.published(conn, [r.id for r in records[:first]])
            self.stats.acked += first
            if is_dead_letter(stopped):
                self.holds.dead_letter_held(conn, stopped)
                self.stats.dead_lettered += 1
                continue
            log.warning(
                "%d of the %d messages held behind key %r of %s were not published (%s); trying again",
                len(records) - first,
                len(records),
                key,
                topic,
                stopped.error,
            )

    def _back_off(self, stream: ReplicationStream, leader: SlotLeader) -> None:
        """Wait before publishing again, answering the walsender meanwhile."""
        until = time.monotonic() + self._backoff.next_s()
        while not self.stop.is_set() and (left := until - time.monotonic()) > 0:
            stream.confirm(stream.confirmed)  # a status update: the walsender hears from its relay
            self._heartbeat(leader)
            self.stop.wait(min(left, 1.0))

    @property
    def _alive_every_s(self) -> float:
        """How often the streamer says it is alive: often enough that a waiting relay never takes it for frozen."""
        return min(DEFAULT_STATUS_INTERVAL_S, self.settings.wal_takeover_s / 3)

    def _heartbeat(self, leader: SlotLeader) -> None:
        """Its lock session's sign of life, which a waiting relay judges it by (leader.py)."""
        now = time.monotonic()
        if now >= self._heartbeat_due:
            leader.heartbeat()
            self._led_at = now
            self._heartbeat_due = now + self._alive_every_s

    def _start(self, leader: SlotLeader, records: Sequence[OutboxRecord]) -> PendingBatch:
        """Hand records to Kafka only within half the takeover time of a heartbeat: no relay can have taken over
        before then, and one that did waits until all of it has expired (leader.py). A relay frozen and thawed after
        that hands nothing over (publisher.py withdraws it)."""
        self._heartbeat(leader)
        return self.publisher.start(records, until=self._led_at + self.settings.wal_takeover_s / 2)

    def _record(self, event: Message, commit: str, leader: SlotLeader) -> OutboxRecord | None:
        """The record of a message under the outbox's prefix; None for one that is not to be published: a dead letter
        sent again, or bytes that are not a transactional outbox message (kept as a ``(malformed)`` dead letter)."""
        if self._dead and event.lsn in self._dead:
            return None  # dead-lettered before the stream broke: the operator's now, not the stream's
        if not event.transactional:  # emitted whatever its transaction did, outside the commit order
            self._malformed(event, str(event.lsn), "not transactional (emitted with transactional false)", leader)
            return None
        try:
            return wal_record(event.content, event.lsn, commit)
        except MalformedMessage as exc:
            self._malformed(event, commit, f"not an outbox message: {exc}", leader)
            return None

    def _malformed(self, event: Message, commit: str, error: str, leader: SlotLeader) -> None:
        """Bytes under our prefix another writer made: kept as a dead letter (payload_bytes), never published."""
        self.holds.dead_letter(leader.connection, [malformed(event, commit, error)])
        self.stats.dead_lettered += 1
