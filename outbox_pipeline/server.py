"""The PostgreSQL the engine runs on: the versions it supports (13 and newer), and the settings every engine session
sets for itself, `jit = off` first. See docs/operations.md#your-postgresql."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import psycopg
from psycopg import sql

from .config import check_dsn
from .errors import SchemaError

#: The oldest PostgreSQL the engine runs on (server_version_num), and why, for the refusal.
MIN_SERVER_VERSION = 130000
_WHY_13 = "xid8 transaction ids and pg_current_snapshot(), BEFORE INSERT triggers on partitioned tables"

#: What every engine session sets for itself (see the module's docstring).
SESSION_SETTINGS: Mapping[str, str] = MappingProxyType({"jit": "off"})
#: And from PostgreSQL 14 on: a relay's sessions are idle by design between wake-ups (LISTEN, the liveness lock), and
#: a server-wide idle_session_timeout would end them, and with them the worker's liveness, every few minutes.
SESSION_SETTINGS_14: Mapping[str, str] = MappingProxyType({"idle_session_timeout": "0"})


def connect(dsn: str, *, autocommit: bool = False, **kwargs: Any) -> psycopg.Connection:
    """A session of the engine's: ``psycopg.connect`` and the settings every engine session runs with."""
    check_dsn(dsn)  # a DSN libpq cannot parse would show in psycopg's error as it is, password and all
    conn = psycopg.connect(dsn, autocommit=autocommit, **kwargs)
    try:
        configure(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def configure(conn: psycopg.Connection, extra: Mapping[str, str] | None = None) -> None:
    """Set SESSION_SETTINGS and ``extra`` on ``conn`` for the session, in one round trip.

    Outside a transaction block, so a rollback cannot undo them (a setting made in a transaction that rolls back
    is rolled back with it); a connection in a transaction already is refused rather than committed for its caller.
    """
    since_14 = SESSION_SETTINGS_14 if conn.info.server_version >= 140000 else {}
    settings = {**SESSION_SETTINGS, **since_14, **(extra or {})}
    if not conn.autocommit and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise RuntimeError("configure() sets session settings: call it outside a transaction")
    # SET statements, not set_config() in a SELECT: a SELECT is planned, and would itself be JIT-compiled before its
    # jit = off takes effect. Several statements without parameters go as one simple query: one round trip.
    conn.execute(
        sql.SQL("; ").join(
            sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(value)) for name, value in settings.items()
        )
    )
    if not conn.autocommit:
        conn.commit()


def require_supported(conn: psycopg.Connection) -> None:
    """Refuse a server older than MIN_SERVER_VERSION with a message that says what to do."""
    refusal = version_refusal(conn.info.server_version)
    if refusal:
        raise SchemaError(refusal)


def version_refusal(server_version_num: int) -> str | None:
    """Why a server of this ``server_version_num`` cannot run the outbox, or None when it can."""
    if server_version_num >= MIN_SERVER_VERSION:
        return None
    if server_version_num >= 100000:
        major = str(server_version_num // 10000)
    else:  # 9.6 is 90600
        major = f"{server_version_num // 10000}.{server_version_num // 100 % 100}"
    return (
        f"PostgreSQL {major} is not supported: the outbox needs PostgreSQL 13 or newer ({_WHY_13}); "
        "upgrade the server (docs/operations.md, Your PostgreSQL)"
    )
