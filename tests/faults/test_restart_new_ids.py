"""Issue 14's scenario: relay processes killed with SIGKILL (the whole process group) and started again the
way a Kubernetes Deployment restarts a pod, under NEW worker ids (the default ``hostname-pid``).

The dead workers' leases must not hold their partitions or rows for ``lease_s``: their sessions are gone, so
the next relay frees them at once (liveness.py), and ``--until-empty`` means "nothing pending", not "nothing
claimable by me". The restarted relay, run right after the kill (no sleep), delivers everything and exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.cli import EXIT_NOT_EMPTY
from outbox_pipeline.relay import WorkerPresence
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import pending, wait_until
from tests.kit.writer import Writer

from .helpers import STRATEGIES, consume, report, tally

pytestmark = pytest.mark.faults


def _relay(dsn: str, table: OutboxTable, bootstrap: str, strategy: str, *extra: str) -> subprocess.Popen[str]:
    """``outbox relay`` as a user runs it, in a process group of its own (so SIGKILL reaches every worker)."""
    return subprocess.Popen(
        [sys.executable, "-m", "outbox_pipeline.cli", "relay", "--dsn", dsn, "--schema", table.schema]
        + ["--strategy", strategy, "--workers", "2", "--batch-size", "500", *extra],
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _held(dsn: str, table: OutboxTable) -> str:
    """Partitions and rows still leased (to the killed workers) right after the kill."""
    with psycopg.connect(dsn, autocommit=True) as db:
        row = db.execute(
            sql.SQL(
                "SELECT (SELECT count(*) FROM {} WHERE locked_by IS NOT NULL AND available_after > now()), "
                "(SELECT count(*) FROM {} WHERE expires_at > now())"
            ).format(table.offsets, table.leases)
        ).fetchone()
    assert row is not None
    return f"{row[0]}p/{row[1]}r"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_killed_relays_restarted_under_new_ids_deliver_everything_and_until_empty_means_empty(
    strategy: str,
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    table = outbox_tables(dsn)
    topics = [new_topic("restart", partitions=4) for _ in range(2)]
    with psycopg.connect(dsn, autocommit=True) as db:
        for topic in topics:
            set_topic_partitions(db, table, topic, 4)
    writers = [
        Writer(
            dsn,
            table,
            topics[n % 2],
            serialized=strategy == "serialized",
            name=f"w{n}",
            keys=16,
            total=1500,
            rollback_every=7,
            pause_s=0.01,
        )  # ~4 s of writes: the relay is busy when the kill comes
        for n in range(4)
    ]
    for writer in writers:
        writer.start()
    first = _relay(dsn, table, kafka.bootstrap_servers, strategy, "--until-empty")
    # The scenario: killed mid-drain (here: once its workers have relayed 1,000 rows, while writes go on).
    wait_until(
        "the first relay to be busy",
        lambda: sum(len(w.committed) for w in writers) - pending(dsn, table, strategy) >= 1000,
        60,
    )
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate(timeout=30)
    held = _held(dsn, table)
    for writer in writers:
        writer.join(120)
        writer.check()
    t0 = time.monotonic()

    runs = []
    for _ in range(2):  # restarted twice, each under new ids, right away
        again = _relay(dsn, table, kafka.bootstrap_servers, strategy, "--until-empty", "--max-seconds", "120")
        out, _ = again.communicate(timeout=180)
        runs.append((again.returncode, out))
    drained_s = time.monotonic() - t0

    committed = [m for w in writers for m in w.committed]
    left = pending(dsn, table, strategy)
    records = consume(kafka.bootstrap_servers, topics, committed)
    result = tally(committed, records)
    report("restart-new-ids", strategy, **result.figures, seconds=drained_s, held_at_kill=held, pending_after=left)
    assert [code for code, _ in runs] == [0, 0], "\n".join(out[-2000:] for _, out in runs)
    assert left == 0
    assert not result.lost, f"{len(result.lost)} committed messages never reached Kafka"
    assert not result.phantom


def test_until_empty_stops_at_max_seconds_with_exit_3_and_says_who_holds_the_rows(
    dsn: str, outbox_tables: Callable[[str], OutboxTable], kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """A live worker holds the only partition with rows: the relay waits, then reports it and exits 3."""
    table = outbox_tables(dsn)
    topic = new_topic("held")
    with psycopg.connect(dsn, autocommit=True) as db, psycopg.connect(dsn, autocommit=True) as holder_conn:
        set_topic_partitions(db, table, topic, 1)
        Writer(dsn, table, topic, serialized=True, total=20).run()
        holder = WorkerPresence(holder_conn, table, "holder-7", "session")
        holder.register()
        db.execute(
            sql.SQL(
                "INSERT INTO {} (topic, partition, locked_by, available_after) "
                "VALUES (%s, 0, 'holder-7', now() + interval '1 hour')"
            ).format(table.offsets),
            [topic],
        )
        relay = _relay(dsn, table, kafka.bootstrap_servers, "serialized", "--until-empty", "--max-seconds", "3")
        out, _ = relay.communicate(timeout=60)
    assert relay.returncode == EXIT_NOT_EMPTY, out
    assert f"20 rows pending in serialized {topic}:0, leased by holder-7 (alive) until " in out
