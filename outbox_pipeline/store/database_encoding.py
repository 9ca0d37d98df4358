"""What text the database itself can hold, whatever the client's encoding, so a writer refuses what the database could
not store. See docs/wal.md#writers."""

from __future__ import annotations

from collections.abc import Iterable

import psycopg
from psycopg._encodings import pg2pyenc

# Server encodings that hold every character a client sends: UTF8, and SQL_ASCII (bytes stored as they come).
_HOLDS_ALL = frozenset({"UTF8", "SQL_ASCII"})


def database_codec(conn: psycopg.Connection) -> str | None:
    """The Python codec of the database's encoding (``server_encoding``, reported at connect: no round trip); None
    when it holds any character, or when Python has no codec for it (the server's own conversion then decides)."""
    name = conn.info.parameter_status("server_encoding")
    if name is None or name in _HOLDS_ALL:
        return None
    try:
        return pg2pyenc(name.encode())
    except psycopg.NotSupportedError:
        return None


def unholdable(values: Iterable[str | None], codec: str) -> str | None:
    """The first character of ``values`` that ``codec`` cannot hold, or None."""
    for value in values:
        if value is None:
            continue
        try:
            value.encode(codec)
        except UnicodeEncodeError as exc:
            return exc.object[exc.start : exc.end]
    return None


def unholdable_message(character: str, conn: psycopg.Connection) -> str:
    """The error a writer gets for ``character``."""
    encoding = conn.info.parameter_status("server_encoding")
    return (
        f"{character!r} cannot be stored in this database, whose encoding is {encoding} (whatever the client's "
        "encoding: a dead letter or a held copy of the message would have to hold it): use a UTF8 database, or leave "
        "such characters out"
    )
