"""Dagster room: assets over the outbox (backlog and lag check, per-partition relay; Spark drains, maintenance).

Names resolve on first use (PEP 562): Spark executors import ``outbox_pipeline.assets.spark.datasource`` and
must not pay for importing Dagster and every asset with it.
"""

import importlib
from typing import Any

_EXPORTS = {
    "outbox_backlog": ".backlog",
    "outbox_lag_slo": ".backlog",
    "outbox_dead_letters": ".backlog",
    "relayed_outbox": ".relay",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
