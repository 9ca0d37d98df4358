"""The operator's paths around a wal outbox (issue 50): a switch to or from wal is refused before it changes anything,
a refused `init-db --strategy wal` leaves no slot behind, a slot left behind is reported, a prepared transaction that
holds init-db up is named, and `dead-letters retry --all` retries what it can. Every refusal's advice is followed here,
step by step, and works."""

from __future__ import annotations

import re
import shlex
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable, enqueue
from outbox_pipeline.cli import main
from outbox_pipeline.errors import OutboxError, SchemaError
from outbox_pipeline.operate import switch_strategy
from outbox_pipeline.store import init_db, strategy_record
from outbox_pipeline.store.wal import objects as wal_objects
from outbox_pipeline.store.wal.objects import drop_slot, names_of
from outbox_pipeline.store.wal.slot import slot_state
from tests.engine.store.test_wal_writers import emitted
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import make_wal_relay


@pytest.fixture
def new_schema(dsn: str) -> Iterator[OutboxTable]:
    """The schema an operator names when the advice says to make an outbox in a schema of its own (dropped after)."""
    table = OutboxTable(schema=f"n_{uuid.uuid4().hex[:12]}")
    yield table
    with psycopg.connect(dsn, autocommit=True) as conn:
        drop_slot(conn, table)
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(table.schema_ident))


@pytest.fixture
def locking_outbox(dsn: str, table: OutboxTable) -> Iterator[OutboxTable]:
    """A table outbox that records `locking` (init-db --strategy locking); any slot of its name dropped after."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        init_db(conn, table, strategies=["locking"])
    yield table
    with psycopg.connect(dsn, autocommit=True) as conn:
        drop_slot(conn, table)


def _quoted(text: str, starting: str) -> list[str]:
    """The `...` spans of an operator message that start with ``starting``: the commands it asks to run."""
    return [span for span in re.findall(r"`([^`]+)`", text) if span.startswith(starting)]


def _run_sql_advice(dsn: str, text: str) -> None:
    """Runs the SQL an operator message gives, as the operator would paste it into psql."""
    [statement] = _quoted(text, "SELECT pg_drop_replication_slot")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for part in statement.split(";"):
            if part.strip():
                conn.execute(part)


def _cli(capsys: pytest.CaptureFixture[str], dsn: str, *argv: str) -> tuple[int, str]:
    code = main([*argv, "--dsn", dsn])
    out = capsys.readouterr()
    return code, out.out + out.err


# -- case 1: switch-strategy on a wal outbox ---------------------------------------------------------------------


def test_a_switch_from_wal_is_refused_and_the_outbox_stays_a_wal_outbox_that_publishes(
    capsys: pytest.CaptureFixture[str], dsn: str, db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    """On main the switch (after `outbox indexes`, as its procedure says) went through: the trigger stayed, every
    later write was stored nowhere, the relay of the new strategy published nothing and the slot kept the WAL."""
    assert _cli(capsys, dsn, "indexes", "--strategy", "locking", "--schema", wal_outbox.schema)[0] == 0
    with pytest.raises(OutboxError, match="is a wal outbox") as refused:
        switch_strategy(db, wal_outbox, "locking")

    assert "nothing was changed" in str(refused.value)
    found = strategy_record.recorded(db, wal_outbox)
    assert found is not None and found.strategy == "wal"
    with db.transaction():
        enqueue(db, "orders", {"n": 1}, key="k", table=wal_outbox)
    assert [m.payload for m in emitted(db, wal_outbox)] == [b'{"n": 1}']


def test_the_switch_from_wal_refusal_s_advice_works_when_followed(
    capsys: pytest.CaptureFixture[str], dsn: str, wal_outbox: OutboxTable, new_schema: OutboxTable
) -> None:
    """The advice: a table outbox in a schema of its own, then the old slot dropped once it is caught up."""
    assert _cli(capsys, dsn, "indexes", "--strategy", "locking", "--schema", wal_outbox.schema)[0] == 0
    code, said = _cli(capsys, dsn, "switch-strategy", "--schema", wal_outbox.schema, "--to", "locking")
    assert code == 2 and "is a wal outbox" in said

    [make_new] = _quoted(said, "outbox init-db")
    argv = make_new.replace("<new schema>", new_schema.schema).split()[1:]
    assert _cli(capsys, dsn, *argv)[0] == 0
    code, lag = _cli(capsys, dsn, "lag", "--schema", wal_outbox.schema)
    assert code == 0 and "oldest unpublished commit 0.0 s" in lag
    _run_sql_advice(dsn, said)

    with psycopg.connect(dsn, autocommit=True) as conn:
        found = strategy_record.recorded(conn, new_schema)
        assert found is not None and found.strategy == "locking"
        assert not slot_state(conn, wal_outbox).exists


def test_a_switch_to_wal_is_refused_with_a_message_and_changes_nothing(
    capsys: pytest.CaptureFixture[str], dsn: str, locking_outbox: OutboxTable
) -> None:
    """On main argparse refused `--to wal` with a usage line; the engine took it."""
    code, said = _cli(capsys, dsn, "switch-strategy", "--schema", locking_outbox.schema, "--to", "wal")

    assert code == 2 and "outbox init-db --schema <new schema> --strategy wal" in said
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = strategy_record.recorded(conn, locking_outbox)
        assert found is not None and found.strategy == "locking"
        assert not slot_state(conn, locking_outbox).exists


# -- case 5: a refused init-db --strategy wal, and a slot left behind ----------------------------------------------


def test_a_refused_init_db_wal_on_a_table_outbox_makes_no_slot_and_no_publication(
    db: psycopg.Connection, locking_outbox: OutboxTable
) -> None:
    """On main the slot and the publication were made before the refusal, and the slot retained WAL unreported."""
    with pytest.raises(OutboxError, match="relayed by locking"):
        init_db(db, locking_outbox, strategies=["wal"])

    names = names_of(locking_outbox)
    slots = db.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (names.slot,)).fetchall()
    publications = db.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (names.publication,)).fetchall()
    assert (slots, publications) == ([], [])


def test_the_refused_init_db_wal_s_advice_works_step_by_step(
    capsys: pytest.CaptureFixture[str], dsn: str, locking_outbox: OutboxTable, new_schema: OutboxTable
) -> None:
    """On main the refusal said to run `outbox switch-strategy --to wal`, which argparse refused."""
    code, said = _cli(capsys, dsn, "init-db", "--schema", locking_outbox.schema, "--strategy", "wal")
    assert code == 2 and "nothing was created" in said

    for command in _quoted(said, "outbox "):
        argv = command.replace("<new schema>", new_schema.schema).split()[1:]
        assert _cli(capsys, dsn, *argv)[0] == 0, command

    with psycopg.connect(dsn, autocommit=True) as conn:
        assert slot_state(conn, new_schema).exists
        found = strategy_record.recorded(conn, locking_outbox)
        assert found is not None and found.strategy == "locking"


@pytest.mark.parametrize("command", ["status", "lag"])
def test_a_slot_of_the_outbox_s_name_on_a_table_outbox_is_reported_with_how_to_drop_it(
    capsys: pytest.CaptureFixture[str], dsn: str, locking_outbox: OutboxTable, command: str
) -> None:
    """What a refused init-db left on main: the slot retains WAL, and status and lag said nothing of it."""
    names = names_of(locking_outbox)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (names.slot,))
        conn.execute(sql.SQL("CREATE PUBLICATION {}").format(sql.Identifier(names.publication)))

    code, said = _cli(capsys, dsn, command, "--schema", locking_outbox.schema)
    assert code == 0 and f"replication slot {names.slot!r}" in said and "retains" in said

    _run_sql_advice(dsn, said)
    code, said = _cli(capsys, dsn, command, "--schema", locking_outbox.schema)
    assert code == 0 and names.slot not in said


# -- case 11: a prepared transaction holds init-db up ---------------------------------------------------------------


def test_a_prepared_transaction_holding_init_db_up_is_named_and_the_rerun_after_it_makes_the_outbox(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL makes a slot once every running transaction has ended, a prepared one too, which no session shows:
    on main init-db said "none is left now (try again)", and trying again failed the same way."""
    monkeypatch.setattr(wal_objects, "SLOT_CREATE_TIMEOUT_S", 1)
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}", write_to="wal")
    gid = f"payment-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute("SELECT pg_current_xact_id()")
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        try:
            with pytest.raises(SchemaError) as refused:
                init_db(conn, table, strategies=["wal"])
            said = str(refused.value)
            user = conn.execute("SELECT current_user").fetchone()
            assert gid in said and f"owner {user[0] if user else '?'}" in said and conn.info.dbname in said
            assert "COMMIT PREPARED" in said and "ROLLBACK PREPARED" in said
            [rollback] = _quoted(said, "ROLLBACK PREPARED")
            conn.execute(rollback)  # the operator's choice of the two
            init_db(conn, table, strategies=["wal"])  # and the rerun the message asks for
            assert slot_state(conn, table).exists
        finally:
            if conn.execute("SELECT 1 FROM pg_prepared_xacts WHERE gid = %s", (gid,)).fetchone():
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            drop_slot(conn, table)
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(table.schema_ident))


