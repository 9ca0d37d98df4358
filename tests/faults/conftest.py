"""Fixtures of the fault-injection suite: a PostgreSQL of its own to restart and a broker behind a TCP proxy to
cut (outbox schemas on either server and worker processes come from the test kit)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from outbox_pipeline.localstack import Broker, LocalPostgres, free_port
from tests.kit.servers import broker_under_test, server_under_test
from tests.kit.tcp_proxy import TcpProxy

from ..conftest import FAULT_FIGURE
from .helpers import FIGURES


# Each scenario's FAULT lines ride along with its test's report; tests/conftest.py prints them where the terminal
# summary is written (with pytest-xdist, the controller, which loads no folder's conftest).
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    if call.when == "call":
        item.user_properties.extend((FAULT_FIGURE, line) for line in FIGURES)
        FIGURES.clear()
    yield


@pytest.fixture(scope="module")
def module_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A PostgreSQL server of the module's own: restarting it breaks no other test's connections, and its
    transactions hold back no other server's snapshots."""
    # synchronous_commit stays on: an immediate shutdown is a crash, and an acknowledged commit must survive it
    # (asynchronous commits would be lost, and with them acks: more duplicates than the relay's own bound). fsync
    # off is safe, the OS does not crash.
    server = server_under_test(tmp_path_factory.mktemp("fault_pg") / "data", {"fsync": "off"})
    server.start()
    try:
        yield server
    finally:
        server.stop("fast", force=True)


@dataclass(frozen=True)
class ProxiedBroker:
    broker: Broker
    proxy: TcpProxy

    @property
    def bootstrap(self) -> str:
        """What clients use: the proxy. The broker advertises the proxy too, so no client learns its real port."""
        return self.proxy.address

    def new_topic(self, prefix: str = "t", partitions: int = 1) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.broker.create_topics([name], partitions=partitions)
        return name


@pytest.fixture(scope="module")
def proxied_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxiedBroker]:
    """A broker of its own (freezing it stalls no other test) whose advertised listener is a TCP proxy."""
    port = free_port()
    with TcpProxy(port) as proxy:
        broker = broker_under_test(tmp_path_factory.mktemp("proxied_broker"), port=port, advertised_port=proxy.port)
        broker.start()
        try:
            yield ProxiedBroker(broker, proxy)
        finally:
            broker.stop()
