"""`outbox bench`: what the relay, the writers and the bulk drain cost, measured against baselines in the same
invocation (docs/performance.md). Each module: docs/architecture.md#commands."""

from typing import Any

from ..lazy_exports import lazy_exports

# Names resolve on first use (PEP 562): the latency bench's writers and observer are modules of this package run with
# `python -m` in processes of their own, which must not import the rest of the bench (nor their own module twice).
# runner.prepare, command.run and command.servers are used through their module.
_EXPORTS = {
    "add_arguments": ".arguments",
    **dict.fromkeys(["RunSpec", "Servers", "drop_table", "run_once"], ".runner"),
    **dict.fromkeys(["ConfirmingPublisher", "count_back"], ".baselines.ceilings"),
    **dict.fromkeys(["create_talk_table", "index_talk_table"], ".baselines.talk_table"),
    "Statements": ".latency.gauges",
    "observer_wait_ms": ".latency.latency_cli",
    "highest_rates": ".latency.latency_report",
    **dict.fromkeys(["ClassLatency", "ScenarioResult"], ".latency.scenarios"),
}

__all__ = sorted(_EXPORTS)


_resolve = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    return _resolve(name)
