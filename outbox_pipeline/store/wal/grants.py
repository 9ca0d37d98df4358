"""Who may emit under a wal outbox's prefix, because `pg_logical_emit_message` is PUBLIC as PostgreSQL ships it. See
docs/wal.md#who-may-emit."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ...config import OutboxTable
from ...errors import SchemaError

log = logging.getLogger(__name__)

# The outbox's functions a writer is granted (SQL enqueue, the Python writer's two); a plain INSERT needs the table's.
WRITER_FUNCTIONS = ("enqueue", "outbox_emit_one", "outbox_emit_many")
# Fired by the INSERT trigger, or called from the functions above as their owner: no role needs them granted.
INNER_FUNCTIONS = ("outbox_emit", "outbox_emit_row", "wal_content")

# Every overload of pg_logical_emit_message (3 arguments up to 16, 4 with a default `flush` from 17), as GRANT names
# it: whether PUBLIC may call it, whether this role may revoke that (its owner's), and whether it is the bytea form.
_OVERLOADS = """
    SELECT format('pg_catalog.pg_logical_emit_message(%s)', oidvectortypes(p.proargtypes)),
           has_function_privilege('public', p.oid, 'EXECUTE'),
           pg_has_role(current_user, p.proowner, 'USAGE'),
           p.proargtypes[2] = 'bytea'::regtype
    FROM pg_proc p
    WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
    ORDER BY 1
"""

# The outbox's emitting functions PUBLIC may still call, or that do not run as their owner (made before the grants).
_OPEN_FUNCTIONS = """
    SELECT p.proname FROM pg_proc p
    WHERE p.pronamespace = (SELECT n.oid FROM pg_namespace n WHERE n.nspname = %s) AND p.proname = ANY(%s)
      AND (has_function_privilege('public', p.oid, 'EXECUTE') OR NOT p.prosecdef)
    ORDER BY 1
"""


@dataclass(frozen=True)
class Exposure:
    """What lets a role without a writer's grant emit under the outbox's prefix; nothing when it is closed."""

    public_overloads: tuple[str, ...]  # pg_logical_emit_message forms PUBLIC may execute
    open_functions: tuple[str, ...]  # the outbox's emitting functions not yet closed by init-db
    statements: tuple[str, ...]  # what a superuser runs in the database to close the first
    database: str

    @property
    def exposed(self) -> bool:
        return bool(self.public_overloads or self.open_functions)

    def describe(self) -> str:
        """One line for init-db, status and the logs."""
        if not self.exposed:
            return "writers: only the roles granted the outbox's functions can emit under its prefix"
        parts = []
        if self.public_overloads:
            parts.append(
                "any role in the database can publish under the outbox's prefix (pg_logical_emit_message is "
                f"executable by PUBLIC): as a superuser, in the database {self.database!r}, run: "
                f"{' '.join(self.statements)}"
            )
        if self.open_functions:
            parts.append(
                f"the outbox's functions {', '.join(self.open_functions)} are open to every role: run `outbox "
                "init-db --strategy wal` (it makes them run as their owner and revokes them from PUBLIC)"
            )
        return "EXPOSED: " + "; and ".join(parts)


def exposure(conn: psycopg.Connection, table: OutboxTable) -> Exposure:
    """The outbox's exposure as it stands (read only)."""
    overloads = conn.execute(_OVERLOADS).fetchall()
    public = tuple(name for name, is_public, _, _ in overloads if is_public)
    rows = conn.execute(_OPEN_FUNCTIONS, (table.schema, list(WRITER_FUNCTIONS))).fetchall()
    owner = _functions_owner(conn, table)
    statements: list[str] = []
    if public:
        statements += [
            f"GRANT EXECUTE ON FUNCTION {name} TO {sql.Identifier(owner).as_string(conn)};"
            for name, _, _, is_bytea in overloads
            if is_bytea and owner is not None  # the functions' owner, when no superuser, keeps its right
        ]
        statements += [f"REVOKE EXECUTE ON FUNCTION {name} FROM PUBLIC;" for name in public]
    return Exposure(public, tuple(name for (name,) in rows), tuple(statements), conn.info.dbname)


def restrict(conn: psycopg.Connection, table: OutboxTable) -> Exposure:
    """In init-db's transaction, after objects.install_functions: the outbox's functions closed to PUBLIC, and
    pg_logical_emit_message too where this role owns it (a superuser); what stays open is logged and returned."""
    for name in (*WRITER_FUNCTIONS, *INNER_FUNCTIONS):
        conn.execute(sql.SQL("REVOKE ALL ON FUNCTION {} FROM PUBLIC").format(table.ident(name)))
    owner = _functions_owner(conn, table)
    for name, is_public, may_revoke, is_bytea in conn.execute(_OVERLOADS).fetchall():
        if is_bytea and may_revoke and owner is not None:  # an owner that is no superuser keeps its right
            conn.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(sql.SQL(name), sql.Identifier(owner)))
        if is_public and may_revoke:
            conn.execute(sql.SQL("REVOKE EXECUTE ON FUNCTION {} FROM PUBLIC").format(sql.SQL(name)))
    left = exposure(conn, table)
    if left.exposed:
        log.warning("wal outbox %r: %s", table.schema, left.describe())
    return left


def emit_function(conn: psycopg.Connection) -> str:
    """The form of pg_logical_emit_message the outbox's functions call (its bytea one), as GRANT and REVOKE name it."""
    for name, _, _, is_bytea in conn.execute(_OVERLOADS).fetchall():
        if is_bytea:
            return str(name)
    raise SchemaError("this server has no pg_logical_emit_message(boolean, text, bytea): the wal strategy needs it")


def require_emit_right(conn: psycopg.Connection) -> None:
    """Refused before init-db makes anything when its role may not call pg_logical_emit_message (a superuser revoked
    it from PUBLIC and granted it to nobody here): the outbox's functions would run as this role and fail."""
    name = emit_function(conn)
    row = conn.execute("SELECT has_function_privilege(%s, 'EXECUTE'), current_user", (name,)).fetchone()
    if row is None or row[0]:
        return
    role = sql.Identifier(str(row[1])).as_string(conn)
    raise SchemaError(
        f"the role {role} may not call {name} in the database {conn.info.dbname!r} (PUBLIC may not: a superuser "
        "revoked it), and the wal outbox's functions emit as the role that runs init-db: as a superuser, in that "
        f"database, run `GRANT EXECUTE ON FUNCTION {name} TO {role};` and run `outbox init-db --strategy wal` "
        "again; nothing was created"
    )


def _functions_owner(conn: psycopg.Connection, table: OutboxTable) -> str | None:
    """The role the outbox's functions run as, unless it is a superuser (who needs no grant)."""
    row = conn.execute(
        """
        SELECT r.rolname FROM pg_proc p JOIN pg_roles r ON r.oid = p.proowner
        WHERE p.pronamespace = (SELECT n.oid FROM pg_namespace n WHERE n.nspname = %s) AND p.proname = 'outbox_emit'
          AND NOT r.rolsuper
        """,
        (table.schema,),
    ).fetchone()
    return None if row is None else str(row[0])
