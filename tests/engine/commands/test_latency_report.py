"""The latency bench's report says what was measured: a rate the writers did not keep is not a rate reached."""

from __future__ import annotations

from outbox_pipeline.bench.latency.gauges import Statements
from outbox_pipeline.bench.latency.latency_cli import observer_wait_ms
from outbox_pipeline.bench.latency.latency_report import highest_rates
from outbox_pipeline.bench.latency.scenarios import ClassLatency, ScenarioResult
from outbox_pipeline.cli import build_parser


def _curve(rate: float, committed_rate: float, p99_ms: float) -> ScenarioResult:
    latency = ClassLatency("all", rate, committed_rate, int(committed_rate * 13), int(committed_rate * 13), 0,
                           p50_ms=p99_ms / 2, p95_ms=p99_ms, p99_ms=p99_ms, max_ms=p99_ms)  # fmt: skip
    return ScenarioResult(
        round=1, strategy="serialized", relay="cli", scenario=f"{rate:,.0f} msg/s x 10", kind="curve", rate=rate,
        rows=10, seconds=15, classes=[latency], missing=0, cores={}, machine_cores=1.0, relay_cores=0.1,
        window_messages=0, relay_us_per_message=None, batches_per_s=None, statements=Statements(None),
        statements_per_1000=None, writers_late_p99_ms=0.0, writers_late_max_ms=0.0, writers=1,
        writers_transactions=0, writers_scheduled=0,
    )  # fmt: skip


def test_the_highest_rate_is_the_rate_the_writers_committed_when_they_fell_behind_the_schedule() -> None:
    lines = highest_rates([_curve(5_000, 4_553, 47.9), _curve(10_000, 4_971, 43.7)])
    assert "  serialized, cli relay, 10-row transactions: 4,971 msg/s committed (10,000 scheduled)" in lines


def test_the_highest_rate_is_the_scheduled_one_when_the_writers_kept_it() -> None:
    lines = highest_rates([_curve(5_000, 5_000, 41.5), _curve(10_000, 9_990, 49.5)])
    assert "  serialized, cli relay, 10-row transactions: 10,000 msg/s" in lines


def _observer_wait(*flags: str) -> int:
    return observer_wait_ms(build_parser().parse_args(["bench", *flags]))


def test_the_observer_waits_as_a_default_consumer_does_on_apache_kafka() -> None:
    assert _observer_wait("--embedded") == 500  # librdkafka's fetch.wait.max.ms: Kafka answers when data comes


def test_the_observer_waits_5_ms_on_tansu_which_notices_new_data_only_part_way_through_a_wait() -> None:
    assert _observer_wait("--embedded", "--broker", "tansu") == 5


def test_an_observer_wait_given_is_the_one_used() -> None:
    assert _observer_wait("--embedded", "--broker", "tansu", "--observer-wait-ms", "20") == 20
