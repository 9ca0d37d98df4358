"""Secrets stay secret, hostile names stay names, and local servers listen on loopback only."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.assets import outbox_backlog
from outbox_pipeline.config import REDACTED, kafka_config_from_env, redact_dsn, redact_kafka_config
from outbox_pipeline.localstack import LocalBroker, LocalPostgres, free_port
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources import PostgresResource
from outbox_pipeline.store import init_db
from tests.kit.kafka import KafkaProbe
from tests.kit.net import LOOPBACK, listening_hosts
from tests.kit.relay import drain, message_ids

ROOT = Path(__file__).resolve().parents[3]
DB_SECRET = "pg-Secr3t-do-not-log"
KAFKA_SECRET = "kafka-Secr3t-do-not-log"


def _dsn_with_password(dsn: str) -> str:
    # The test server trusts loopback connections, so the password is carried but never checked.
    return f"{dsn} password={DB_SECRET}"


def test_redacted_forms_hide_passwords_and_secret_properties() -> None:
    assert DB_SECRET not in redact_dsn(f"host=h user=u password={DB_SECRET} dbname=d")
    assert DB_SECRET not in redact_dsn(f"postgresql://u:{DB_SECRET}@h:5432/d")
    config = kafka_config_from_env(
        {"KAFKA_BOOTSTRAP_SERVERS": "h:9092", "KAFKA_SASL_PASSWORD": KAFKA_SECRET, "KAFKA_SSL_KEY_PASSWORD": "x"}
    )
    assert config["sasl.password"] == KAFKA_SECRET
    assert KAFKA_SECRET not in str(redact_kafka_config(config))


# Every librdkafka property that can hold a secret (CONFIGURATION.md), and libpq's secret keywords.
SECRET_KAFKA_PROPERTIES = [
    "sasl.password",
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.client.secret",
    "sasl.jaas.config",
    "sasl.kerberos.keytab",
    "ssl.key.password",
    "ssl.key.pem",
    "ssl_key",
    "ssl.keystore.password",
    "ssl.certificate.pem",
    "ssl.ca.pem",
    "ssl.engine.callback.data.passphrase",
    "custom.credentials",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem",
]
SHOWN_KAFKA_PROPERTIES = [
    "bootstrap.servers",
    "sasl.username",
    "sasl.mechanism",
    "security.protocol",
    "ssl.key.location",
]


@pytest.mark.parametrize("name", SECRET_KAFKA_PROPERTIES)
def test_every_secret_like_kafka_property_is_redacted(name: str) -> None:
    assert redact_kafka_config({name: KAFKA_SECRET, "bootstrap.servers": "h:9092"}) == {
        name: REDACTED,
        "bootstrap.servers": "h:9092",
    }


@pytest.mark.parametrize("name", SHOWN_KAFKA_PROPERTIES)
def test_kafka_properties_that_hold_no_secret_are_shown(name: str) -> None:
    assert redact_kafka_config({name: "value"}) == {name: "value"}


@pytest.mark.parametrize("keyword", ["password", "sslpassword"])
def test_every_secret_libpq_keyword_is_redacted(keyword: str) -> None:
    shown = redact_dsn(f"host=h user=u dbname=d {keyword}={DB_SECRET} sslkey=/k.pem")
    assert DB_SECRET not in shown and "sslkey=/k.pem" in shown and "user=u" in shown


def test_the_relay_command_never_prints_the_database_password_or_kafka_secrets(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"n": i}) for i in range(20)], table=table)
    env = dict(
        os.environ,
        OUTBOX_PG_DSN=_dsn_with_password(dsn),
        OUTBOX_SCHEMA=table.schema,
        KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
        KAFKA_SASL_USERNAME="relay",
        KAFKA_SASL_PASSWORD=KAFKA_SECRET,  # carried in the config; the local broker needs no auth
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "outbox_pipeline.cli",
            "-v",
            "relay",
            "--strategy",
            "locking",
            "--workers",
            "1",
            "--until-empty",
            "--max-seconds",
            "60",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert "published=20" in output, output[-2000:]
    assert DB_SECRET not in output and KAFKA_SECRET not in output


def test_an_unreachable_database_is_reported_without_its_password(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        OUTBOX_PG_DSN=f"host=127.0.0.1 port={free_port()} user=u password={DB_SECRET} connect_timeout=2",
        KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1",
    )
    result = subprocess.run(
        [sys.executable, "-m", "outbox_pipeline.cli", "relay", "--strategy", "locking", "--until-empty"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "password=***" in result.stderr or "cannot reach PostgreSQL" in result.stderr
    assert DB_SECRET not in result.stdout + result.stderr


def test_dagster_metadata_and_logs_never_show_the_database_password(dsn: str, table: OutboxTable) -> None:
    resource = PostgresResource(dsn=_dsn_with_password(dsn), schema_name=table.schema)
    result = dg.materialize(
        [outbox_backlog],
        resources={"postgres": resource, "orchestration": OrchestrationSettings(strategy="partitioned")},
    )
    assert result.success
    events = "\n".join(str(event) for event in result.all_events)
    assert "pending_rows" in events
    assert DB_SECRET not in events
    assert DB_SECRET not in resource.display_dsn


def test_hostile_schema_topic_key_and_payload_are_stored_and_relayed_verbatim(
    dsn: str, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    hostile = OutboxTable(schema="o'; DROP SCHEMA public CASCADE; --\"x")
    topic = new_topic("drop.table_x-")
    key = "k'); DELETE FROM outbox_messages; --"
    payload = {"q": "'; TRUNCATE x; --", "b": '\\"\\u0041'}
    with psycopg.connect(dsn, autocommit=True) as conn:
        init_db(conn, hostile)
        [written] = enqueue_many(conn, [Message(topic, payload, key=key, type="t'--")], table=hostile)
        stats = drain(dsn, hostile, kafka.bootstrap_servers, "partitioned")
        [record] = kafka.consume(topic, expect=1)
        assert stats.published == 1 and message_ids([record]) == [str(written.message_id)]
        assert record.key == key.encode()
        assert conn.execute("SELECT to_regnamespace('public') IS NOT NULL").fetchone() == (True,)
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(hostile.schema_ident))


def test_local_postgres_and_broker_listen_on_loopback_only(pg_server: LocalPostgres, broker: LocalBroker) -> None:
    assert listening_hosts(pg_server.spec.port) == {LOOPBACK}
    assert listening_hosts(broker.spec.port) == {LOOPBACK}


# DSNs libpq cannot parse, each carrying the secret: psycopg's error quotes the token it choked on, or the whole DSN.
MALFORMED_DSNS = [
    f"postgresql://app:p%zz{DB_SECRET}@127.0.0.1/db",  # an invalid percent-encoding in the password
    f"postgresql+psycopg://app:{DB_SECRET}@127.0.0.1/db",  # SQLAlchemy's URL
    f"host=127.0.0.1 password='{DB_SECRET}",  # an unterminated quote
]


@pytest.mark.parametrize("command", [["status", "--strategy", "partitioned"], ["relay", "--strategy", "locking"]])
@pytest.mark.parametrize("malformed", MALFORMED_DSNS)
def test_a_malformed_dsn_is_refused_with_a_clear_error_that_never_shows_its_password(
    malformed: str, command: list[str]
) -> None:
    env = dict(os.environ, OUTBOX_PG_DSN=malformed, KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    result = subprocess.run(
        [sys.executable, "-m", "outbox_pipeline.cli", *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "error: the PostgreSQL DSN is not valid" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert DB_SECRET not in result.stdout + result.stderr


@pytest.mark.parametrize("malformed", MALFORMED_DSNS)
def test_a_dagster_step_on_a_malformed_dsn_fails_without_showing_its_password(malformed: str) -> None:
    resource = PostgresResource(dsn=malformed, schema_name="outbox")
    result = dg.materialize(
        [outbox_backlog],
        resources={"postgres": resource, "orchestration": OrchestrationSettings()},
        raise_on_error=False,
    )
    assert not result.success
    events = "\n".join(str(event) for event in result.all_events)
    assert "the PostgreSQL DSN is not valid" in events
    assert DB_SECRET not in events
