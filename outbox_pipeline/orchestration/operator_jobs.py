"""Operator actions launched from the Dagster UI with config, each calling one engine operation and recording what it
changed as the run's metadata. See docs/dagster.md#operator-jobs."""

import datetime as dt

import dagster as dg
from pydantic import Field

from outbox_pipeline.config import parse_timestamp
from outbox_pipeline.errors import ConfigurationError, OutboxError
from outbox_pipeline.operate.dead_letters import (
    DeadLetter,
    discard_dead_letters,
    list_dead_letters,
    malformed_among,
    retry_dead_letters,
)
from outbox_pipeline.operate.operations import release_lease, replay_sent, rewind_partition
from outbox_pipeline.resources.postgres import PostgresResource
from outbox_pipeline.store.indexes import build, drop_except, indexes_for, states
from outbox_pipeline.strategies import strategy_class
from outbox_pipeline.strategies.positions import PositionStrategy

from .partitions import outbox_partitions, parse_partition_key
from .settings import OrchestrationSettings


class ReplayConfig(dg.Config):
    """Where to replay the partition from: a position (after_id, optionally after_xid) or a time (since)."""

    after_id: int | None = Field(default=None, description="replay rows after this outbox id (0: the whole partition)")
    after_xid: str | None = Field(
        default=None, description="partitioned: the transaction id of the position, with after_id (exact position)"
    )
    since: str | None = Field(default=None, description="replay rows created at or after this ISO-8601 time")
    until: str | None = Field(default=None, description="row strategies (mark-sent): end of the time window, exclusive")
    force: bool = Field(default=False, description="rewind even while a live worker leases the partition")
    whole_topic: bool = Field(
        default=False,
        description="row strategies: the engine replays kept rows by topic, not partition; set to confirm",
    )
    strategy: str | None = Field(default=None, description="empty: the outbox's own (set: it must be that one)")


def _timestamp(value: str | None, name: str) -> dt.datetime | None:
    if not value:
        return None
    try:
        return parse_timestamp(value, name)
    except ConfigurationError as exc:
        raise dg.Failure(str(exc)) from None


@dg.op(description="Replay one outbox partition from a position or a time.")
def replay_outbox_partition(
    context: dg.OpExecutionContext,
    config: ReplayConfig,
    postgres: PostgresResource,
    orchestration: OrchestrationSettings,
) -> dg.Output[int]:
    topic, partition = parse_partition_key(context.partition_key)
    since, until = _timestamp(config.since, "since"), _timestamp(config.until, "until")
    with postgres.connect() as conn:
        strategy = orchestration.strategy_of(conn, postgres.table, config.strategy)
        if issubclass(strategy_class(strategy), PositionStrategy):
            if until is not None:
                raise dg.Failure("`until` applies to row strategies; a position replays everything after it")
            rewound = rewind_partition(
                conn,
                postgres.table,
                topic,
                partition,
                to_id=config.after_id,
                to_xid=config.after_xid,
                since=since,
                force=config.force,
            )
            context.log.info(
                "%s rewound from xid=%s id=%d to xid=%s id=%d",
                context.partition_key,
                rewound.from_xid,
                rewound.from_id,
                rewound.to_xid,
                rewound.to_id,
            )
            return dg.Output(
                rewound.changed,
                metadata={
                    "strategy": strategy,
                    "position_before": f"xid={rewound.from_xid} id={rewound.from_id}",
                    "position_after": f"xid={rewound.to_xid} id={rewound.to_id}",
                },
            )
        if not config.whole_topic:
            raise dg.Failure(
                f"{strategy} keeps delivery state on rows and the engine replays them by topic: this replays "
                f"every kept row of topic {topic!r} in the window, not just partition {partition}. "
                "Set whole_topic: true to confirm."
            )
        count = replay_sent(
            conn,
            postgres.table,
            topic=topic,
            id_from=config.after_id + 1 if config.after_id is not None else None,
            created_from=since,
            created_to=until,
        )
    context.log.info("%d sent rows of %s marked pending again", count, topic)
    return dg.Output(count, metadata={"strategy": strategy, "rows_replayed": count})


@dg.job(
    name="replay_partition",
    partitions_def=outbox_partitions,
    description="Replay a partition: position strategies rewind its position, row strategies (mark-sent) "
    "mark kept rows pending. The lag sensor then relays them again.",
)
def replay_partition_job() -> None:
    replay_outbox_partition()


@dg.op(description="Free the partition's lease now instead of at its expiry.")
def release_partition_lease(context: dg.OpExecutionContext, postgres: PostgresResource) -> dg.Output[bool]:
    topic, partition = parse_partition_key(context.partition_key)
    with postgres.connect() as conn:
        released = release_lease(conn, postgres.table, topic, partition)
    context.log.info("%s: %s", context.partition_key, "lease released" if released else "no lease was held")
    return dg.Output(released, metadata={"released": released})


@dg.job(
    name="release_lease",
    partitions_def=outbox_partitions,
    description="Release a stuck partition lease (a worker that died or hangs). A live holder acks nothing "
    "further; the next owner publishes its batch again.",
)
def release_lease_job() -> None:
    release_partition_lease()


class RetryDeadLettersConfig(dg.Config):
    ids: list[int] = Field(default_factory=list, description="dead-letter ids to retry")
    topic: str | None = Field(default=None, description="retry every pending dead letter of this topic")
    all: bool = Field(default=False, description="retry every pending dead letter (when no ids or topic)")
    dry_run: bool = Field(default=False, description="only list the pending dead letters")


