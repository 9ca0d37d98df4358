"""Test kit (a pytest plugin): one real PostgreSQL and one real Kafka-protocol broker per session (Tansu, or Apache
Kafka with OUTBOX_TEST_BROKER=kafka), sessions on it, fresh topics per test. Nothing here mocks either server."""

from __future__ import annotations

import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from outbox_pipeline.localstack import Broker, BrokerSpec, LocalPostgres, PostgresSpec, free_port, local_broker
from outbox_pipeline.relay import KafkaPublisher
from outbox_pipeline.settings import HOME, TEST_BROKER, TEST_PG_BIN

from .kafka import KafkaProbe


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # A CI timeout or a plain `kill` sends SIGTERM, which would end pytest without teardown and leave
    # the servers (daemons) running: treat it like Ctrl-C, after which pytest runs every finalizer.
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_report_header(config: pytest.Config) -> str:
    return f"broker: {TEST_BROKER.read()} ({TEST_BROKER.name}; tansu or kafka)"


def server_under_test(data_dir: Path, settings: dict[str, str]) -> LocalPostgres:
    """A test server: the embedded wheel's, tuned, or (OUTBOX_TEST_PG_BIN) another build's at its own defaults,
    as a user who installed that package runs it (Debian's 15: JIT on, 128 MB of shared buffers). ``settings``
    are the test's needs, set on either: durability (not under test) and two-phase commit's slots."""
    bin_dir = TEST_PG_BIN.read()
    spec = PostgresSpec(
        data_dir=data_dir,
        port=free_port(),
        settings={"max_prepared_transactions": "20", **settings},
        bin_dir=Path(bin_dir) if bin_dir else None,
        tuned=not bin_dir,
    )
    return LocalPostgres(spec)


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    # Durability is not under test here (crash tests restart the server, not the OS).
    server = server_under_test(
        tmp_path_factory.mktemp("pg") / "data",
        {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"},
    )
    server.start()
    try:
        yield server
    finally:
        server.stop("fast", force=True)


def broker_under_test(directory: Path, *, advertised_port: int | None = None, port: int | None = None) -> Broker:
    """A test broker in ``directory`` (its output in broker.log, Apache Kafka's data under data/): the one
    OUTBOX_TEST_BROKER names, Apache Kafka's jars cached under the checkout's .outbox/ (or $OUTBOX_HOME)."""
    spec = BrokerSpec(
        port=port if port is not None else free_port(),
        log_path=directory / "broker.log",
        advertised_port=advertised_port,
    )
    cache_root = Path(HOME.read()) if HOME.is_set() else Path(__file__).resolve().parents[2] / HOME.default
    return local_broker(TEST_BROKER.read(), spec, directory / "data", cache_root)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    server = broker_under_test(tmp_path_factory.mktemp("broker"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def dsn(pg_server: LocalPostgres) -> str:
    return pg_server.dsn


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def kafka(broker: Broker) -> KafkaProbe:
    return KafkaProbe(broker.bootstrap_servers)


@pytest.fixture
def new_topic(broker: Broker) -> Callable[..., str]:
    """Create a uniquely named topic (so tests never read each other's records)."""

    def create(prefix: str = "t", partitions: int = 1) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        broker.create_topics([name], partitions=partitions)
        return name

    return create


@pytest.fixture
def connect(dsn: str) -> Iterator[Callable[[], psycopg.Connection]]:
    """Extra autocommit sessions (one per simulated worker), closed after the test."""
    opened: list[psycopg.Connection] = []

    def open_one() -> psycopg.Connection:
        conn = psycopg.connect(dsn, autocommit=True)
        opened.append(conn)
        return conn

    yield open_one
    for conn in opened:
        conn.close()


@pytest.fixture
def publisher(kafka: KafkaProbe) -> Iterator[KafkaPublisher]:
    pub = KafkaPublisher({"bootstrap.servers": kafka.bootstrap_servers, "message.timeout.ms": 10_000})
    yield pub
    pub.close()


@pytest.fixture
def open_transaction(connect: Callable[[], psycopg.Connection]) -> Iterator[psycopg.Connection]:
    """A session with a transaction left open after a write (``over_lunch`` in its query), as a forgotten
    BEGIN in psql: it holds the xmin horizon until the test ends (rolled back then)."""
    lunch = connect()
    lunch.execute("BEGIN")
    lunch.execute("SELECT pg_current_xact_id() AS over_lunch")
    yield lunch
    if not lunch.closed:
        lunch.execute("ROLLBACK")


def snapshot_data_dir(server: LocalPostgres, to: Path) -> None:
    """A storage snapshot of a stopped server (``pg_ctl stop -m immediate`` leaves a crash-consistent one): its data
    directory copied with owners and modes, as a volume snapshot keeps them."""
    subprocess.run(["cp", "-a", str(server.spec.data_dir), str(to)], check=True)


def restore_data_dir(server: LocalPostgres, snapshot: Path) -> None:
    """The stopped server's data directory replaced by ``snapshot`` (snapshot_data_dir): a restored volume."""
    shutil.rmtree(server.spec.data_dir)
    subprocess.run(["cp", "-a", str(snapshot), str(server.spec.data_dir)], check=True)
