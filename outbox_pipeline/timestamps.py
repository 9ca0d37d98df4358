"""`created_at` carried as an integer and formatted to ISO-8601 once per distinct value, because the server's `to_char`
was half of the read's time. See docs/payloads.md#the-kafka-headers-the-relay-sets."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection

# PostgreSQL's binary timestamptz counts microseconds from this instant.
PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
# The header of a row stamped 'infinity' or outside datetime's years (PostgreSQL's go to 294276).
_BEYOND = {True: b"infinity", False: b"-infinity"}
# Formatted values kept per publisher; past this the cache starts over (a relay's rows are recent, so a
# few hundred distinct seconds are live at a time).
MAX_STAMPS = 65_536


def created_at_bounds(created: Collection[int]) -> dict[str, dt.datetime | str]:
    """``from`` and ``to`` query parameters spanning records' ``created_at``, so a statement on their ids is pruned
    to the daily partitions holding them; PostgreSQL's infinity past datetime's range (the bound must still cover
    such a row)."""
    return {"from": as_parameter(min(created)), "to": as_parameter(max(created))}


def as_parameter(micros: int) -> dt.datetime | str:
    """A binary timestamptz (microseconds since 2000-01-01 UTC) as a query parameter ('infinity' past its range)."""
    try:
        return PG_EPOCH + dt.timedelta(microseconds=micros)
    except OverflowError:
        return _BEYOND[micros > 0].decode()


class CreatedAtStamps(dict[int, bytes]):
    """``created_at`` header values by the record's integer: ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` in UTC, as
    ``to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`` formats it.

    A dict so the hot loop looks values up without a method call (``stamps.get(us) or stamps.format(us)``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._seconds: dict[int, bytes] = {}

    def format(self, micros: int) -> bytes:
        if len(self) >= MAX_STAMPS:
            self.clear()
            self._seconds.clear()
        seconds, fraction = divmod(micros, 1_000_000)
        prefix = self._seconds.get(seconds)
        if prefix is None:
            try:
                t = PG_EPOCH + dt.timedelta(seconds=seconds)
            except OverflowError:
                prefix = b""
            else:
                prefix = b"%04d-%02d-%02dT%02d:%02d:%02d" % (t.year, t.month, t.day, t.hour, t.minute, t.second)
            self._seconds[seconds] = prefix
        stamp = b"%s.%06dZ" % (prefix, fraction) if prefix else _BEYOND[micros > 0]
        self[micros] = stamp
        return stamp
