"""The observe room's tests: a server of a test's own where the session's shared one cannot serve (its slots)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox_pipeline.localstack import LocalPostgres
from tests.kit.servers import server_under_test


@pytest.fixture
def small_slot_server(tmp_path: Path) -> Iterator[LocalPostgres]:
    """A server of this test's own (the session's keeps every test's slot): max_slot_wal_keep_size 1 MB."""
    server = server_under_test(tmp_path / "data", {"fsync": "off", "max_slot_wal_keep_size": "1MB"})
    server.start()
    try:
        yield server
    finally:
        server.stop("immediate", force=True)
