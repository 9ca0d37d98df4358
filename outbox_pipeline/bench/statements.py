"""Where PostgreSQL's time went during a drain, per statement (pg_stat_statements), said once when the extension is
missing. See docs/performance.md#how-a-bulk-run-is-measured."""

from __future__ import annotations

import psycopg

TOP = 8


def reset_statements(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
        except psycopg.Error:
            pass  # reported by top_statements


def top_statements(dsn: str, top: int = TOP) -> str:
    """The ``top`` statements by total execution time since the reset, one line each, query text folded."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            rows = conn.execute(
                """
                SELECT calls, total_exec_time, total_exec_time / greatest(calls, 1), rows,
                       regexp_replace(query, '\\s+', ' ', 'g')
                FROM pg_stat_statements
                WHERE query NOT LIKE '%%pg_stat_statements%%'
                ORDER BY total_exec_time DESC LIMIT %s
                """,
                (top,),
            ).fetchall()
        except psycopg.Error as exc:
            return f"  statements: pg_stat_statements is not available here ({str(exc).strip().splitlines()[0]})"
    total = sum(float(r[1]) for r in rows)
    lines = [f"  statements (top {len(rows)}, {total / 1000:.1f} s of execution):"]
    lines += [
        f"    {int(calls):>7,} calls {float(ms) / 1000:6.2f} s {float(mean):7.2f} ms/call {int(n):>9,} rows  "
        f"{query[:110]}"
        for calls, ms, mean, n, query in rows
    ]
    return "\n".join(lines)
