"""End to end: `dagster dev` (the project's workspace.yaml and dagster.yaml) against the real PostgreSQL and
broker. Its lag sensor must register the outbox's partitions and keep one long-lived relay run that relays
them all and records each partition's history (materializations at intervals), with no queued backlog,
read back through GraphQL as the UI reads it; a headless Chromium screenshot of one partition's page is
kept as a test artifact. Stopping `dagster dev` stops the run cleanly (its worker deregisters)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.localstack import LocalBroker, LocalPostgres, free_port, wait_group_gone
from outbox_pipeline.settings import TEST_ARTIFACTS
from outbox_pipeline.store import init_db, set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import message_ids

from .conftest import Written, write_outbox_rows

ROOT = Path(__file__).resolve().parents[2]
# The screenshot lands here (kept after the run; CI can upload it).
ARTIFACTS = ROOT / TEST_ARTIFACTS.read()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LOCATION = "outbox_pipeline.definitions"


def _restore_default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class DagsterDev:
    """`dagster dev` in its own process group; stopped with SIGINT (as a terminal would), then killed."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.log_path = home.parent / "dagster-dev.log"
        dagster = shutil.which("dagster", path=str(Path(sys.executable).parent)) or "dagster"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [dagster, "dev", "-h", "127.0.0.1", "-p", str(self.port), "-w", "workspace.yaml"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_restore_default_signals,
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def graphql(self, query: str, variables: dict[str, object] | None = None) -> Any:
        request = urllib.request.Request(
            f"{self.url}/graphql",
            data=json.dumps({"query": query, "variables": variables or {}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = json.loads(response.read())
        assert "errors" not in body, body
        return body["data"]

    def wait_for(self, what: str, check: Callable[[], bool], deadline_s: float) -> None:
        start = time.monotonic()
        while time.monotonic() - start < deadline_s:
            assert self.process.poll() is None, f"dagster dev exited: {self.output()}"
            try:
                if check():
                    return
            except (OSError, AssertionError, KeyError, TypeError):
                pass  # not up yet, or not there yet
            time.sleep(1.0)
        raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Runs got the SIGINT too and stop after the batch in flight; give them the time a terminal would.
        wait_group_gone(self.process.pid, 30.0)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever of the group outlived its leader
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class Stack:
    dev: DagsterDev
    written: Written
    dsn: str
    table: OutboxTable
    started: float  # time.monotonic() when dagster dev was started


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, pg_server: LocalPostgres, broker: LocalBroker) -> Iterator[Stack]:
    """An outbox with 90 rows in 3 partitions of a fresh topic, and `dagster dev` running against it (shared by
    this module's tests: starting it takes a while)."""
    table = OutboxTable(schema=f"t_{uuid.uuid4().hex[:12]}")
    topic = f"dgdev-{uuid.uuid4().hex[:10]}"
    broker.create_topics([topic], partitions=3)
    with psycopg.connect(pg_server.dsn, autocommit=True) as db:
        init_db(db, table, strategies=["partitioned"])  # as `make dev` makes it: the strategy recorded
        set_topic_partitions(db, table, topic, 3)
        written = write_outbox_rows(db, table, topic, 90)
    home = tmp_path_factory.mktemp("dagster_dev") / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        resources.files("outbox_pipeline.localstack").joinpath("dagster.yaml").read_text()
    )
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "OUTBOX_PG_DSN": pg_server.dsn,
        "OUTBOX_SCHEMA": table.schema,
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap_servers,
        "OUTBOX_LAG_SENSOR_INTERVAL_S": "2",
        "OUTBOX_LAG_CHECK_INTERVAL_S": "2",
        "OUTBOX_RELAY_REPORT_INTERVAL_S": "10",
        "OUTBOX_ARCHIVE_URI": str(tmp_path_factory.mktemp("archive")),
    }
    env.pop("OUTBOX_ALERT_WEBHOOK_URL", None)
    dev = DagsterDev(home, env)
    try:
        yield Stack(dev, written, pg_server.dsn, table, time.monotonic())
    finally:
        dev.stop()  # before the outbox schema is dropped
        with psycopg.connect(pg_server.dsn, autocommit=True) as db:
            db.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))


