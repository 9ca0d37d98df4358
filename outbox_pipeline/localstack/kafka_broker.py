"""Apache Kafka for the tests, the bench and optionally `make dev`: one KRaft node from Maven Central's jars, sized for
a shared 2-core machine. See docs/operations.md#the-broker-tansu-in-development-apache-kafka-in-production."""

from __future__ import annotations

import base64
import fcntl
import hashlib
import logging
import shutil
import subprocess
import uuid
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .broker import Broker, BrokerSpec, LocalBroker, ProcessBroker
from .ports import LocalStackError, ensure_port_free, free_port

_log = logging.getLogger(__name__)
_MVN_TIMEOUT_S = 900.0
_FORMAT_TIMEOUT_S = 120.0
_OUTPUT_TAIL_CHARS = 3000
# Small and quiet: a test broker. SerialGC and C1 only keep an idle JVM near zero CPU and start it sooner (a bench
# measuring the broker at load may pass its own, without -XX:TieredStopAtLevel=1).
JVM_OPTIONS = (
    "-Xms64m",
    "-Xmx512m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
# What Kafka's own start scripts run a broker with (kafka-server-start.sh's KAFKA_HEAP_OPTS, kafka-run-class.sh's
# KAFKA_JVM_PERFORMANCE_OPTS): the bench measures the broker users run, compiled by C2 and collected by G1, not the
# test broker above (docs/performance.md: its cores and p99 at 2,000 msg/s against these).
SERVER_JVM_OPTIONS = (
    "-Xms1g",
    "-Xmx1g",
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
)
_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = out
logger.started.name = kafka.server.KafkaRaftServer
logger.started.level = INFO
"""


class KafkaUnavailableError(LocalStackError):
    """Apache Kafka's jars cannot be had here (no java, no mvn, or Maven Central out of reach)."""


@dataclass(frozen=True)
class KafkaInstall:
    """Where the broker's jars are (``libs``), copied for one version of the pom."""

    root: Path

    @property
    def libs(self) -> Path:
        return self.root / "libs"

    @property
    def classpath(self) -> str:
        return f"{self.libs}/*"


def _pom() -> bytes:
    return resources.files("outbox_pipeline.localstack").joinpath("kafka/pom.xml").read_bytes()


def install_kafka(cache_root: Path) -> KafkaInstall:
    """The jars of ``kafka/pom.xml`` under ``cache_root/kafka/<pom digest>``, copied by Maven the first time (a
    stamp marks a complete copy; concurrent callers wait on a lock). Raises KafkaUnavailableError saying why and what
    to do."""
    pom = _pom()
    install = KafkaInstall(cache_root.resolve() / "kafka" / hashlib.sha256(pom).hexdigest()[:12])
    stamp = install.root / ".installed"
    if stamp.exists():
        return install
    for tool in ("java", "mvn"):
        if shutil.which(tool) is None:
            raise KafkaUnavailableError(
                f"cannot install Apache Kafka: `{tool}` is not on PATH (install OpenJDK 17+ and Maven 3.8+, e.g. "
                "`apt-get install openjdk-17-jre-headless maven`), or use Tansu: OUTBOX_TEST_BROKER=tansu"
            )
    install.root.mkdir(parents=True, exist_ok=True)
    with (install.root.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not stamp.exists():
            _copy_dependencies(install, pom)
            stamp.touch()
    return install


def _copy_dependencies(install: KafkaInstall, pom: bytes) -> None:
    (install.root / "pom.xml").write_bytes(pom)
    staging = install.root / "libs.partial"
    shutil.rmtree(staging, ignore_errors=True)
    cmd = [
        "mvn",
        "-q",
        "-B",
        "-f",
        str(install.root / "pom.xml"),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={staging}",
        "-Dmdep.includeScope=runtime",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_MVN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise KafkaUnavailableError(
            f"cannot install Apache Kafka: `{' '.join(cmd)}` took over {_MVN_TIMEOUT_S:.0f}s (is Maven Central "
            "reachable?); or use Tansu: OUTBOX_TEST_BROKER=tansu"
        ) from None
    if done.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
        output = (done.stdout + done.stderr).strip()[-_OUTPUT_TAIL_CHARS:]
        raise KafkaUnavailableError(
            f"cannot install Apache Kafka: `{' '.join(cmd)}` exited with {done.returncode}. Maven must reach "
            "repo.maven.apache.org (or a mirror set in ~/.m2/settings.xml); run the command to see why, or use Tansu: "
            f"OUTBOX_TEST_BROKER=tansu\n{output}"
        )
    shutil.rmtree(install.libs, ignore_errors=True)
    staging.rename(install.libs)


def new_cluster_id() -> str:
    """A KRaft cluster id as Kafka's ``Uuid.randomUuid().toString()`` makes one (saves a JVM start of StorageTool)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


class LocalKafka(ProcessBroker):
    """One Apache Kafka KRaft node in ``data_dir`` (its config and, under ``log``, its data): ``kill()`` and
    ``restart()`` keep the data, so a fault test can crash the broker and find every acknowledged record after.

    Clients use ``spec.port`` (advertised as ``spec.advertised_port`` when a proxy fronts it); the node talks to
    itself (transaction markers, the controller) on ports of its own, so cutting the proxy cuts only the clients.
    """

    name = "Apache Kafka"
    durable = True
    ready_deadline_s = 90.0

    def __init__(
        self, spec: BrokerSpec, data_dir: Path, install: KafkaInstall, jvm_options: tuple[str, ...] = JVM_OPTIONS
    ) -> None:
        super().__init__(spec)
        self._data_dir = data_dir
        self._install = install
        self._jvm_options = jvm_options
        self._internal_port = free_port(spec.host)
        self._controller_port = free_port(spec.host)

    @property
    def data_dir(self) -> Path:
        return self._data_dir

    def _command(self) -> list[str]:
        for port, what in ((self._internal_port, "internal"), (self._controller_port, "controller")):
            ensure_port_free(self._spec.host, port, f"Apache Kafka's {what} listener")
        self._data_dir.mkdir(parents=True, exist_ok=True)
        config = self._data_dir / "server.properties"
        config.write_text(self._server_properties())
        logging = self._data_dir / "log4j2.properties"
        logging.write_text(_LOG4J2)
        if not (self._data_dir / "log" / "meta.properties").exists():
            self._format(config)
        return [
            "java",
            *self._jvm_options,
            f"-Dlog4j2.configurationFile={logging}",
            "-cp",
            self._install.classpath,
            "kafka.Kafka",
            str(config),
        ]

    def _format(self, config: Path) -> None:
        """`kafka-storage.sh format --standalone`: this node is the only voter of a new cluster."""
        cmd = [
            "java",
            *self._jvm_options,
            "-cp",
            self._install.classpath,
            "kafka.tools.StorageTool",
            "format",
            "--standalone",
            "--cluster-id",
            new_cluster_id(),
            "--config",
            str(config),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_FORMAT_TIMEOUT_S, check=False)
        if done.returncode != 0:
            output = (done.stdout + done.stderr).strip()[-_OUTPUT_TAIL_CHARS:]
            raise LocalStackError(
                f"formatting Apache Kafka's storage in {self._data_dir / 'log'} failed (exit {done.returncode}); "
                f"remove that directory and start again\n{output}"
            )

    def _server_properties(self) -> str:
        host = self._url_host()
        advertised = self._spec.advertised_port if self._spec.advertised_port is not None else self._spec.port
        settings = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"{host}:{self._controller_port}",
            "listeners": (
                f"PLAINTEXT://{host}:{self._spec.port},INTERNAL://{host}:{self._internal_port},"
                f"CONTROLLER://{host}:{self._controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://{host}:{advertised},INTERNAL://{host}:{self._internal_port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "INTERNAL",
            "controller.listener.names": "CONTROLLER",
            "log.dirs": str(self._data_dir / "log"),
            # As Tansu: a producer may create a topic by writing to it (the tests' producers turn it off to see a
            # missing topic), with one partition.
            "auto.create.topics.enable": "true",
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            # A node killed -9 and started again registers only once the controller has expired its last session
            # (9 s by default): 3 s keeps a restart short, and a 0.5 s heartbeat keeps a live node registered.
            "broker.session.timeout.ms": "3000",
            "broker.heartbeat.interval.ms": "500",
            # Few threads and buffers: the defaults are sized for a server of its own.
            "num.network.threads": "2",
            "num.io.threads": "2",
            "background.threads": "2",
            "num.recovery.threads.per.data.dir": "1",
            "num.replica.fetchers": "1",
            "log.cleaner.threads": "1",
            "log.cleaner.dedupe.buffer.size": str(8 << 20),
        }
        return "".join(f"{key}={value}\n" for key, value in settings.items())


def local_broker(
    kind: str, spec: BrokerSpec, data_dir: Path, cache_root: Path, jvm_options: tuple[str, ...] = JVM_OPTIONS
) -> Broker:
    """The broker ``kind`` names (``tansu`` or ``kafka``, as OUTBOX_TEST_BROKER and OUTBOX_DEV_BROKER do). Apache Kafka
    whose jars cannot be had falls back to Tansu, with a warning that says why (its name shows which one runs)."""
    if kind == "tansu":
        return LocalBroker(spec)
    try:
        install = install_kafka(cache_root)
    except KafkaUnavailableError as exc:
        message = f"Apache Kafka is not available, running on Tansu instead: {exc}"
        _log.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return LocalBroker(spec)
    return LocalKafka(spec, data_dir, install, jvm_options)
