"""The bulk drain as one Spark job, one task per virtual partition, the rows never leaving the task that reads and
publishes them. See docs/spark.md#the-drains-steps-and-who-runs-each."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

from pyspark.accumulators import AccumulatorParam
from pyspark.sql import SparkSession

from outbox_pipeline import server
from outbox_pipeline.drain.engine import commit_drain, leases_kept
from outbox_pipeline.drain.ranges import fetch_range, publish_range
from outbox_pipeline.drain.values import (
    DEFAULT_FETCH_ROWS,
    DeliveryError,
    DrainOutcome,
    DrainPlan,
    LeaseLostError,
    RangeReport,
)
from outbox_pipeline.relay.publisher import KafkaPublisher


class DrainFailed(RuntimeError):
    """The Spark job failed outright: ``outcome`` is the commit of what the tasks that finished delivered."""

    def __init__(self, message: str, outcome: DrainOutcome) -> None:
        super().__init__(message)
        self.outcome = outcome


class _Reports(AccumulatorParam[list[str]]):
    """What the tasks that finished reported (RangeReport as JSON), readable on the driver after a failed job too."""

    def zero(self, value: list[str]) -> list[str]:
        return []

    def addInPlace(self, value1: list[str], value2: list[str]) -> list[str]:  # noqa: N802
        value1.extend(value2)
        return value1


def run_drain(
    spark: SparkSession,
    plan: DrainPlan,
    *,
    dsn: str,
    kafka_config: Mapping[str, object],
    page_rows: int = DEFAULT_FETCH_ROWS,
) -> DrainOutcome:
    """Run the drain as one Spark job and commit what it confirmed; DrainFailed when the job itself failed."""
    if (spark.conf.get("spark.speculation") or "false").lower() == "true":
        with server.connect(dsn, autocommit=True) as conn:
            outcome = commit_drain(conn, plan, ())
        raise DrainFailed("spark.speculation is on: a second attempt of a task would interleave a partition", outcome)
    context = spark.sparkContext
    finished = context.accumulator([], _Reports())
    ranges, config = plan.ranges, dict(kafka_config)

    def drain_range(index: int, _: Iterable[int]) -> Iterator[str]:
        """One task: its range, read and published here; what it confirmed (and what stopped it) goes back."""
        publisher = KafkaPublisher(config)
        try:
            with server.connect(dsn, autocommit=True) as conn:
                pages = fetch_range(conn, plan, ranges[index], page_rows=page_rows)
                report = RangeReport(ranges[index].label, publish_range(publisher, plan.strategy, pages))
        except DeliveryError as exc:
            report = RangeReport(ranges[index].label, exc.delivered, str(exc))
        except LeaseLostError as exc:
            report = RangeReport(ranges[index].label, None, str(exc))
        finally:
            publisher.close(timeout_s=0)
        finished.add([report.to_json()])
        yield report.to_json()

    try:
        # Until the commit, the driver keeps the leases of partitions whose task finished early.
        with leases_kept(dsn, plan):
            tasks = context.parallelize(range(len(ranges)), max(1, len(ranges))).mapPartitionsWithIndex(drain_range)
            lines = tasks.collect() if ranges else []
    except Exception as exc:
        with server.connect(dsn, autocommit=True) as conn:
            outcome = commit_drain(conn, plan, [RangeReport.from_json(line) for line in finished.value])
        raise DrainFailed(f"bulk drain aborted: {_error_line(exc)}", outcome) from exc
    with server.connect(dsn, autocommit=True) as conn:
        return commit_drain(conn, plan, [RangeReport.from_json(line) for line in lines])


# A Python exception's last line in a task's traceback, as the JVM relays it ("module.SomeError: message").
_PYTHON_ERROR = re.compile(r"^(?!org\.|java\.|scala\.|py4j\.)[\w.]*(Error|Exception): .+")


def _error_line(exc: BaseException) -> str:
    """The line that names the task's error: the last Python exception in the text Spark wraps it in (a failed
    job's message is mostly the JVM's stack)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if _PYTHON_ERROR.match(line)]
    return named[-1] if named else (lines[-1] if lines else type(exc).__name__)
