"""The Spark bulk drain against the direct relay, interleaved in one invocation
(`python -m outbox_pipeline.assets.spark.bench`); the engine's bench cannot import Spark.
See docs/performance.md#the-spark-bulk-drain-against-the-direct-relay."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import uuid
from collections.abc import Sequence

import psycopg

from outbox_pipeline.bench.baselines.ceilings import count_back
from outbox_pipeline.bench.command import servers
from outbox_pipeline.bench.runner import RunSpec, Servers, drop_table, prepare, run_once
from outbox_pipeline.drain.engine import plan_drain
from outbox_pipeline.drain.values import drain_owner
from outbox_pipeline.resources.spark import SparkResource

from .drain_job import run_drain

LOCAL_CONF = {"spark.ui.enabled": "false", "spark.python.worker.reuse": "true"}


def spark_line(servers_: Servers, spec: RunSpec, spark: SparkResource, verify: bool) -> float:
    """Load the backlog, drain it with Spark; msg/s (plan, job and commit timed)."""
    table, topics, _ = prepare(servers_, spec)
    started = time.monotonic()
    with psycopg.connect(servers_.dsn, autocommit=True) as conn:
        plan = plan_drain(conn, table, strategy=spec.strategy, owner=drain_owner(uuid.uuid4().hex))
    outcome = run_drain(spark.session, plan, dsn=servers_.dsn, kafka_config={"bootstrap.servers": servers_.bootstrap})
    elapsed = time.monotonic() - started
    rows = sum(d.rows for d in outcome.committed)
    tasks = ", ".join(f"{d.label} {d.elapsed_s:.1f} s" for d in outcome.committed)
    note = ""
    if verify:
        distinct, _ = count_back(servers_.bootstrap, topics, spec.messages)
        note = " verified" if distinct == spec.messages else f" VERIFY FAILED ({distinct:,} arrived)"
    drop_table(servers_, table)
    print(f"  spark drain  {rows:>9,} msgs in {elapsed:7.2f} s = {rows / elapsed:>9,.0f} msg/s | tasks: {tasks}{note}")
    return rows / elapsed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m outbox_pipeline.assets.spark.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=1, help="virtual partitions per topic (Spark tasks / 2)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--verify", action="store_true", help="count every message back from Kafka")
    parser.add_argument("--embedded", action="store_true", help="use the embedded stack even if servers are set")
    args = parser.parse_args(argv)
    spec = RunSpec(strategy="partitioned", messages=args.messages, partitions=args.partitions, verify=args.verify)
    print(f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores, Spark {args.master}")
    spark = SparkResource(master=args.master, spark_conf=LOCAL_CONF)
    spark.session.range(10).count()  # start the session and its first Python worker before any clock
    results: dict[str, list[float]] = {"spark": [], "relay": []}
    with servers(args.embedded) as found:
        for n in range(args.runs):
            print(f"round {n + 1}/{args.runs}")
            for line in ("spark", "relay") if n % 2 == 0 else ("relay", "spark"):
                if line == "spark":
                    results[line].append(spark_line(found, spec, spark, args.verify))
                else:
                    results[line].append(run_once(found, spec).msg_per_s)
    spark.session.stop()
    medians = {line: statistics.median(values) for line, values in results.items()}
    for line, values in results.items():
        print(f"{line:>6}: {', '.join(f'{v / 1000:.1f}k' for v in values)} -> median {medians[line] / 1000:.1f}k")
    print(f"spark / relay: {medians['spark'] / medians['relay']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