# -- case 11: dead-letters retry --all with a malformed dead letter ------------------------------------------------

SMALL = {"message.max.bytes": 2000}  # a 5,000-byte message is one Kafka will never take


def test_retry_all_retries_the_others_and_says_why_a_malformed_dead_letter_cannot_be_retried(
    capsys: pytest.CaptureFixture[str],
    dsn: str,
    db: psycopg.Connection,
    wal_outbox: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    """On main `retry --all` retried nothing (the malformed copy failed the topic check) and printed a traceback."""
    topic = new_topic("wal")
    with db.transaction():
        enqueue(db, topic, {"pad": "x" * 5000}, key="b", table=wal_outbox)
        db.execute("SELECT pg_logical_emit_message(true, %s, 'not ours'::bytea)", (names_of(wal_outbox).prefix,))
    make_wal_relay(dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()
    letters = sql.SQL("SELECT topic, id FROM {}").format(wal_outbox.dead_letters)
    by_topic: dict[str, int] = dict(db.execute(letters).fetchall())
    assert sorted(by_topic) == sorted([topic, "(malformed)"])
    malformed = by_topic["(malformed)"]

    code, said = _cli(capsys, dsn, "dead-letters", "retry", "--all", "--schema", wal_outbox.schema)

    assert code == 3 and "retried 1 dead letters" in said and "Traceback" not in said
    assert f"id={malformed}" in said
    make_wal_relay(dsn, wal_outbox, kafka.bootstrap_servers).run()  # Kafka takes the retried one now
    assert [len(r.value or b"") > 5000 for r in kafka.consume(topic)] == [True]
    [discard] = _quoted(said, "outbox dead-letters discard")  # the advice, as the operator pastes it
    assert _cli(capsys, dsn, *shlex.split(discard)[1:], "--schema", wal_outbox.schema)[0] == 0
    assert _cli(capsys, dsn, "dead-letters", "retry", "--all", "--schema", wal_outbox.schema)[0] == 0
