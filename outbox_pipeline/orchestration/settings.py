"""The deployment's orchestration settings as a resource the UI shows with its values, read once at load from the
engine's catalogue. See docs/dagster.md#orchestration-settings."""

from collections.abc import Mapping
from typing import Any, cast

import dagster as dg
import psycopg
from pydantic import Field, model_validator

from outbox_pipeline import settings as catalogue
from outbox_pipeline.config import OutboxTable
from outbox_pipeline.errors import ConfigurationError
from outbox_pipeline.model import RECORDED_NAMES
from outbox_pipeline.observe.lag_slo import LagThresholds
from outbox_pipeline.settings import Setting
from outbox_pipeline.store import strategy_record
from outbox_pipeline.strategies.quarantine import ON_POISON_CHOICES, OnPoison

# The settings this resource carries, by field name.
FIELDS: dict[str, Setting[Any]] = {
    "strategy": catalogue.RELAY_STRATEGY,
    "sensor_interval_s": catalogue.LAG_SENSOR_INTERVAL_S,
    "check_interval_s": catalogue.LAG_CHECK_INTERVAL_S,
    "trigger_pending": catalogue.RELAY_TRIGGER_PENDING,
    "trigger_age_s": catalogue.RELAY_TRIGGER_AGE_S,
    "relay_max_seconds": catalogue.RELAY_MAX_SECONDS,
    "relay_window_s": catalogue.RELAY_WINDOW_S,
    "report_interval_s": catalogue.RELAY_REPORT_INTERVAL_S,
    "relay_runs_max": catalogue.RELAY_RUNS_MAX,
    "bulk_drain_threshold": catalogue.BULK_DRAIN_THRESHOLD,
    "bulk_drain_cooldown_s": catalogue.BULK_DRAIN_COOLDOWN_S,
    "metrics_pushgateway": catalogue.METRICS_PUSHGATEWAY,
    "on_poison": catalogue.ON_POISON,
    "lag_warn_age_s": catalogue.LAG_WARN_AGE_S,
    "lag_error_age_s": catalogue.LAG_ERROR_AGE_S,
    "lag_warn_pending": catalogue.LAG_WARN_PENDING,
    "lag_error_pending": catalogue.LAG_ERROR_PENDING,
    "wal_retained_warn_bytes": catalogue.WAL_RETAINED_WARN_BYTES,
    "wal_retained_error_bytes": catalogue.WAL_RETAINED_ERROR_BYTES,
}


def _field(name: str) -> Any:
    setting = FIELDS[name]
    return Field(default=setting.default, description=f"{setting.meaning} (${setting.name})")


class OrchestrationSettings(dg.ConfigurableResource):
    """Lag sensing, relay runs and alert thresholds of the Dagster control plane."""

    strategy: str = _field("strategy")
    sensor_interval_s: int = _field("sensor_interval_s")
    check_interval_s: int = _field("check_interval_s")
    trigger_pending: int = _field("trigger_pending")
    trigger_age_s: float = _field("trigger_age_s")
    relay_max_seconds: float = _field("relay_max_seconds")
    relay_window_s: float = _field("relay_window_s")
    report_interval_s: float = _field("report_interval_s")
    relay_runs_max: int = _field("relay_runs_max")
    bulk_drain_threshold: int = _field("bulk_drain_threshold")
    bulk_drain_cooldown_s: float = _field("bulk_drain_cooldown_s")
    metrics_pushgateway: str = _field("metrics_pushgateway")
    on_poison: str = _field("on_poison")
    lag_warn_age_s: float = _field("lag_warn_age_s")
    lag_error_age_s: float = _field("lag_error_age_s")
    lag_warn_pending: int = _field("lag_warn_pending")
    lag_error_pending: int = _field("lag_error_pending")
    wal_retained_warn_bytes: int = _field("wal_retained_warn_bytes")
    wal_retained_error_bytes: int = _field("wal_retained_error_bytes")

    @model_validator(mode="after")
    def _check(self) -> "OrchestrationSettings":
        if self.strategy and self.strategy not in RECORDED_NAMES:
            raise ConfigurationError(
                f"{catalogue.RELAY_STRATEGY.name}={self.strategy!r}: choose one of {', '.join(RECORDED_NAMES)}"
            )
        if self.sensor_interval_s < 1 or self.check_interval_s < 1:
            raise ConfigurationError("sensor intervals must be >= 1 s")
        if self.trigger_pending < 1 or self.trigger_age_s < 0 or self.relay_max_seconds <= 0:
            raise ConfigurationError(f"invalid relay trigger or budget: {self}")
        if self.relay_window_s < 10 * self.sensor_interval_s or self.report_interval_s <= 0:
            raise ConfigurationError(
                f"{catalogue.RELAY_WINDOW_S.name} must be at least ten sensor intervals and "
                f"{catalogue.RELAY_REPORT_INTERVAL_S.name} > 0"
            )
        if self.on_poison not in ON_POISON_CHOICES:
            raise ConfigurationError(f"{catalogue.ON_POISON.name}={self.on_poison!r}: choose quarantine or skip")
        if self.relay_runs_max < 1:
            raise ConfigurationError(f"{catalogue.RELAY_RUNS_MAX.name} must be >= 1")
        self.thresholds  # noqa: B018 - LagThresholds checks its own values
        return self

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "OrchestrationSettings":
        values = {name: setting.read(env) for name, setting in FIELDS.items()}
        return cls(**{**values, **overrides})

    @classmethod
    def with_thresholds(cls, thresholds: LagThresholds, **values: Any) -> "OrchestrationSettings":
        return cls(
            lag_warn_age_s=thresholds.warn_age_s,
            lag_error_age_s=thresholds.error_age_s,
            lag_warn_pending=thresholds.warn_pending,
            lag_error_pending=thresholds.error_pending,
            wal_retained_warn_bytes=thresholds.warn_retained_bytes,
            wal_retained_error_bytes=thresholds.error_retained_bytes,
            **values,
        )

    def strategy_of(self, conn: psycopg.Connection, table: OutboxTable, named: str | None = None) -> str:
        """The strategy a run or check reads the outbox as: the outbox's own (strategy_record.py); ``named`` (a run's
        config) or this resource's ``strategy``, when set, must be it."""
        return strategy_record.resolve(conn, table, named or self.strategy or None)

    @property
    def thresholds(self) -> LagThresholds:
        return LagThresholds(
            self.lag_warn_age_s,
            self.lag_error_age_s,
            self.lag_warn_pending,
            self.lag_error_pending,
            self.wal_retained_warn_bytes,
            self.wal_retained_error_bytes,
        )

    @property
    def poison(self) -> OnPoison:
        """``on_poison`` as the engine's type (checked against its choices above)."""
        return cast(OnPoison, self.on_poison)

    @property
    def handover_s(self) -> float:
        """A run this close to its window's end no longer counts as an owner: its successor starts now
        (three sensor ticks plus a run's start-up), so the two overlap rather than leave a gap."""
        return 3 * self.sensor_interval_s + 30.0

    @property
    def lag_cap(self) -> int:
        """Per-partition count cap of the lag query: exact up to the bulk drain threshold, no further."""
        return max(self.bulk_drain_threshold, self.lag_error_pending + 1)

    def is_lagging(self, pending: int, oldest_age_s: float | None) -> bool:
        return pending >= self.trigger_pending or (pending > 0 and (oldest_age_s or 0.0) >= self.trigger_age_s)
