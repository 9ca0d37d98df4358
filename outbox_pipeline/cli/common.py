"""What every command shares: the database flags, connections, Kafka config, flag types. See
docs/operations.md#command-line."""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import logging
import os
import socket

import psycopg

from .. import server
from ..config import (
    OutboxTable,
    check_dsn,
    kafka_config_from_env,
    parse_timestamp,
    pg_dsn_from_env,
    redact_kafka_config,
)
from ..errors import ConfigurationError, OutboxError
from ..relay.publisher import check_producer_config
from ..store import schema
from ..strategies import strategy_class
from ..strategies.base import Strategy

log = logging.getLogger("outbox")


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (a partition count of 0 reached the database as a CHECK violation)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def topic_partitions(text: str) -> tuple[str, int]:
    """An argparse type: ``NAME:PARTITIONS``."""
    name, colon, count = text.rpartition(":")
    if not colon or not name:
        raise argparse.ArgumentTypeError(f"expected NAME:PARTITIONS (a topic and its partition count), got {text!r}")
    return name, positive_int(count)


def header_pair(text: str) -> tuple[str, str]:
    """An argparse type: ``NAME=VALUE``."""
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def add_db_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", help="libpq DSN or URI (default: $OUTBOX_PG_DSN)")
    parser.add_argument("--schema", help="schema holding the outbox tables (default: $OUTBOX_SCHEMA or 'outbox')")


def table_of(args: argparse.Namespace) -> OutboxTable:
    base = OutboxTable.from_env()
    return OutboxTable(schema=args.schema or base.schema, max_message_bytes=base.max_message_bytes)


def dsn_of(args: argparse.Namespace) -> str:
    if args.dsn:
        check_dsn(args.dsn)
        return str(args.dsn)
    return pg_dsn_from_env()


def strategy_named(name: str) -> type[Strategy]:
    try:
        return strategy_class(name)
    except ImportError as exc:
        raise OutboxError(f"strategy {name!r} is not available in this installation ({exc})") from None


def kafka_config_of(args: argparse.Namespace) -> dict[str, str]:
    """``KAFKA_*`` from the environment, ``--bootstrap-servers`` winning; checked by building a producer."""
    env = dict(os.environ)
    if args.bootstrap_servers:
        env["KAFKA_BOOTSTRAP_SERVERS"] = args.bootstrap_servers
    config = kafka_config_from_env(env)
    check_producer_config(config)
    log.debug("kafka config: %s", redact_kafka_config(config))
    return config


def connect(args: argparse.Namespace) -> psycopg.Connection:
    conn = server.connect(dsn_of(args), autocommit=True)
    try:
        schema.require_current(conn, table_of(args))
    except BaseException:
        conn.close()
        raise
    return conn


def timestamp_arg(text: str) -> dt.datetime:
    """ISO-8601; a time without an offset is UTC (argparse reports the error with the flag's name)."""
    try:
        return parse_timestamp(text)
    except ConfigurationError:
        raise argparse.ArgumentTypeError(f"not an ISO-8601 timestamp: {text!r}") from None


def operator_name() -> str:
    """Who ran an operator action, as recorded with it."""
    return f"{getpass.getuser()}@{socket.gethostname()} (outbox CLI)"
