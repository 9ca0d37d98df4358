"""A relay worker that is killed with SIGKILL right after Kafka confirmed its first batch and before
it could ack it: the worst moment for at-least-once. Run as a script by the crash tests."""

from __future__ import annotations

import os
import signal
import sys

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.publisher import KafkaPublisher, PendingBatch
from outbox_pipeline.relay import Relay, RelaySettings
from outbox_pipeline.strategies import strategy_class
from outbox_pipeline.strategies.base import PublishOutcome, StrategyConfig


class DiesAfterPublish(KafkaPublisher):
    def finish(self, pending: PendingBatch) -> PublishOutcome:
        outcome = super().finish(pending)
        print(f"published {len(outcome.delivered)}; dying before the ack", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return outcome


def main(dsn: str, schema: str, bootstrap: str, strategy: str, worker_id: str, batch: int) -> None:
    relay = Relay(
        dsn,
        strategy_class(strategy),
        StrategyConfig(table=OutboxTable(schema=schema), worker_id=worker_id),
        DiesAfterPublish({"bootstrap.servers": bootstrap}),
        RelaySettings(batch_size=batch, until_empty=True, listen=False),
    )
    relay.run()


if __name__ == "__main__":
    dsn, schema, bootstrap, strategy, worker_id, batch = sys.argv[1:7]
    main(dsn, schema, bootstrap, strategy, worker_id, int(batch))
