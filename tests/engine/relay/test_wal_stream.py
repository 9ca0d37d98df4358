"""The wal strategy's replication stream (relay/wal/stream.py, relay/wal/pgoutput.py): a logical slot streamed through
pgoutput delivers each committed transaction's messages, in commit order, from the slot's confirmed position."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_pipeline.relay.wal.pgoutput import (
    Begin,
    Commit,
    Message,
    Other,
    StreamEvent,
    decode_pgoutput,
    format_lsn,
    parse_lsn,
)
from outbox_pipeline.relay.wal.stream import (
    DEFAULT_STATUS_INTERVAL_S,
    ReplicationStream,
    SlotInUseError,
    SlotNotFoundError,
)
from tests.kit.probes import wait_until

PREFIX = "outbox"
DEADLINE_S = 30.0


@dataclass(frozen=True)
class Slot:
    name: str
    publication: str


@dataclass(frozen=True)
class Transaction:
    begin: Begin
    messages: list[Message]
    commit: Commit

    @property
    def contents(self) -> list[bytes]:
        return [m.content for m in self.messages]


@pytest.fixture
def slot(db: psycopg.Connection) -> Iterator[Slot]:
    """A fresh pgoutput slot and an empty publication, named with what quoting must carry (quotes, a backslash,
    capitals); the slot is dropped after the test (a slot left behind keeps WAL and the catalog horizon for every later
    test on the server)."""
    made = Slot(f"wal_{uuid.uuid4().hex[:10]}", f'Pub "{uuid.uuid4().hex[:10]}" \\x\'')
    db.execute(sql.SQL("CREATE PUBLICATION {}").format(sql.Identifier(made.publication)))
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (made.name,))
    yield made
    db.execute(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s AND active",
        (made.name,),
    )
    wait_until("the slot released", lambda: not _active(db, made), DEADLINE_S)
    db.execute("SELECT pg_drop_replication_slot(%s)", (made.name,))
    db.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(made.publication)))


@pytest.fixture
def open_stream(dsn: str, slot: Slot) -> Iterator[Callable[..., ReplicationStream]]:
    """Streams of the test's slot (``dsn`` overridable, e.g. with server settings), closed after the test."""
    opened: list[ReplicationStream] = []

    def open_one(on: str = dsn, status_interval_s: float = DEFAULT_STATUS_INTERVAL_S) -> ReplicationStream:
        stream = ReplicationStream.open(on, slot.name, slot.publication, status_interval_s=status_interval_s)
        opened.append(stream)
        return stream

    yield open_one
    for stream in opened:
        stream.close()


def _active(db: psycopg.Connection, slot: Slot) -> bool:
    row = db.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot.name,)).fetchone()
    assert row is not None, f"slot {slot.name} is gone"
    return bool(row[0])


def _emit(conn: psycopg.Connection, *contents: bytes) -> None:
    """One committed transaction emitting ``contents`` as transactional messages."""
    with conn.transaction():
        for content in contents:
            conn.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (PREFIX, content))


def _transactions(events: list[StreamEvent]) -> list[Transaction]:
    """The stream's transactions that carried messages, in the order they arrived; every message inside one."""
    found: list[Transaction] = []
    begin: Begin | None = None
    messages: list[Message] = []
    for event in events:
        if isinstance(event, Begin):
            assert begin is None, "a Begin inside a transaction"
            begin, messages = event, []
        elif isinstance(event, Message):
            assert begin is not None, f"a message outside a transaction: {event}"
            messages.append(event)
        elif isinstance(event, Commit):
            assert begin is not None, "a Commit without its Begin"
            if messages:
                found.append(Transaction(begin, messages, event))
            begin = None
    return found


def _read_transactions(stream: ReplicationStream, count: int) -> list[Transaction]:
    """Read until ``count`` transactions with messages have arrived (failing after DEADLINE_S)."""
    events: list[StreamEvent] = []

    def arrived() -> bool:
        events.extend(stream.read(0.2))
        return len(_transactions(events)) >= count

    wait_until(f"{count} transactions on the stream", arrived, DEADLINE_S, interval_s=0)
    return _transactions(events)


