"""Scenario 8: poison input among good messages, with a worker process that keeps running. A payload over the
producer's size limit (message.max.bytes set low on the producer) and a topic name the broker rejects (inserted
past the table's CHECK constraint, as a writer bypassing `enqueue` could) fail permanently; a topic that does not
exist, with auto-creation off, times out: a transient error, retried until `max_attempts`. Each ends in the
dead letters with its error, and the good messages, in the same partition or others, keep flowing meanwhile. The
poison rows have keys of their own here: a later row of a poisoned key is held (scenario 12). Timing: that the good
rows flow *while* the poison row is retried is a race with its retries' back-off, which a loaded machine lost (16 of
100 on Debian's 15 beside three other test processes, a fresh clone of 2026-11-28): it runs alone."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable, enqueue
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import dead_letters, pending, wait_until
from tests.kit.workers import WorkerProcess
from tests.kit.writer import write

from .helpers import consume, report, tally

pytestmark = [pytest.mark.faults, pytest.mark.timing]

MAX_ATTEMPTS = 3


class HeldUp(AssertionError):
    """Good rows waited for the poison row's retries."""


class WrongAttempts(AssertionError):
    """The dead letter does not record how often the row was tried."""


MAX_MESSAGE_BYTES = 10_000
GOOD = 100


@pytest.mark.parametrize(
    "strategy",
    [
        "locking",
        "advisory",
        "lease",
        "partitioned",
        "serialized",
    ],
)
def test_poison_messages_are_dead_lettered_with_their_error_and_the_partition_keeps_flowing(
    strategy: str,
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    started = time.monotonic()
    serialized = strategy == "serialized"
    table = outbox_tables(dsn)
    topic = new_topic()
    missing = f"missing-{uuid.uuid4().hex[:10]}"  # never created, and the producer may not auto-create it
    with psycopg.connect(dsn, autocommit=True) as db:
        set_topic_partitions(db, table, topic, 1)  # the oversize row shares the good rows' partition
        db.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT outbox_messages_topic_valid").format(table.messages))
        committed = write(dsn, table, topic, GOOD // 2, serialized=serialized)
        poison = {
            "oversize": str(
                enqueue(
                    db, topic, {"blob": "x" * 2 * MAX_MESSAGE_BYTES}, key="poison", serialized=serialized, table=table
                ).message_id
            ),
            "invalid-topic": db.execute(
                sql.SQL(
                    "INSERT INTO {} (topic, key, payload, partition) VALUES ('bad topic!', 'k', '{{}}', 0) "
                    "RETURNING message_id::text"
                ).format(table.messages)
            ).fetchone()[0],  # type: ignore[index]
            "missing-topic": str(
                enqueue(db, missing, {"n": 0}, key="k", serialized=serialized, table=table).message_id
            ),
        }
        committed += write(dsn, table, topic, GOOD // 2, serialized=serialized)
    worker = workers(
        "relay",
        dsn=dsn,
        table=table,
        bootstrap=kafka.bootstrap_servers,
        strategy=strategy,
        batch_size=20,
        config={"max_attempts": MAX_ATTEMPTS, "backoff_base_s": 0.2, "backoff_max_s": 0.5},
        producer={
            "message.max.bytes": MAX_MESSAGE_BYTES,
            "allow.auto.create.topics": False,
            "message.timeout.ms": 500,
            "request.timeout.ms": 500,
        },
        settings={"max_poll_interval_s": 0.5, "error_backoff_base_s": 0.2, "error_backoff_max_s": 0.5},
    ).start()

    # While the missing topic's row is being retried, more good rows come and must flow past it.
    def missing_topic_failed_once() -> bool:
        with psycopg.connect(dsn, autocommit=True) as db:
            return any("missing" in line for line in worker.log(20_000).splitlines()) or bool(dead_letters(db, table))

    wait_until("a first failure of the missing topic's row", missing_topic_failed_once, 30)
    second_wave_at = time.time()
    second_wave = write(dsn, table, topic, GOOD, serialized=serialized)
    committed += second_wave

    with psycopg.connect(dsn, autocommit=True) as db:
        wait_until("three dead letters", lambda: len(dead_letters(db, table)) >= 3, 60)
        wait_until("the good rows to be delivered", lambda: pending(dsn, table, strategy) == 0, 60)
        dead = dead_letters(db, table)
        missing_dead_at = db.execute(
            sql.SQL("SELECT extract(epoch FROM dead_lettered_at) FROM {} WHERE message_id = %s").format(
                table.dead_letters
            ),
            (poison["missing-topic"],),
        ).fetchone()
    assert worker.terminate() == 0, worker.log()

    records = consume(kafka.bootstrap_servers, [topic], committed)
    result = tally(committed, records)
    wave = set(second_wave)
    flowed = sum(
        1
        for r in records
        if r.headers["message_id"].decode() in wave and missing_dead_at and r.timestamp_ms / 1000 < missing_dead_at[0]
    )
    report(
        "poison",
        strategy,
        **result.figures,
        seconds=time.monotonic() - started,
        dead_letters=len(dead),
        attempts="/".join(f"{k}:{dead.get(v, (0, ''))[0]}" for k, v in poison.items()),
        max_attempts=MAX_ATTEMPTS,
        flowed_while_retrying=f"{flowed}/{len(second_wave)}",
    )
    assert not result.lost and not result.phantom and result.dupes == 0, result.figures
    assert set(dead) == set(poison.values()), f"dead letters: {dead}"
    attempts, error = dead[poison["oversize"]]
    assert attempts == 1 and ("too large" in error.lower() or "size" in error.lower()), dead[poison["oversize"]]
    attempts, error = dead[poison["invalid-topic"]]
    assert attempts == 1 and "topic" in error.lower(), dead[poison["invalid-topic"]]
    attempts, error = dead[poison["missing-topic"]]
    assert missing in error or "timed out" in error.lower(), error
    assert second_wave_at < missing_dead_at[0], "the poison row was dead already: nothing to flow past"  # type: ignore[index]
    if flowed != len(second_wave):
        raise HeldUp(f"only {flowed} of {len(second_wave)} good rows were published while the poison row was retried")
    if attempts != MAX_ATTEMPTS:
        failed_batches = sum(1 for line in worker.log(50_000).splitlines() if f"topic '{missing}'" in line)
        raise WrongAttempts(
            f"the missing topic's row was dead-lettered after max_attempts={MAX_ATTEMPTS} ({failed_batches} failed "
            f"batches logged with its error), but its dead letter says attempts={attempts}"
        )
