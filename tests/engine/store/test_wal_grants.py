"""Who may publish through a wal outbox (issue 50, case 2): pg_logical_emit_message is executable by PUBLIC as
PostgreSQL ships it, so any login could emit under ``outbox:<schema>`` and the relay would publish it. After
``init-db --strategy wal`` only a role with the writer's grant (docs/wal.md, Writers) emits, by every form; any
other is refused by every form, and nothing it tried reaches Kafka."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.store import init_db
from outbox_pipeline.store.wal import format as wal_format
from outbox_pipeline.store.wal.objects import names_of
from tests.engine.store.test_writer_isolation import WRITER_GRANTS
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import make_wal_relay

# What a wal outbox's writer is granted besides a table writer's (docs/wal.md, Writers; docs/operations.md).
WAL_WRITER_GRANT = "GRANT EXECUTE ON FUNCTION {enqueue}, {emit_one}, {emit_many} TO {role}"


@dataclass(frozen=True)
class Roles:
    writer: str  # a DSN with the writer's grants
    reader: str  # a DSN of a role that may read the outbox (USAGE, SELECT), and nothing more


def _role(db: psycopg.Connection, made: list[sql.Identifier], prefix: str) -> tuple[sql.Identifier, str]:
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    role = sql.Identifier(name)
    db.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER").format(role))
    made.append(role)
    return role, make_conninfo(db.info.dsn, user=name)


def grant_writer(db: psycopg.Connection, table: OutboxTable, role: sql.Identifier) -> None:
    names = {
        "schema": table.schema_ident,
        "messages": table.messages,
        "sequence": table.ident("outbox_messages_id_seq"),
        "topics": table.topics,
        "role": role,
        "enqueue": table.ident("enqueue"),
        "emit_one": table.ident("outbox_emit_one"),
        "emit_many": table.ident("outbox_emit_many"),
    }
    for grant in (*WRITER_GRANTS, WAL_WRITER_GRANT):
        db.execute(sql.SQL(grant).format(**names))


@pytest.fixture
def roles(db: psycopg.Connection, wal_outbox: OutboxTable) -> Iterator[Roles]:
    made: list[sql.Identifier] = []
    writer, writer_dsn = _role(db, made, "writer")
    grant_writer(db, wal_outbox, writer)
    reader, reader_dsn = _role(db, made, "reader")
    db.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(wal_outbox.schema_ident, reader))
    db.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(wal_outbox.schema_ident, reader))
    yield Roles(writer_dsn, reader_dsn)
    for role in made:
        db.execute(sql.SQL("DROP OWNED BY {}").format(role))
        db.execute(sql.SQL("DROP ROLE {}").format(role))


def forged(topic: str, payload: bytes) -> bytes:
    """A well-formed message of the outbox's layout, as an intruder would build it (format.py is public)."""
    return wal_format.encode(
        str(uuid.uuid4()).encode(),
        topic.encode(),
        b"acct-1",
        None,
        b'{"x-approved": "yes"}',
        payload,
        binary=False,
        partition=None,
    )


def every_form(table: OutboxTable, topic: str) -> dict[str, Callable[[psycopg.Connection], object]]:
    """Each way to emit under the outbox's prefix, as one call on a connection."""
    prefix = names_of(table).prefix
    payment = '{"pay": 1000000}'
    return {
        "pg_logical_emit_message, bytea": lambda c: c.execute(
            "SELECT pg_logical_emit_message(true, %s, %s::bytea)", (prefix, forged(topic, payment.encode()))
        ),
        "pg_logical_emit_message, text (malformed)": lambda c: c.execute(
            "SELECT pg_logical_emit_message(true, %s, 'not one of ours')", (prefix,)
        ),
        "SQL enqueue": lambda c: c.execute(
            sql.SQL("SELECT * FROM {}(%s, %s::jsonb, 'acct-1')").format(table.ident("enqueue")), (topic, payment)
        ),
        "outbox_emit_one": lambda c: c.execute(
            sql.SQL("SELECT {}(%s::bytea)").format(table.ident("outbox_emit_one")), (forged(topic, payment.encode()),)
        ),
        "outbox_emit_many": lambda c: c.execute(
            sql.SQL("SELECT * FROM {}(ARRAY[%s::bytea])").format(table.ident("outbox_emit_many")),
            (forged(topic, payment.encode()),),
        ),
        "outbox_emit": lambda c: c.execute(
            sql.SQL("SELECT {}(%s, %s::jsonb, 'acct-1', '{{}}', NULL, NULL, NULL, NULL, NULL)").format(
                table.ident("outbox_emit")
            ),
            (topic, payment),
        ),
        "plain INSERT": lambda c: c.execute(
            sql.SQL("INSERT INTO {} (topic, key, payload) VALUES (%s, 'acct-1', %s::jsonb)").format(table.messages),
            (topic, payment),
        ),
        "Python enqueue (one)": lambda c: enqueue(c, topic, {"pay": 1000000}, key="acct-1", table=table),
        "Python enqueue_many": lambda c: enqueue_many(
            c, [Message(topic, {"pay": n}, key="acct-1") for n in (1, 2)], table=table
        ),
    }