@dg.op(description="Put dead letters back into the outbox (same message_id), or list them.")
def retry_outbox_dead_letters(
    context: dg.OpExecutionContext, config: RetryDeadLettersConfig, postgres: PostgresResource
) -> dg.Output[int]:
    with postgres.connect() as conn:
        table = _dead_letter_table(list_dead_letters(conn, postgres.table, limit=50))
        if config.dry_run:
            return dg.Output(0, metadata={"dead_letters (oldest 50)": dg.MetadataValue.md(table), "retried": 0})
        if not (config.ids or config.topic or config.all):
            raise dg.Failure("say which dead letters to retry: ids, topic, or all: true (dry_run: true lists them)")
        left = malformed_among(conn, postgres.table, ids=config.ids or None, topic=config.topic)
        retried = retry_dead_letters(
            conn, postgres.table, ids=config.ids or None, topic=config.topic, by=f"dagster run {context.run_id}"
        )
    context.log.info("%d dead letters put back into the outbox", retried)
    if left:
        context.log.warning("not retried: malformed dead letters %s hold no message; discard them", left)
    return dg.Output(
        retried, metadata={"retried": retried, "dead_letters before (oldest 50)": dg.MetadataValue.md(table)}
    )


@dg.job(name="retry_dead_letters", description="Retry dead letters by id, by topic or all; dry_run lists them.")
def retry_dead_letters_job() -> None:
    retry_outbox_dead_letters()


def _dead_letter_table(pending: list[DeadLetter]) -> str:
    listing = "\n".join(
        f"| {d.id} | {d.topic}:{d.partition} | {d.key or '-'} | {d.payload}, {d.payload_size:,} B | {d.attempts} "
        f"| {d.held_rows if d.holding else '-'} | {d.last_error.replace('|', '/')[:80]} |"
        for d in pending
    )
    header = (
        "| id | partition | key | payload | attempts | rows held behind it | error |\n|---|---|---|---|---|---|---|\n"
    )
    return header + listing if pending else "none"


class DiscardDeadLettersConfig(dg.Config):
    ids: list[int] = Field(description="dead-letter ids to give up on")
    reason: str = Field(description="why (recorded with each dead letter)")


@dg.op(description="Give up on dead letters for good; the rows held behind them are published without them.")
def discard_outbox_dead_letters(
    context: dg.OpExecutionContext, config: DiscardDeadLettersConfig, postgres: PostgresResource
) -> dg.Output[int]:
    with postgres.connect() as conn:
        table = _dead_letter_table(list_dead_letters(conn, postgres.table, limit=50))
        try:
            discarded = discard_dead_letters(
                conn, postgres.table, config.ids, reason=config.reason, by=f"dagster run {context.run_id}"
            )
        except OutboxError as exc:
            raise dg.Failure(str(exc)) from None
    context.log.info("%d dead letters discarded (%s)", discarded, config.reason)
    return dg.Output(
        discarded, metadata={"discarded": discarded, "dead_letters before (oldest 50)": dg.MetadataValue.md(table)}
    )


@dg.job(name="discard_dead_letters", description="Give up on dead letters (with a reason); releases held keys.")
def discard_dead_letters_job() -> None:
    discard_outbox_dead_letters()


class StrategyIndexesConfig(dg.Config):
    strategy: str | None = Field(
        default=None, description="empty: the outbox's own; another's before `outbox switch-strategy` to it"
    )
    drop_others: bool = Field(
        default=False, description="then drop the indexes it does not read (relays of other strategies refuse)"
    )


@dg.op(description="Build a strategy's indexes without blocking writers, a partition at a time; drop others if asked.")
def build_outbox_strategy_indexes(
    context: dg.OpExecutionContext,
    config: StrategyIndexesConfig,
    postgres: PostgresResource,
    orchestration: OrchestrationSettings,
) -> dg.Output[list[str]]:
    built: list[str] = []
    with postgres.connect() as conn:
        # Another strategy's indexes are the first step of a switch to it: named, they are built whatever is recorded.
        strategy = config.strategy or orchestration.strategy_of(conn, postgres.table)
        try:
            for index in indexes_for([strategy]):
                if partitions := build(conn, postgres.table, index):
                    built.append(index.name)
                    context.log.info("built %s on %d partitions", index.name, len(partitions))
            dropped = drop_except(conn, postgres.table, [strategy]) if config.drop_others else []
        except OutboxError as exc:
            raise dg.Failure(str(exc)) from None
        ready = sorted(name for name, state in states(conn, postgres.table).items() if state.valid)
    return dg.Output(
        built,
        metadata={
            "strategy": strategy,
            "built": ", ".join(built) or "-",
            "dropped": ", ".join(dropped) or "-",
            "ready": ", ".join(ready),
        },  # fmt: skip
    )


@dg.job(
    name="build_strategy_indexes",
    description="The indexes a relay strategy reads, built on the live outbox (relays refuse to start without them).",
)
def build_strategy_indexes_job() -> None:
    build_outbox_strategy_indexes()


OPERATOR_JOBS = [
    replay_partition_job,
    release_lease_job,
    retry_dead_letters_job,
    discard_dead_letters_job,
    build_strategy_indexes_job,
]
