"""One relay worker process for the fault tests: the real Relay, strategy and producer, instrumented.

Run as ``python tests/kit/worker.py SPEC_JSON``. It appends one line per step to the ``events`` file
(``<monotonic time> <step> [numbers]``; CLOCK_MONOTONIC is system-wide, so the test can compare times),
which tells the test where a SIGKILL landed and how often the worker claimed during an outage, and writes
its cumulative RelayStats as JSON to ``stats`` when it ends (SIGTERM stops it after the batch in hand).
With ``kill_after_publish`` it kills itself (SIGKILL) once that many batches are confirmed by Kafka and
before their ack: the worst moment for at-least-once.
With ``stop_after_publish`` it freezes itself (SIGSTOP) once that many batches are confirmed by Kafka,
before their ack: a worker hung past its lease, resumed by the test with SIGCONT. (The relay pipelines: by
then it may have claimed its next batch, and it publishes that one before acking the confirmed one.)
With Kafka transactions, ``kill_in_transaction`` and ``pause_in_transaction`` kill or freeze it in its N-th
transaction whose records Kafka has all taken, before the commit: its records are in the log, uncommitted.
``pause_before_transaction`` freezes it as its N-th transaction is about to begin (its partition claimed, its
producer perhaps not made yet).

A ``wal`` worker is the wal strategy's relay (relay/wal/) with the same publisher and settings (``wal_batch_max``, the
back-off). It logs no claims.

Steps: claim-begin, claim N [P] (N records, 0: nothing; P: the first record's partition), home P... (the
partitions dealt to it, when that changes), produce N, delivered OK FAILED, ack-begin,
acked ACKED LOST RETRIED DEAD (the AckResult), give-back, transaction N (a transaction of N records about to begin),
in-transaction N (its N records taken by Kafka, not committed yet), killed, frozen, thawed, start, end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from confluent_kafka import Producer

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.model import WAL, AckResult, Claim, OutboxRecord, PublishOutcome
from outbox_pipeline.relay import KafkaPublisher, PendingBatch, RelaySettings, WorkerSpec, build_relay
from outbox_pipeline.relay.transactional import TransactionalProducers, _Reports
from outbox_pipeline.strategies import Strategy, StrategyConfig, strategy_class


class Events:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # kept open for the life of the process
        self._lock = threading.Lock()

    def __call__(self, step: str, *numbers: int) -> None:
        with self._lock:
            self._file.write(" ".join([f"{time.monotonic():.6f}", step, *map(str, numbers)]) + "\n")


class InTransaction(TransactionalProducers):
    """Transactional producers that call ``first`` as a transaction is about to begin and ``then`` once Kafka has
    taken every record of it, before its commit: where a fault test kills or freezes a worker."""

    def __init__(self, *args: Any, first: Callable[[int], None], then: Callable[[int], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._first = first
        self._then = then

    def publish(self, records: Sequence[OutboxRecord], *args: Any, **kwargs: Any) -> PublishOutcome:
        self._first(len(records))
        return super().publish(records, *args, **kwargs)

    def _produce_all(self, producer: Producer, records: Sequence[OutboxRecord]) -> _Reports:
        reports = super()._produce_all(producer, records)
        if not reports.failed_count:
            self._then(len(records))
        return reports


class InstrumentedPublisher(KafkaPublisher):
    """Logs each batch handed to the producer (`produce`) and confirmed (`delivered`), for both paths the relay
    takes: ``start``/``finish`` (pipelined) and ``publish`` (Kafka transactions)."""

    def __init__(
        self,
        config: Mapping[str, object],
        events: Events,
        stop_after_publish: int | None,
        kill_after_publish: int | None = None,
        fail_after_publish: int | None = None,
        kill_in_transaction: int | None = None,
        pause_in_transaction: int | None = None,
        pause_before_transaction: int | None = None,
    ) -> None:
        super().__init__(config)
        self.events = events
        self.stop_after_publish = stop_after_publish
        self.kill_after_publish = kill_after_publish
        self.fail_after_publish = fail_after_publish
        self.kill_in_transaction = kill_in_transaction
        self.pause_in_transaction = pause_in_transaction
        self.pause_before_transaction = pause_before_transaction
        self.publishes = 0
        self.begun = 0
        self.transactions = 0
        self._transactional = InTransaction(
            self._config,
            timeout_s=self._timeout_s,
            limits=self.limits,
            headers_of=self._headers_of,
            first=self._before_transaction,
            then=self._in_transaction,
        )

    def start(self, records: Sequence[OutboxRecord], *args: Any, **kwargs: Any) -> PendingBatch:
        self.events("produce", len(records))
        return super().start(records, *args, **kwargs)

    def finish(self, pending: PendingBatch, *args: Any, **kwargs: Any) -> PublishOutcome:
        return self._confirmed(super().finish(pending, *args, **kwargs))

    def publish(
        self, records: Sequence[OutboxRecord], *, transactional_id: str | None = None, **kw: Any
    ) -> PublishOutcome:
        if transactional_id is None:
            return super().publish(records)  # start + finish, logged there
        self.events("produce", len(records))
        return self._confirmed(super().publish(records, transactional_id=transactional_id, **kw))

    def _before_transaction(self, records: int) -> None:
        self.begun += 1
        self.events("transaction", records)
        if self.begun == self.pause_before_transaction:
            self._freeze()

    def _freeze(self) -> None:
        self.events("frozen")
        os.kill(os.getpid(), signal.SIGSTOP)  # the test resumes us with SIGCONT
        self.events("thawed")

    def _in_transaction(self, records: int) -> None:
        self.transactions += 1
        self.events("in-transaction", records)
        if self.transactions == self.kill_in_transaction:
            self.events("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.transactions == self.pause_in_transaction:
            self._freeze()

    def _confirmed(self, outcome: PublishOutcome) -> PublishOutcome:
        self.events("delivered", len(outcome.delivered), len(outcome.failed))
        self.publishes += 1
        if self.publishes == self.kill_after_publish:
            self.events("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.publishes == self.fail_after_publish:
            self.events("failed")
            raise RuntimeError("injected: an exception out of the relay loop")
        if self.publishes == self.stop_after_publish:
            self.events("frozen")
            os.kill(os.getpid(), signal.SIGSTOP)  # the test resumes us with SIGCONT
            self.events("thawed")
        return outcome


def instrumented(cls: type[Strategy], events: Events) -> type[Strategy]:
    """The strategy class with its claim, ack and give_back logged (a subclass, so the relay still sees the
    class attributes it relies on, such as ``pipelining``)."""

    class Instrumented(cls):  # type: ignore[valid-type,misc]
        # *args: whatever the engine passes (the limit, and hints that change as the relay evolves)
        def claim(self, *args: Any, **kwargs: Any) -> Claim | None:
            events("claim-begin")
            result: Claim | None = super().claim(*args, **kwargs)
            home = getattr(self, "home", None)  # position strategies: the partitions dealt to this worker
            if home is not None and not home.everywhere and home.partitions != getattr(self, "_logged_home", None):
                self._logged_home = home.partitions
                events("home", *home.partitions)
            if result is None or not result.records:
                events("claim", 0)
            else:  # and the Kafka partition of its first record (all of one partition for position strategies)
                events("claim", len(result.records), result.records[0].partition)
            return result

        def ack(self, claimed: Claim, outcome: PublishOutcome, *args: Any, **kwargs: Any) -> AckResult:
            events("ack-begin")
            result: AckResult = super().ack(claimed, outcome, *args, **kwargs)
            events("acked", result.acked, result.lost_ownership, result.retried, result.dead_lettered)
            return result

        def give_back(self, claimed: Claim, *args: Any, **kwargs: Any) -> None:
            events("give-back")
            super().give_back(claimed, *args, **kwargs)

    Instrumented.__name__ = Instrumented.__qualname__ = f"Instrumented{cls.__name__}"
    return Instrumented


def main(spec: dict[str, Any]) -> None:
    events = Events(spec["events"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker = WorkerSpec(
        spec["dsn"],
        spec["strategy"],
        {"bootstrap.servers": spec["bootstrap"], **spec.get("producer", {})},
        RelaySettings(**{"batch_size": spec["batch_size"], **spec.get("settings", {})}),
        StrategyConfig(table=OutboxTable(schema=spec["schema"]), **spec.get("config", {})),
        worker_id=spec["worker_id"],
    )
    publisher = InstrumentedPublisher(
        worker.kafka_config,
        events,
        spec.get("stop_after_publish"),
        spec.get("kill_after_publish"),
        spec.get("fail_after_publish"),
        spec.get("kill_in_transaction"),
        spec.get("pause_in_transaction"),
        spec.get("pause_before_transaction"),
    )
    table_strategy = None if spec["strategy"] == WAL else instrumented(strategy_class(spec["strategy"]), events)
    relay = build_relay(worker, stop, publisher=publisher, strategy_cls=table_strategy)
    events("start")
    try:
        relay.run()
    finally:
        stats = {f.name: getattr(relay.stats, f.name) for f in dataclasses.fields(relay.stats)}
        stats["elapsed_s"] = relay.stats.elapsed_s
        tmp = spec["stats"] + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(stats, fh)
        os.replace(tmp, spec["stats"])
        events("end")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
