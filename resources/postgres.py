"""The PostgreSQL resource: a libpq DSN, the schema, and a pool that lives exactly as long as the execution using it.
See docs/dagster.md#resources."""

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout
from pydantic import Field, PrivateAttr

from outbox_pipeline import server
from outbox_pipeline.config import DEFAULT_SCHEMA, OutboxTable, check_dsn, redact_dsn


class PostgresResource(dg.ConfigurableResource):
    """Where the outbox lives. The DSN is a secret-bearing string: only its redacted form is shown."""

    dsn: str = Field(description="libpq DSN or postgresql:// URI (set it with EnvVar: it may hold a password)")
    schema_name: str = Field(default=DEFAULT_SCHEMA, description="schema of the outbox tables")
    pool_max_size: int = Field(default=4, description="most connections the execution's pool opens")
    connect_timeout_s: float = Field(default=10.0, description="how long to wait for a pooled connection")

    _pool: ConnectionPool | None = PrivateAttr(default=None)

    @property
    def table(self) -> OutboxTable:
        return OutboxTable(schema=self.schema_name)

    @property
    def display_dsn(self) -> str:
        return redact_dsn(self.dsn)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        # Before the pool: its threads would log libpq's reason for an unparsable DSN, which may quote the password.
        check_dsn(self.dsn)
        # min_size=0: connections are made on first use, so a tick that never needs one costs nothing.
        self._pool = ConnectionPool(
            self.dsn,
            min_size=0,
            max_size=self.pool_max_size,
            kwargs={"autocommit": True},
            configure=server.configure,  # each pooled session as every engine session (jit off: server.py)
            open=True,
            name="outbox-dagster",
        )

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @contextmanager
    def connect(self, *, autocommit: bool = True) -> Iterator[psycopg.Connection]:
        """An autocommit session: from the execution's pool, or a fresh one outside an execution."""
        if self._pool is None or not autocommit:
            with server.connect(self.dsn, autocommit=autocommit, connect_timeout=int(self.connect_timeout_s)) as conn:
                yield conn
            return
        try:
            with self._pool.connection(timeout=self.connect_timeout_s) as conn:
                yield conn
        except PoolTimeout:
            raise psycopg.OperationalError(
                f"no PostgreSQL connection to {self.display_dsn} within {self.connect_timeout_s:g} s"
            ) from None
