"""Apache Kafka as the local broker: installed from the project's pom, a crash keeps what it acknowledged, a stop
leaves nothing running, and where the jars cannot be had the tests say why and run on Tansu."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from outbox_pipeline.localstack import (
    BrokerSpec,
    KafkaUnavailableError,
    LocalBroker,
    LocalKafka,
    free_port,
    install_kafka,
    local_broker,
)
from outbox_pipeline.settings import HOME
from tests.kit.kafka import KafkaProbe

CACHE_ROOT = Path(__file__).resolve().parents[3] / HOME.default


def _kafka(directory: Path) -> LocalKafka:
    try:
        install = install_kafka(CACHE_ROOT)
    except KafkaUnavailableError as exc:
        pytest.skip(str(exc))
    return LocalKafka(BrokerSpec(port=free_port(), log_path=directory / "broker.log"), directory / "data", install)


def test_kafka_killed_and_started_again_keeps_every_acknowledged_record_and_stop_leaves_nothing(
    tmp_path: Path,
) -> None:
    broker = _kafka(tmp_path)
    with broker:
        topic = f"crash-{uuid.uuid4().hex[:8]}"
        broker.create_topics([topic], partitions=2)
        probe = KafkaProbe(broker.bootstrap_servers)
        producer = probe.producer()
        for n in range(100):
            producer.produce(topic, key=str(n % 7), value=str(n))
        assert producer.flush(30) == 0
        broker.kill()
        assert broker.pid is None
        broker.start()
        values = sorted(int(r.value or b"") for r in probe.consume(topic, expect=100, deadline_s=30))
        pid = broker.pid
        assert pid is not None
    assert values == list(range(100))
    assert broker.pid is None and not os.path.exists(f"/proc/{pid}")


def test_without_maven_the_install_says_what_to_do_and_the_tests_run_on_tansu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    java = shutil.which("java")
    if java is None:
        pytest.skip("no java on PATH")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "java").symlink_to(java)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(KafkaUnavailableError, match=r"`mvn` is not on PATH .* OUTBOX_TEST_BROKER=tansu"):
        install_kafka(tmp_path / "cache")
    spec = BrokerSpec(port=free_port())
    with pytest.warns(RuntimeWarning, match="running on Tansu instead: cannot install Apache Kafka"):
        broker = local_broker("kafka", spec, tmp_path / "data", tmp_path / "cache")
    assert isinstance(broker, LocalBroker) and broker.name == "Tansu"
