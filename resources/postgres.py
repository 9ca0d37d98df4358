"""Dagster room: PostgreSQL resource (libpq DSN from OUTBOX_PG_DSN, schema by config)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from dagster import ConfigurableResource

from outbox_pipeline.config import DEFAULT_SCHEMA, OutboxTable, redact_dsn


class PostgresResource(ConfigurableResource):
    """Where the outbox lives. The DSN is a secret-bearing string: only its redacted form is shown."""

    dsn: str
    schema_name: str = DEFAULT_SCHEMA

    @property
    def table(self) -> OutboxTable:
        return OutboxTable(schema=self.schema_name)

    @property
    def display_dsn(self) -> str:
        return redact_dsn(self.dsn)

    @contextmanager
    def connect(self, *, autocommit: bool = True) -> Iterator[psycopg.Connection]:
        with psycopg.connect(self.dsn, autocommit=autocommit) as conn:
            yield conn
