"""The test kit, loaded as pytest plugins for every test folder (tests/kit: servers, schemas, writers, worker
processes, probes); each folder's own conftest adds only what its room needs.

`make test` runs the suite in two parts: everything but the ``timing`` scenarios on four pytest-xdist workers
(each with its own PostgreSQL and broker), then the ``timing`` scenarios alone, so that no parallel load moves
what they measure. A worker takes a whole module at a time (module-scoped servers and stacks start once; a few
long modules without them, test by test), and one worker takes every Spark module (one Spark session, not four).
Tests marked ``nightly`` (runs at size) are left to `make test-nightly`.
"""

from typing import Any

pytest_plugins = ["tests.kit.servers", "tests.kit.schema", "tests.kit.workers"]

# The fault suite's FAULT lines (tests/faults/conftest.py attaches them to each test's report): printed here, since
# under pytest-xdist only the controller writes the terminal summary, and it loads no folder's conftest.
FAULT_FIGURE = "fault_figure"
_FAULT_LINES: list[str] = []


def pytest_runtest_logreport(report: Any) -> None:
    if report.when == "call":
        _FAULT_LINES.extend(str(value) for name, value in report.user_properties if name == FAULT_FIGURE)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _FAULT_LINES:
        terminalreporter.section("fault figures")
        for line in _FAULT_LINES:
            terminalreporter.write_line(line)


# Long modules whose tests share no module-scoped fixture: each test is a scope of its own, so that one worker does
# not run all of them one after another (test_kill9's five strategies alone were the 15's whole last two minutes).
SPLIT_BY_TEST = frozenset(
    {
        "tests/faults/test_kill9.py",
        "tests/faults/test_restart_new_ids.py",
        "tests/faults/test_two_relays.py",
        "tests/engine/relay/test_relay_failures.py",
        "tests/engine/relay/test_transport_failures.py",
    }
)


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """Scopes by module, Spark's modules as one (xdist's own ``loadgroup`` marks do not take with pytest 9), and the
    tests of SPLIT_BY_TEST one by one."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no types
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            if module in SPLIT_BY_TEST:
                return nodeid
            return "tests/spark" if module.startswith("tests/spark/") else module

    return ByModule(config, log)