def try_every_form(dsn: str, table: OutboxTable, topic: str) -> dict[str, str]:
    """Each form, tried as the DSN's role in a transaction of its own: "committed" or "refused: <the error>"."""
    outcome = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for form, write in every_form(table, topic).items():
            try:
                with conn.transaction():
                    write(conn)
                outcome[form] = "committed"
            except psycopg.errors.InsufficientPrivilege as exc:
                outcome[form] = f"refused: {str(exc).strip()}"
    return outcome


def _refused_everywhere(outcome: dict[str, str]) -> bool:
    return all(why.startswith("refused: permission denied for") for why in outcome.values())


def _dead_letters(db: psycopg.Connection, table: OutboxTable) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.dead_letters)).fetchone()
    return int(row[0]) if row else -1


def test_a_role_without_the_writers_grant_is_refused_by_every_form_and_nothing_it_tried_is_published(
    db: psycopg.Connection, wal_outbox: OutboxTable, roles: Roles, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("payments")
    outcome = try_every_form(roles.reader, wal_outbox, topic)
    enqueue(db, topic, {"genuine": True}, key="acct-1", table=wal_outbox)  # a real payment of the same key, after

    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == [b'{"genuine": true}'], outcome
    assert _dead_letters(db, wal_outbox) == 0
    assert _refused_everywhere(outcome), outcome


def test_a_role_with_the_writers_grant_writes_by_every_form_and_the_relay_publishes_it_all(
    db: psycopg.Connection, wal_outbox: OutboxTable, roles: Roles, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("payments")
    with psycopg.connect(roles.writer) as writer:
        enqueue(writer, topic, {"n": 1}, key="k", table=wal_outbox)
        enqueue_many(writer, [Message(topic, {"n": n}, key="k") for n in (2, 3)], table=wal_outbox)
        writer.execute(
            sql.SQL("SELECT * FROM {}(%s, '{{\"n\": 4}}', 'k')").format(wal_outbox.ident("enqueue")), (topic,)
        )
        writer.execute(
            sql.SQL("INSERT INTO {} (topic, key, payload) VALUES (%s, 'k', '{{\"n\": 5}}')").format(
                wal_outbox.messages
            ),
            (topic,),
        )
        writer.commit()

    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == [b'{"n": %d}' % n for n in range(1, 6)]


def _outbox_cli(capsys: pytest.CaptureFixture[str], dsn: str, table: OutboxTable, *command: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main([*command, "--dsn", dsn, "--schema", table.schema])
    out = capsys.readouterr()
    return code, out.out + out.err


def _as_made_before_issue_50(db: psycopg.Connection, table: OutboxTable) -> None:
    """The grants a wal outbox had before: its functions run as their caller and are PUBLIC's, and so is
    pg_logical_emit_message (PostgreSQL's default)."""
    for name in ("enqueue", "outbox_emit_one", "outbox_emit_many", "outbox_emit_row"):
        db.execute(sql.SQL("ALTER FUNCTION {} SECURITY INVOKER RESET ALL").format(table.ident(name)))
    for name in ("enqueue", "outbox_emit_one", "outbox_emit_many", "outbox_emit_row", "outbox_emit", "wal_content"):
        db.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {} TO PUBLIC").format(table.ident(name)))
    for (overload,) in db.execute(
        "SELECT p.oid::regprocedure::text FROM pg_proc p WHERE p.proname = 'pg_logical_emit_message'"
    ).fetchall():
        db.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {} TO PUBLIC").format(sql.SQL(overload)))


def test_init_db_again_closes_a_wal_outbox_made_before_the_grants(
    db: psycopg.Connection,
    wal_outbox: OutboxTable,
    roles: Roles,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _as_made_before_issue_50(db, wal_outbox)
    topic = new_topic("payments")
    with psycopg.connect(roles.reader, autocommit=True) as reader:
        every_form(wal_outbox, topic)["SQL enqueue"](reader)  # the hole, as it was
    assert "EXPOSED" in _outbox_cli(capsys, db.info.dsn, wal_outbox, "status")[1]
    assert json.loads(_outbox_cli(capsys, db.info.dsn, wal_outbox, "status", "--json")[1])["exposed"]

    code, said = _outbox_cli(capsys, db.info.dsn, wal_outbox, "init-db", "--strategy", "wal")

    assert code == 0 and "EXPOSED" not in said, said
    assert "EXPOSED" not in _outbox_cli(capsys, db.info.dsn, wal_outbox, "status")[1]
    assert json.loads(_outbox_cli(capsys, db.info.dsn, wal_outbox, "status", "--json")[1])["exposed"] is None
    outcome = try_every_form(roles.reader, wal_outbox, topic)
    assert _refused_everywhere(outcome), outcome
    with psycopg.connect(roles.writer, autocommit=True) as writer:  # granted before init-db ran again
        for form in ("SQL enqueue", "plain INSERT", "Python enqueue (one)"):
            every_form(wal_outbox, topic)[form](writer)
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()
    assert [r.value for r in kafka.consume(topic)] == [b'{"pay": 1000000}'] * 4  # the hole's, then the writer's


@dataclass(frozen=True)
class Database:
    admin: str  # a superuser's DSN in it
    owner: str  # a DSN of a role that may create in it and stream (no superuser): init-db's role there
    roles: list[sql.Identifier]
    server: psycopg.Connection

    def role(self, prefix: str) -> tuple[sql.Identifier, str]:
        """A new login role (no grants) and its DSN in this database."""
        role, dsn = _role(self.server, self.roles, prefix)
        return role, make_conninfo(dsn, dbname=conninfo_to_dict(self.admin)["dbname"])


@pytest.fixture
def own_database(db: psycopg.Connection) -> Iterator[Database]:
    """A database of its own, as PostgreSQL makes it (pg_logical_emit_message executable by PUBLIC), and a role
    that may create in it and has REPLICATION, as on a managed service whose application role runs init-db."""
    name = f"grants_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    made: list[sql.Identifier] = []
    own = Database(make_conninfo(db.info.dsn, dbname=name), "", made, db)
    role, owner = own.role("owner")
    db.execute(sql.SQL("ALTER ROLE {} REPLICATION").format(role))
    db.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(name), role))
    yield Database(own.admin, owner, made, db)
    with psycopg.connect(own.admin, autocommit=True) as conn:
        for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"):
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    db.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
    for made_role in made:
        db.execute(sql.SQL("DROP ROLE {}").format(made_role))


def _statements(said: str) -> list[str]:
    """The SQL statements an outbox command told the operator to run, in its order."""
    return re.findall(r"(?:GRANT|REVOKE) EXECUTE ON FUNCTION [^;]+;", said)


def _run_as_superuser(dsn: str, statements: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement.encode())


def test_init_db_of_a_role_that_cannot_revoke_says_what_a_superuser_runs_and_status_shows_exposed_until_then(
    own_database: Database, kafka: KafkaProbe, new_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}", write_to="wal")
    code, said = _outbox_cli(capsys, own_database.owner, table, "init-db", "--strategy", "wal")
    assert code == 0 and "EXPOSED" in said and _statements(said), said
    assert "EXPOSED" in _outbox_cli(capsys, own_database.owner, table, "status")[1]

    _run_as_superuser(own_database.admin, _statements(said))  # the advice, followed as printed

    assert "EXPOSED" not in _outbox_cli(capsys, own_database.owner, table, "status")[1]
    topic = new_topic("payments")
    _, intruder = own_database.role("intruder")
    with psycopg.connect(intruder, autocommit=True) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        every_form(table, topic)["pg_logical_emit_message, bytea"](conn)
    writer, writer_dsn = own_database.role("writer")
    with psycopg.connect(own_database.admin, autocommit=True) as conn:
        grant_writer(conn, table, writer)
    with psycopg.connect(writer_dsn, autocommit=True) as conn:
        enqueue(conn, topic, {"n": 1}, key="k", table=table)  # runs as the outbox's owner, granted by the advice
    make_wal_relay(own_database.owner, table, kafka.bootstrap_servers).run()
    assert [r.value for r in kafka.consume(topic)] == [b'{"n": 1}']


def test_init_db_refuses_a_role_that_may_not_emit_and_says_which_grant_it_needs(
    own_database: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(own_database.admin, autocommit=True) as conn:
        init_db(conn, OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}"), strategies=["wal"])  # a superuser's outbox
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}", write_to="wal")

    code, said = _outbox_cli(capsys, own_database.owner, table, "init-db", "--strategy", "wal")

    assert code == 2 and "nothing was created" in said and len(_statements(said)) == 1, said
    with psycopg.connect(own_database.admin, autocommit=True) as conn:
        assert conn.execute("SELECT to_regnamespace(%s)", (table.schema,)).fetchone() == (None,)
    _run_as_superuser(own_database.admin, _statements(said))
    code, said = _outbox_cli(capsys, own_database.owner, table, "init-db", "--strategy", "wal")
    assert code == 0 and "EXPOSED" not in said, said
