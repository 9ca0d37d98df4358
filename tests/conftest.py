"""The test kit, loaded as pytest plugins for every test folder (tests/kit: servers, schemas, writers, worker
processes, probes); each folder's own conftest adds only what its room needs.

`make test` runs the suite in two parts: everything but the ``timing`` scenarios on four pytest-xdist workers
(each with its own PostgreSQL and broker), then the ``timing`` scenarios alone, so that no parallel load moves
what they measure. A worker takes a whole module at a time (module-scoped servers and stacks start once), and
one worker takes every Spark module (one Spark session, not four).
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


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """Scopes by module, Spark's modules as one (xdist's own ``loadgroup`` marks do not take with pytest 9)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no types
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "tests/spark" if module.startswith("tests/spark/") else module

    return ByModule(config, log)