def _history_of_every_partition(stack: Stack, minimum: int = 2) -> None:
    try:
        stack.dev.wait_for(
            f"{minimum} materializations in every partition's history",
            lambda: all(len(_history(stack.dev, key)) >= minimum for key in stack.written.keys),
            deadline_s=180,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nrelay runs: {_relay_runs(stack.dev)}") from None


def _relay_runs(dev: DagsterDev) -> list[tuple[str, str]]:
    """(job, status) of every relay run, to explain a failure."""
    data = dev.graphql(
        """
        { runsOrError(filter: {pipelineName: "relay_stream"}) { ... on Runs { results { jobName status } } } }
        """
    )
    return [(run["jobName"], run["status"]) for run in data["runsOrError"]["results"]]


def _relay_run_reasons(dev: DagsterDev) -> list[str]:
    data = dev.graphql(
        '{ runsOrError(filter: {pipelineName: "relay_stream"}) { ... on Runs { results { tags { key value } } } } }'
    )
    return [
        tag["value"] for run in data["runsOrError"]["results"] for tag in run["tags"] if tag["key"] == "outbox/reason"
    ]


def _history(dev: DagsterDev, key: str) -> list[dict[str, Any]]:
    """The partition's materializations, newest first, as its page in the Catalog shows them."""
    data = dev.graphql(
        """
        query ($key: String!) {
          assetNodeOrError(assetKey: {path: ["relayed_outbox"]}) {
            ... on AssetNode { assetMaterializations(partitions: [$key], limit: 100) {
                runId metadataEntries { label ... on IntMetadataEntry { intValue } } } }
          }
        }
        """,
        {"key": key},
    )
    return list(data["assetNodeOrError"]["assetMaterializations"])


def _materialized_partitions(dev: DagsterDev) -> set[str]:
    data = dev.graphql(
        """
        { assetNodeOrError(assetKey: {path: ["relayed_outbox"]}) {
            ... on AssetNode { assetPartitionStatuses { ... on DefaultPartitionStatuses { materializedPartitions } } }
        } }
        """
    )
    return set(data["assetNodeOrError"]["assetPartitionStatuses"]["materializedPartitions"])


def _lag_check_history(dev: DagsterDev) -> list[tuple[str, str]]:
    data = dev.graphql(
        """
        { assetCheckExecutions(assetKey: {path: ["outbox_backlog"]}, checkName: "outbox_lag_slo", limit: 5) {
            runId status
        } }
        """
    )
    return [(e["runId"], e["status"]) for e in data["assetCheckExecutions"]]


def test_the_lag_check_history_fills_with_passing_evaluations_made_without_runs(stack: Stack) -> None:
    stack.dev.wait_for("two outbox_lag_slo evaluations", lambda: len(_lag_check_history(stack.dev)) >= 2, 60)

    assert set(_lag_check_history(stack.dev)) == {("", "SUCCEEDED")}  # runless: the sensor evaluated them


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium): no screenshot")
def test_a_partitions_page_is_captured_by_headless_chromium(stack: Stack) -> None:
    _history_of_every_partition(stack, minimum=2)
    key = stack.written.keys[0]
    stack.dev.graphql("mutation { setNuxSeen }")  # the first-run dialog would cover the page
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / "dagster-partition-history.png"  # one file, replaced by each run
    path.unlink(missing_ok=True)
    query = urllib.parse.urlencode({"view": "partitions", "partition": key})

    subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--window-size=1600,900",
            "--virtual-time-budget=15000",
            f"--screenshot={path}",
            f"{stack.dev.url}/assets/relayed_outbox?{query}",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )

    assert path.stat().st_size > 10_000
    print(f"screenshot of partition {key}'s page: {path}")


