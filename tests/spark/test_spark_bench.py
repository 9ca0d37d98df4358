"""`python -m outbox_pipeline.assets.spark.bench`: the Spark drain and the direct relay, interleaved, every message
counted back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kit.kafka import KafkaProbe

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.spark, pytest.mark.nightly]  # a bench at size: make test-nightly


def test_the_spark_bench_drains_the_same_backlog_both_ways_and_counts_every_message_back(
    dsn: str, kafka: KafkaProbe
) -> None:
    env = {**os.environ, "OUTBOX_PG_DSN": dsn, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    run = subprocess.run(
        [sys.executable, "-m", "outbox_pipeline.assets.spark.bench", "--messages", "3000", "--runs", "1", "--verify"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    spark_line = re.search(r"spark drain +3,000 msgs .* msg/s \| tasks: .*verified", run.stdout)
    relay_line = re.search(r"partitioned ours w=2 b=5000 +3,000 msgs .* verified", run.stdout)
    assert spark_line and relay_line, run.stdout
    assert re.search(r"spark / relay: \d+\.\d\d", run.stdout), run.stdout