def _stay_idle(stream: ReplicationStream, seconds: float) -> None:
    """Read an idle stream for ``seconds`` (the stream's own replies are what is under test)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        stream.read(0.2)


# -- what arrives --------------------------------------------------------------------------------------------------


def test_a_committed_transactions_messages_arrive_between_its_begin_and_commit_with_their_bytes_unchanged(
    db: psycopg.Connection, open_stream: Callable[..., ReplicationStream]
) -> None:
    stream = open_stream()
    contents = [b"\xff\xfe\x00not utf-8\x80", b"", b'{"n": 1}']
    with db.transaction():
        row = db.execute("SELECT txid_current() % 4294967296").fetchone()
        assert row is not None
        xid = int(row[0])
        for content in contents:
            db.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (PREFIX, content))

    [transaction] = _read_transactions(stream, 1)

    assert transaction.contents == contents
    assert {(m.prefix, m.transactional) for m in transaction.messages} == {(PREFIX.encode(), True)}
    assert transaction.begin.xid == xid
    assert transaction.begin.final_lsn == transaction.commit.commit_lsn < transaction.commit.end_lsn


def test_a_rolled_back_transaction_emits_nothing(
    db: psycopg.Connection, open_stream: Callable[..., ReplicationStream]
) -> None:
    stream = open_stream()
    db.execute("BEGIN")
    db.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (PREFIX, b"rolled back"))
    db.execute("ROLLBACK")
    _emit(db, b"committed after")

    assert [t.contents for t in _read_transactions(stream, 1)] == [[b"committed after"]]


def test_transactions_arrive_in_commit_order_not_in_the_order_they_emitted(
    connect: Callable[[], psycopg.Connection], open_stream: Callable[..., ReplicationStream]
) -> None:
    stream = open_stream()
    a, b = connect(), connect()
    a.execute("BEGIN")
    a.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (PREFIX, b"A emits first"))
    b.execute("BEGIN")
    b.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (PREFIX, b"B emits second"))
    b.execute("COMMIT")
    a.execute("COMMIT")

    assert [t.contents for t in _read_transactions(stream, 2)] == [[b"B emits second"], [b"A emits first"]]


# -- where a stream starts -----------------------------------------------------------------------------------------


def test_a_stream_reopened_after_confirming_a_transaction_starts_after_it(
    db: psycopg.Connection, slot: Slot, open_stream: Callable[..., ReplicationStream]
) -> None:
    _emit(db, b"A")
    _emit(db, b"B")
    first = open_stream()
    a, _ = _read_transactions(first, 2)
    first.confirm(a.commit.end_lsn)
    first.close()
    wait_until("the first stream's slot released", lambda: not _active(db, slot), DEADLINE_S)

    again = open_stream()

    assert [t.contents for t in _read_transactions(again, 1)] == [[b"B"]]


def test_a_stream_reopened_without_a_confirm_gets_everything_again(
    db: psycopg.Connection, slot: Slot, open_stream: Callable[..., ReplicationStream]
) -> None:
    _emit(db, b"A")
    _emit(db, b"B")
    first = open_stream()
    assert [t.contents for t in _read_transactions(first, 2)] == [[b"A"], [b"B"]]
    first.close()
    wait_until("the first stream's slot released", lambda: not _active(db, slot), DEADLINE_S)

    again = open_stream()

    assert [t.contents for t in _read_transactions(again, 2)] == [[b"A"], [b"B"]]


def test_a_confirmed_position_reaches_the_slot_and_never_goes_back(
    db: psycopg.Connection, slot: Slot, open_stream: Callable[..., ReplicationStream]
) -> None:
    _emit(db, b"A")
    _emit(db, b"B")
    stream = open_stream()
    a, b = _read_transactions(stream, 2)

    stream.confirm(b.commit.end_lsn)
    stream.confirm(a.commit.end_lsn)

    assert stream.confirmed == b.commit.end_lsn

    def slot_confirmed() -> int:
        row = db.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot.name,)
        ).fetchone()
        assert row is not None
        return parse_lsn(row[0])

    wait_until("the slot at B's end", lambda: slot_confirmed() == b.commit.end_lsn, DEADLINE_S)


def test_the_publication_is_found_by_its_name_as_written(
    db: psycopg.Connection, open_stream: Callable[..., ReplicationStream]
) -> None:
    """pgoutput looks its publications up at the first row change in the database; PostgreSQL 14 to 17 end the stream
    there if one is missing (18 skips it), so a mangled name would end this stream on the 15."""
    stream = open_stream()
    table = sql.Identifier(f"rows_{uuid.uuid4().hex[:10]}")
    db.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(table))
    try:
        db.execute(sql.SQL("INSERT INTO {} VALUES (1)").format(table))
        _emit(db, b"after a row change")

        assert [t.contents for t in _read_transactions(stream, 1)] == [[b"after a row change"]]
    finally:
        db.execute(sql.SQL("DROP TABLE {}").format(table))


# -- who streams, and for how long ---------------------------------------------------------------------------------


def test_a_second_stream_on_an_active_slot_is_refused_naming_the_pid_that_holds_it(
    db: psycopg.Connection, slot: Slot, open_stream: Callable[..., ReplicationStream]
) -> None:
    open_stream()
    row = db.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot.name,)).fetchone()
    assert row is not None
    holder = row[0]

    with pytest.raises(SlotInUseError, match=f"PID {holder}") as refused:
        open_stream()
    assert refused.value.pid == holder


def test_a_missing_slot_is_refused_by_name(dsn: str, slot: Slot) -> None:
    with pytest.raises(SlotNotFoundError, match="'no_such_slot' does not exist"):
        ReplicationStream.open(dsn, "no_such_slot", slot.publication)


def _with_sender_timeout(dsn: str) -> str:
    """The DSN with wal_sender_timeout at 2 s for its connections (a user-settable setting since PostgreSQL 12)."""
    return make_conninfo(dsn, options="-c wal_sender_timeout=2s")


SENDER_TIMEOUT_S = 2.0


@pytest.mark.parametrize(
    "status_interval_s",
    [pytest.param(0.5, id="status-updates-at-its-interval"), pytest.param(3600.0, id="answers-to-the-servers-asks")],
)
def test_an_idle_stream_that_is_read_outlives_wal_sender_timeout(
    dsn: str, db: psycopg.Connection, open_stream: Callable[..., ReplicationStream], status_interval_s: float
) -> None:
    stream = open_stream(_with_sender_timeout(dsn), status_interval_s=status_interval_s)

    _stay_idle(stream, 3 * SENDER_TIMEOUT_S)
    _emit(db, b"still there")

    assert [t.contents for t in _read_transactions(stream, 1)] == [[b"still there"]]


def test_a_stream_left_unread_past_wal_sender_timeout_is_ended_by_the_server_and_read_raises_operational_error(
    dsn: str, db: psycopg.Connection, slot: Slot, open_stream: Callable[..., ReplicationStream]
) -> None:
    """The control for the test above: the short timeout does end a stream that sends nothing back."""
    stream = open_stream(_with_sender_timeout(dsn))
    wait_until("the server to end the silent stream", lambda: not _active(db, slot), DEADLINE_S)

    def read_on() -> bool:  # what arrived before the end comes first
        stream.read(0.2)
        return False

    with pytest.raises(psycopg.OperationalError, match=f"replication stream of slot '{slot.name}' is lost") as ended:
        wait_until("a read to raise", read_on, DEADLINE_S, interval_s=0)
    assert "server closed the connection" in str(ended.value)


def test_a_stream_whose_server_process_is_terminated_raises_operational_error_with_the_servers_reason(
    db: psycopg.Connection, slot: Slot, open_stream: Callable[..., ReplicationStream]
) -> None:
    stream = open_stream()
    db.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s", (slot.name,))

    def read_on() -> bool:
        stream.read(0.2)
        return False

    with pytest.raises(psycopg.OperationalError, match="administrator command") as ended:
        wait_until("a read to raise", read_on, DEADLINE_S, interval_s=0)
    assert f"slot '{slot.name}'" in str(ended.value)


# -- the wire format -----------------------------------------------------------------------------------------------


def test_an_lsn_reads_back_from_its_text_form() -> None:
    assert parse_lsn("16/B374D848") == 0x16_B374D848
    assert format_lsn(0x16_B374D848) == "16/B374D848"
    assert format_lsn(0) == "0/0"
    with pytest.raises(ValueError, match="not an LSN"):
        parse_lsn("16-B374D848")


def test_pgoutput_messages_the_relay_does_not_use_decode_as_other() -> None:
    relation = b"R" + bytes(4) + b"public\x00t\x00d" + bytes(2)
    assert decode_pgoutput(memoryview(relation)) == Other("R")
