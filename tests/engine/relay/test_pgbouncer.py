"""Behind a transaction-pooling PgBouncer a session advisory lock does not follow the client: each
transaction may run on another server connection. A worker connected that way must notice, register with
``expiry`` liveness, and have its leases freed only by expiry (never early by a reap, which would believe it
dead or alive by a lock it does not hold). Runs against a real PgBouncer (Debian's ``pgbouncer``; `make test`
installs it where it can), skipped with the reason where none is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox_pipeline import OutboxTable
from outbox_pipeline.localstack import free_port
from outbox_pipeline.observe import reap
from outbox_pipeline.relay import RelaySettings, WorkerPresence
from tests.kit.probes import lease_partition, wait_until

PGBOUNCER = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None)
pytestmark = pytest.mark.skipif(PGBOUNCER is None, reason="pgbouncer is not installed (apt-get install pgbouncer)")


@pytest.fixture
def pooled_dsn(dsn: str, tmp_path: Path) -> Iterator[str]:
    """A PgBouncer in transaction pooling mode in front of the test server, every other setting its default; its
    DSN."""
    server = conninfo_to_dict(dsn)
    port = free_port()
    tmp_path.chmod(0o777)  # PgBouncer refuses to run as root: it runs as nobody and writes here
    ini = tmp_path / "pgbouncer.ini"
    ini.write_text(
        f"""
[databases]
* = host={server["host"]} port={server["port"]}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {tmp_path / "users.txt"}
pool_mode = transaction
logfile = {tmp_path / "pgbouncer.log"}
pidfile = {tmp_path / "pgbouncer.pid"}
"""
    )
    (tmp_path / "users.txt").write_text(f'"{server["user"]}" ""\n')
    assert PGBOUNCER is not None  # the module is skipped without it
    command = [PGBOUNCER, str(ini)]
    if os.geteuid() == 0:
        command[1:1] = ["-u", "nobody"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pooled = make_conninfo("", host="127.0.0.1", port=str(port), user=server["user"], dbname=server["dbname"])
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                psycopg.connect(pooled, autocommit=True, prepare_threshold=None).close()
                break
            except psycopg.OperationalError:
                assert process.poll() is None, (tmp_path / "pgbouncer.log").read_text()
                assert time.monotonic() < deadline, "pgbouncer did not accept connections"
                time.sleep(0.1)
        yield pooled
    finally:
        process.terminate()
        process.wait(10)


def test_a_pooled_worker_whose_next_transaction_runs_elsewhere_falls_back_to_expiry(
    pooled_dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    """Its lock stayed on the server connection that took it; another client holds that one now, so the
    worker's next upkeep runs on another, finds it does not hold its lock, and registers as ``expiry``."""
    with (
        psycopg.connect(pooled_dsn, autocommit=True, prepare_threshold=None) as conn,
        psycopg.connect(pooled_dsn, prepare_threshold=None) as other,
    ):
        presence = WorkerPresence(conn, table, "pooled-1", "session")
        presence.register()
        other.execute("SELECT 1")  # takes the server connection just released (PgBouncer reuses it first)
        presence.upkeep()
        assert presence.liveness == "expiry"
        row = db.execute(sql.SQL("SELECT liveness FROM {} WHERE worker_id = 'pooled-1'").format(table.workers))
        assert row.fetchone() == ("expiry",)


def test_the_leases_of_a_pooled_worker_that_died_end_by_expiry_not_by_a_reap(
    pooled_dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    with psycopg.connect(pooled_dsn, autocommit=True, prepare_threshold=None) as conn:
        WorkerPresence(conn, table, "pooled-2", "session").register()
        lease_partition(db, table, "pooled-2")
    # The client is gone; PgBouncer keeps its server connections (and whatever lock one of them holds).
    assert reap(db, table).partitions == 0
    held = db.execute(sql.SQL("SELECT locked_by FROM {} WHERE topic = 't'").format(table.offsets)).fetchone()
    assert held == ("pooled-2",), "a reap freed the lease of a worker whose liveness it cannot know"


def test_a_direct_worker_that_died_is_reaped_at_once(dsn: str, db: psycopg.Connection, table: OutboxTable) -> None:
    """The contrast: the same, connected directly (session liveness): freed by the next reap."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert WorkerPresence(conn, table, "direct-1", "session").register() == "session"
        lease_partition(db, table, "direct-1")
        assert reap(db, table).partitions == 0  # alive: its session holds the lock
    # Its backend releases the lock as it exits, a moment after the client closed the connection.
    wait_until("a reap to free the dead worker's partition", lambda: reap(db, table).partitions == 1, 10)
    held = db.execute(sql.SQL("SELECT locked_by FROM {} WHERE topic = 't'").format(table.offsets)).fetchone()
    assert held == (None,)


def test_a_worker_behind_a_quiet_transaction_pool_registers_as_expiry_and_a_recycled_server_reaps_nothing(
    pooled_dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    """On a quiet pool every transaction of the worker gets the same server connection back, so a check that the lock
    is still held passes; its leases must still end by expiry only: when the pooler recycles that server connection
    (``server_lifetime``, a restart), the lock goes with it while the worker lives on."""
    with psycopg.connect(pooled_dsn, autocommit=True, prepare_threshold=None) as conn:
        assert WorkerPresence(conn, table, "quiet-1", RelaySettings().liveness).register() == "expiry"
        lease_partition(db, table, "quiet-1")
        row = db.execute(sql.SQL("SELECT backend_pid FROM {} WHERE worker_id = 'quiet-1'").format(table.workers))
        server_connection = row.fetchone()
        assert server_connection is not None
        db.execute("SELECT pg_terminate_backend(%s, 10000)", server_connection)  # the pooler's server goes away

        assert reap(db, table).partitions == 0
        conn.execute("SELECT 1")  # the worker is alive: PgBouncer gives it another server connection
    held = db.execute(sql.SQL("SELECT locked_by FROM {} WHERE topic = 't'").format(table.offsets)).fetchone()
    assert held == ("quiet-1",)
