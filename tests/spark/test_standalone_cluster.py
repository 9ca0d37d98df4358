"""``bulk_drain`` on a real standalone Spark cluster (a master and one worker started from pyspark's own
distribution on 127.0.0.1): the same asset, only the master differs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pyspark
import pytest

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.localstack import free_port, wait_for_tcp
from outbox_pipeline.localstack.demo import load
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import positions
from tests.kit.relay import committed_message_ids, message_ids

pytestmark = [pytest.mark.spark, pytest.mark.nightly]  # a cluster of its own: make test-nightly

SPARK_HOME = Path(pyspark.__file__).parent
ROOT = Path(__file__).parents[2]


@dataclass(frozen=True)
class StandaloneCluster:
    master_url: str
    web_url: str

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.web_url}/json", timeout=5) as response:
            state: dict[str, Any] = json.loads(response.read())
        return state


def _spark_class(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group, stopped as one below
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _worker_alive(cluster: StandaloneCluster) -> bool:
    try:
        workers = cluster.state().get("workers", [])
    except (OSError, ValueError):  # the master's web UI answers 404 or an HTML page while it starts
        return False
    return any(w.get("state") == "ALIVE" for w in workers)


@pytest.fixture(scope="module")
def standalone_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    work = tmp_path_factory.mktemp("spark-standalone")
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    port, web_port = free_port(), free_port()
    cluster = StandaloneCluster(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{web_port}")
    master = _spark_class(
        [
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(web_port),
        ],
        work / "master.log",
        env,
    )
    worker: subprocess.Popen[bytes] | None = None
    try:
        wait_for_tcp("127.0.0.1", port, 60)
        wait_for_tcp("127.0.0.1", web_port, 60)
        worker = _spark_class(
            [
                "org.apache.spark.deploy.worker.Worker", cluster.master_url, "--host", "127.0.0.1",
                "--port", str(free_port()), "--webui-port", str(free_port()),
                "--cores", "2", "--memory", "1g", "--work-dir", str(work / "work"),
            ],
            work / "worker.log",
            env,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not _worker_alive(cluster):
            assert worker.poll() is None, (work / "worker.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the worker never registered with the master"
            time.sleep(0.2)  # readiness poll of the master's JSON API, bounded by the deadline
        yield cluster
    finally:
        if worker is not None:
            _stop(worker)
        _stop(master)


def test_bulk_drain_runs_on_a_standalone_spark_cluster(
    standalone_cluster: StandaloneCluster,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic("cluster")
    set_topic_partitions(db, table, topic, 4)
    load(dsn, table, 2000, topics=(topic,), keys=20)
    app_name = f"outbox-drain-{table.schema}"

    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("cluster_drain.py")), dsn, table.schema,
         kafka.bootstrap_servers, standalone_cluster.master_url, app_name],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable},
    )  # fmt: skip

    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["metadata"]["rows"] == 2000 and report["metadata"]["partitions"] == 4
    assert set(message_ids(kafka.consume(topic, expect=2000))) == committed_message_ids(db, table)
    assert all(p.locked_by is None and p.id > 0 for p in positions(db, table).values())
    finished = standalone_cluster.state().get("completedapps", [])
    assert app_name in [app["name"] for app in finished]
