"""Dagster assets over the outbox: the backlog and its checks, the per-partition relay; the PySpark assets are in
spark/. Names resolve on first use (PEP 562): a Spark executor importing ``outbox_pipeline.assets.spark.datasource``
does not import Dagster. Each module: docs/architecture.md#assets-and-resources."""

import importlib
from typing import Any

# Names resolve on first use (PEP 562): Spark executors import ``assets.spark.datasource`` and must not pay for
# importing Dagster and every asset with it.
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
