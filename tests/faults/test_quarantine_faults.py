"""Scenario 12: a message Kafka will never take in the middle of a key's stream, under kill -9. The ordered
strategies hold the rest of that key (quarantine) while the other keys flow; the hold and its rows survive two
kill -9s and restarts under new identities; after the operator's retry every key, the poisoned one included, has
arrived complete and in commit order."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.observe import held_keys
from outbox_pipeline.operate import retry_dead_letters
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import pending as pending_rows
from tests.kit.probes import wait_until
from tests.kit.workers import WorkerProcess

from .helpers import consume, report, tally

pytestmark = pytest.mark.faults

KEYS = 8
POISON_KEY = "k3"
SMALL = {"message.max.bytes": 10_000}  # the poison row cannot go through a relay with this producer


def _write(dsn: str, table: OutboxTable, topic: str, count: int, start: int) -> list[tuple[str, str]]:
    """``count`` rows over KEYS keys, one transaction each ten rows; (message_id, key) in commit order."""
    written: list[tuple[str, str]] = []
    with psycopg.connect(dsn) as conn:
        for first in range(start, start + count, 10):
            with conn.transaction():
                messages = [Message(topic, {"n": i}, key=f"k{i % KEYS}") for i in range(first, first + 10)]
                rows = enqueue_many(conn, messages, serialized=True, table=table)
            written += [(str(r.message_id), m.key or "") for r, m in zip(rows, messages, strict=True)]
    return written


@pytest.mark.parametrize("strategy", ["partitioned", "serialized", "advisory"])
def test_a_poison_message_holds_its_key_through_kill_9_and_new_identities_and_the_retry_leaves_no_hole(
    strategy: str,
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    started = time.monotonic()
    table = outbox_tables(dsn)
    topic = new_topic()
    with psycopg.connect(dsn, autocommit=True) as db:
        set_topic_partitions(db, table, topic, 1)  # every key in one partition: the others must flow past the hold
    committed = _write(dsn, table, topic, 100, 0)
    with psycopg.connect(dsn) as conn, conn.transaction():
        [poison] = enqueue_many(
            conn, [Message(topic, {"blob": "x" * 20_000}, key=POISON_KEY)], serialized=True, table=table
        )
    committed.append((str(poison.message_id), POISON_KEY))
    second_wave = _write(dsn, table, topic, 100, 100)
    committed += second_wave

    def relay(name: str, producer: Mapping[str, object]) -> WorkerProcess:
        return workers(
            name, dsn=dsn, table=table, bootstrap=kafka.bootstrap_servers, strategy=strategy, batch_size=20,
            producer=producer, settings={"max_poll_interval_s": 0.5},
        ).start()  # fmt: skip

    def held() -> int:
        with psycopg.connect(dsn, autocommit=True) as db:
            return sum(key.rows for key in held_keys(db, table))

    first = relay("first", SMALL)
    wait_until("the other keys to flow past the held one", lambda: pending_rows(dsn, table, strategy) == 0, 60)
    held_after_first = held()
    first.kill()
    third_wave = _write(dsn, table, topic, 50, 200)
    committed += third_wave

    second = relay("second", SMALL)  # a new identity, as a Deployment restarts it
    wait_until("the new rows of the other keys", lambda: pending_rows(dsn, table, strategy) == 0, 60)
    held_after_second = held()
    second.kill()

    third = relay("third", {})  # the relay that can take the poison row
    with psycopg.connect(dsn, autocommit=True) as db:
        assert retry_dead_letters(db, table, ids=[poison.id]) == 1
    wait_until("the retried key to be released", lambda: held() == 0 and not _holds(dsn, table), 60)
    wait_until("everything to be delivered", lambda: pending_rows(dsn, table, strategy) == 0, 60)
    assert third.terminate() == 0, third.log()

    records = consume(kafka.bootstrap_servers, [topic], [m for m, _ in committed])
    result = tally([m for m, _ in committed], records)
    first_seen: dict[str, list[str]] = {}
    seen: set[str] = set()
    for record in records:
        message_id = record.headers["message_id"].decode()
        if message_id not in seen:
            seen.add(message_id)
            first_seen.setdefault((record.key or b"").decode(), []).append(message_id)
    expected = {f"k{k}": [m for m, key in committed if key == f"k{k}"] for k in range(KEYS)}
    report(
        "quarantine",
        strategy,
        **result.figures,
        seconds=time.monotonic() - started,
        held_after_first=held_after_first,
        held_after_second=held_after_second,
    )
    assert not result.lost and not result.phantom, result.figures
    # The poisoned key's rows after the poison row waited for it, those written later as well.
    behind = sum(1 for _, key in second_wave if key == POISON_KEY)
    assert (held_after_first, held_after_second) == (behind, behind + sum(1 for _, k in third_wave if k == POISON_KEY))
    assert first_seen == expected


def _holds(dsn: str, table: OutboxTable) -> list[object]:
    with psycopg.connect(dsn, autocommit=True) as db:
        return list(held_keys(db, table))
