"""The server's own `jit` for a line of a comparison or a latency bench's relay (`outbox bench --server-jit on,off`), so
a server with and without JIT is measured in one invocation. See docs/performance.md#the-servers-jit-in-a-comparison."""

from __future__ import annotations

import time

import psycopg
from psycopg import sql

_RELOAD_DEADLINE_S = 10.0
JIT_SUFFIX = " @ jit "  # after a line's or a relay's name: the server's jit it was measured at


def set_server_jit(dsn: str, value: str | None) -> None:
    """The server's default ``jit`` for new sessions: ``on``/``off``, or None for its configuration file's."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            if value is None:
                conn.execute("ALTER SYSTEM RESET jit")
            else:
                conn.execute(sql.SQL("ALTER SYSTEM SET jit = {}").format(sql.Literal(value)))
        except psycopg.errors.InsufficientPrivilege as exc:
            raise SystemExit(f"outbox bench --server-jit: ALTER SYSTEM needs a superuser: {exc}") from None
        conn.execute("SELECT pg_reload_conf()")
    if value is None:
        return
    deadline = time.monotonic() + _RELOAD_DEADLINE_S
    while True:  # the postmaster applies the reload on its own time; a new session shows when it has
        with psycopg.connect(dsn, autocommit=True) as probe:
            row = probe.execute("SELECT current_setting('jit')").fetchone()
        if row is not None and row[0] == value:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"outbox bench --server-jit: the server still says jit = {row} after a reload")
        time.sleep(0.05)
