"""Dagster room: the deployment's orchestration settings, from environment variables.

Read where they are used (sensor definitions at load, relay runs at run time) from the same variables,
so the sensor that measures lag and the run that relays it always agree on the strategy.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from outbox_pipeline.errors import ConfigurationError
from outbox_pipeline.lag_slo import LagThresholds
from outbox_pipeline.strategies import STRATEGY_NAMES

ENV_STRATEGY = "OUTBOX_RELAY_STRATEGY"
ENV_SENSOR_INTERVAL_S = "OUTBOX_LAG_SENSOR_INTERVAL_S"
ENV_CHECK_INTERVAL_S = "OUTBOX_LAG_CHECK_INTERVAL_S"
ENV_TRIGGER_PENDING = "OUTBOX_RELAY_TRIGGER_PENDING"
ENV_TRIGGER_AGE_S = "OUTBOX_RELAY_TRIGGER_AGE_S"
ENV_RELAY_MAX_SECONDS = "OUTBOX_RELAY_MAX_SECONDS"
ENV_BULK_DRAIN_THRESHOLD = "OUTBOX_BULK_DRAIN_THRESHOLD"
ENV_RELAY_WINDOW_S = "OUTBOX_RELAY_WINDOW_S"
ENV_RELAY_REPORT_INTERVAL_S = "OUTBOX_RELAY_REPORT_INTERVAL_S"
ENV_RELAY_RUNS_MAX = "OUTBOX_RELAY_RUNS_MAX"
ENV_METRICS_PUSHGATEWAY = "OUTBOX_METRICS_PUSHGATEWAY"


@dataclass(frozen=True)
class OrchestrationSettings:
    # The relay strategy of Dagster runs; lag is measured the way this strategy sees it.
    strategy: str = "partitioned"
    # Seconds between lag sensor ticks, and between lag SLO evaluations.
    sensor_interval_s: int = 5
    check_interval_s: int = 15
    # A partition is lagging once it has this many pending rows, or once its oldest pending row is this
    # old: the live relay runs are not keeping up, and the sensor adds one (up to relay_runs_max).
    trigger_pending: int = 1000
    trigger_age_s: float = 10.0
    # A per-partition run's time budget (relay_partition, launched from the UI): it stops when caught up or
    # after this long.
    relay_max_seconds: float = 60.0
    # A long-lived relay run (relay_stream) relays for this window, then ends; the sensor launches its
    # successor before the window ends, so there is no gap. Each run costs seconds of CPU to start.
    relay_window_s: float = 600.0
    # How often a relay run records each of its partitions' progress (a materialization per partition).
    report_interval_s: float = 60.0
    # The most relay runs at once (bursts, partitions that cannot keep up); one suffices in steady state.
    relay_runs_max: int = 4
    # Total pending rows from which the lag sensor asks for the bulk drain job instead (when wired).
    bulk_drain_threshold: int = 1_000_000
    thresholds: LagThresholds = field(default_factory=LagThresholds)
    # A Prometheus pushgateway (host:port or URL) relay runs push their metrics to at every report: a run
    # has no port of its own that Prometheus could scrape. Empty: not exported (the run says so in its log).
    metrics_pushgateway: str = ""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_NAMES:
            raise ConfigurationError(f"{ENV_STRATEGY}={self.strategy!r}: choose one of {', '.join(STRATEGY_NAMES)}")
        if self.sensor_interval_s < 1 or self.check_interval_s < 1:
            raise ConfigurationError("sensor intervals must be >= 1 s")
        if self.trigger_pending < 1 or self.trigger_age_s < 0 or self.relay_max_seconds <= 0:
            raise ConfigurationError(f"invalid relay trigger or budget: {self}")
        if self.relay_window_s < 10 * self.sensor_interval_s or self.report_interval_s <= 0:
            raise ConfigurationError(
                f"{ENV_RELAY_WINDOW_S} must be at least ten sensor intervals and {ENV_RELAY_REPORT_INTERVAL_S} > 0"
            )
        if self.relay_runs_max < 1:
            raise ConfigurationError(f"{ENV_RELAY_RUNS_MAX} must be >= 1")

    @property
    def handover_s(self) -> float:
        """A run this close to its window's end no longer counts as an owner: its successor starts now
        (three sensor ticks plus a run's start-up), so the two overlap rather than leave a gap."""
        return 3 * self.sensor_interval_s + 30.0

    @property
    def lag_cap(self) -> int:
        """Per-partition count cap of the lag query: exact up to the bulk drain threshold, no further."""
        return max(self.bulk_drain_threshold, self.thresholds.error_pending + 1)

    def is_lagging(self, pending: int, oldest_age_s: float | None) -> bool:
        return pending >= self.trigger_pending or (pending > 0 and (oldest_age_s or 0.0) >= self.trigger_age_s)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OrchestrationSettings":
        env = os.environ if env is None else env
        d = cls()

        def get(name: str, default: float, kind: type[float] | type[int]) -> float:
            raw = env.get(name, "")
            try:
                return kind(raw) if raw else default
            except ValueError:
                raise ConfigurationError(f"{name} must be a {kind.__name__}, got {raw!r}") from None

        return cls(
            strategy=env.get(ENV_STRATEGY, "") or d.strategy,
            sensor_interval_s=int(get(ENV_SENSOR_INTERVAL_S, d.sensor_interval_s, int)),
            check_interval_s=int(get(ENV_CHECK_INTERVAL_S, d.check_interval_s, int)),
            trigger_pending=int(get(ENV_TRIGGER_PENDING, d.trigger_pending, int)),
            trigger_age_s=get(ENV_TRIGGER_AGE_S, d.trigger_age_s, float),
            relay_max_seconds=get(ENV_RELAY_MAX_SECONDS, d.relay_max_seconds, float),
            bulk_drain_threshold=int(get(ENV_BULK_DRAIN_THRESHOLD, d.bulk_drain_threshold, int)),
            relay_window_s=get(ENV_RELAY_WINDOW_S, d.relay_window_s, float),
            report_interval_s=get(ENV_RELAY_REPORT_INTERVAL_S, d.report_interval_s, float),
            relay_runs_max=int(get(ENV_RELAY_RUNS_MAX, d.relay_runs_max, int)),
            thresholds=LagThresholds.from_env(env),
            metrics_pushgateway=env.get(ENV_METRICS_PUSHGATEWAY, "").strip(),
        )