def _launch(dev: DagsterDev, job: str, tags: dict[str, str] | None = None) -> str:
    """What the UI's Materialize / Launch run button sends."""
    data = dev.graphql(
        """
        mutation ($params: ExecutionParams!) {
          launchRun(executionParams: $params) {
            __typename
            ... on LaunchRunSuccess { run { runId } }
            ... on Error { message }
          }
        }
        """,
        {
            "params": {
                "selector": {"repositoryLocationName": LOCATION, "repositoryName": "__repository__", "jobName": job},
                "runConfigData": {},
                "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]},
            }
        },
    )
    launched = data["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return str(launched["run"]["runId"])


def _run_status(dev: DagsterDev, run_id: str) -> str:
    data = dev.graphql("query ($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }", {"id": run_id})
    return str(data["runOrError"]["status"])


@pytest.mark.spark
def test_the_spark_jobs_launched_as_from_the_ui_succeed_and_the_maintenance_schedule_is_running(
    stack: Stack,
) -> None:
    today = time.strftime("%Y-%m-%d", time.gmtime())
    runs = {
        "outbox_partition_maintenance_job": _launch(
            stack.dev, "outbox_partition_maintenance_job", {"dagster/partition": today}
        ),
        "bulk_drain_job": _launch(stack.dev, "bulk_drain_job"),
    }
    done = {"SUCCESS", "FAILURE", "CANCELED"}
    stack.dev.wait_for(
        "both Spark runs to finish",
        lambda: all(_run_status(stack.dev, run) in done for run in runs.values()),
        deadline_s=240,
    )
    assert {job: _run_status(stack.dev, run) for job, run in runs.items()} == dict.fromkeys(runs, "SUCCESS")

    data = stack.dev.graphql(
        f"""
        {{ scheduleOrError(scheduleSelector: {{repositoryLocationName: "{LOCATION}", repositoryName: "__repository__",
                                              scheduleName: "outbox_partition_maintenance_schedule"}}) {{
            ... on Schedule {{ cronSchedule scheduleState {{ status }} }}
        }} }}
        """
    )
    schedule = data["scheduleOrError"]
    assert (schedule["cronSchedule"], schedule["scheduleState"]["status"]) == ("15 0 * * *", "RUNNING")


# After the other tests: it waits for a minute of the stack, which they fill.
def test_dagster_dev_keeps_one_long_lived_run_that_records_every_partitions_history_without_a_queue(
    stack: Stack, kafka: KafkaProbe
) -> None:
    _history_of_every_partition(stack, minimum=2)
    stack.dev.wait_for("a minute of dagster dev", lambda: time.monotonic() - stack.started >= 60, 60)

    assert _materialized_partitions(stack.dev) >= set(stack.written.keys)
    arrived = message_ids(kafka.consume(stack.written.topic, expect=90))
    assert set(arrived) == {m for ids in stack.written.by_key.values() for m in ids}
    runs = _relay_runs(stack.dev)
    # One run for every partition, none queued; the reasons the sensor gave explain a second one.
    assert runs == [("relay_stream", "STARTED")], f"{runs}: requested for {_relay_run_reasons(stack.dev)}"
    published = {
        key: sum(
            e.get("intValue") or 0
            for m in _history(stack.dev, key)
            for e in m["metadataEntries"]
            if e["label"] == "rows_published"
        )
        for key in stack.written.keys
    }
    assert published == {key: len(ids) for key, ids in stack.written.by_key.items()}


def test_stopping_dagster_dev_stops_the_relay_run_cleanly(stack: Stack) -> None:
    """Last in this module: it stops the stack. A clean stop deregisters the run's worker; a killed one would
    stay registered (no other worker is left to reap it)."""
    _history_of_every_partition(stack, minimum=1)

    stack.dev.stop()

    with psycopg.connect(stack.dsn, autocommit=True) as db:
        workers = db.execute(sql.SQL("SELECT worker_id FROM {}").format(stack.table.workers)).fetchall()
    assert workers == []
