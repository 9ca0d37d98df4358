"""A relay worker that is killed with SIGKILL right after Kafka confirmed its first batch and before
it could ack it: the worst moment for at-least-once. Run as a script by the crash tests."""

from __future__ import annotations

import os
import signal
import sys

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.publisher import KafkaPublisher, PendingBatch
from outbox_pipeline.relay import RelaySettings
from outbox_pipeline.strategies.base import PublishOutcome, StrategyConfig
from outbox_pipeline.workers import WorkerSpec, build_relay


class DiesAfterPublish(KafkaPublisher):
    def finish(self, pending: PendingBatch) -> PublishOutcome:
        outcome = super().finish(pending)
        print(f"published {len(outcome.delivered)}; dying before the ack", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return outcome


def main(dsn: str, schema: str, bootstrap: str, strategy: str, worker_id: str, batch: int) -> None:
    spec = WorkerSpec(
        dsn,
        strategy,
        {"bootstrap.servers": bootstrap},
        RelaySettings(batch_size=batch, until_empty=True, listen=False),
        StrategyConfig(table=OutboxTable(schema=schema)),
        worker_id=worker_id,
    )
    relay = build_relay(spec, publisher=DiesAfterPublish(spec.kafka_config))
    relay.run()


if __name__ == "__main__":
    dsn, schema, bootstrap, strategy, worker_id, batch = sys.argv[1:7]
    main(dsn, schema, bootstrap, strategy, worker_id, int(batch))
