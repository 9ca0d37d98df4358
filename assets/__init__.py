"""Dagster assets over the outbox: the backlog and its checks, the per-partition relay; the PySpark assets are in
spark/. Names resolve on first use (PEP 562): a Spark executor importing ``outbox_pipeline.assets.spark.datasource``
does not import Dagster. Each module: docs/architecture.md#assets-and-resources."""

from typing import Any

from outbox_pipeline.lazy_exports import lazy_exports

_EXPORTS = {
    "outbox_backlog": ".backlog",
    "outbox_lag_slo": ".backlog",
    "outbox_dead_letters": ".backlog",
    "relayed_outbox": ".relay",
}

__all__ = sorted(_EXPORTS)


_resolve = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    return _resolve(name)
