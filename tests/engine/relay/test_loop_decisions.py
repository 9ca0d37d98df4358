"""The table relay loop's decisions, over fakes of its seams (tests/kit/fakes.py): no server, milliseconds each. The
end-to-end tests beside it prove the same against PostgreSQL and Kafka."""

from __future__ import annotations

import psycopg

from tests.kit.fakes import FakePublisher, FakeStrategy, FoldingStrategy, Log, fake_relay

FIRST = tuple(range(1, 21))  # one paced claim's rows (a commit of 20)


def steps(log: Log, *kinds: str) -> list[tuple[str, object]]:
    return [entry for entry in log if entry[0] in kinds]


def test_the_next_batch_is_read_while_kafka_confirms_one_and_published_only_after_its_ack() -> None:
    log: Log = []
    relay, _ = fake_relay(log, FakeStrategy(log, 6), FakePublisher(log), until_empty=True)

    relay.run()

    assert steps(log, "claim", "start", "finish", "ack") == [
        ("claim", (1, 2)),
        ("start", (1, 2)),
        ("claim", (3, 4)),  # read while (1, 2) is in Kafka
        ("finish", (1, 2)),
        ("ack", (1, 2)),
        ("start", (3, 4)),  # published once (1, 2) is acked: one batch published and not acked at most
        ("claim", (5, 6)),
        ("finish", (3, 4)),
        ("ack", (3, 4)),
        ("start", (5, 6)),
        ("claim", ()),
        ("finish", (5, 6)),
        ("ack", (5, 6)),
    ]


def test_without_pipelining_each_batch_is_acked_before_the_next_claim() -> None:
    log: Log = []
    relay, _ = fake_relay(log, FakeStrategy(log, 4), FakePublisher(log), until_empty=True, pipeline=False)

    relay.run()

    assert steps(log, "claim", "ack") == [("claim", (1, 2)), ("ack", (1, 2)), ("claim", (3, 4)), ("ack", (3, 4))] + [
        ("claim", ())
    ]


def test_a_paced_relay_acks_a_settled_batch_in_the_next_claims_statement() -> None:
    log: Log = []
    # The linger after a claim that took all 20 rows there were; then a commit is announced: the claim takes the ack.
    relay, _ = fake_relay(
        log,
        FoldingStrategy(log, 20),
        FakePublisher(log),
        announced=[False, True],
        stop_after_waits=1,
        batch_size=50,
        min_cycle_s=60.0,
    )

    relay.run()

    assert ("fold", FIRST) in log
    assert log.count(("ack", FIRST)) == 1  # inside the fold


def test_a_paced_relay_with_no_claim_coming_acks_alone_before_it_waits() -> None:
    log: Log = []
    relay, _ = fake_relay(
        log, FoldingStrategy(log, 20), FakePublisher(log), stop_after_waits=1, batch_size=50, min_cycle_s=60.0
    )

    relay.run()

    kinds = [kind for kind, _ in steps(log, "fold", "ack", "poll", "notify")]
    assert kinds == ["ack", "poll"]


def test_a_broker_that_takes_nothing_backs_the_relay_off_doubling_with_jitter_until_it_takes_a_batch() -> None:
    log: Log = []
    relay, _ = fake_relay(
        log,
        FakeStrategy(log, 2),
        FakePublisher(log, down=4),
        until_empty=True,
        error_backoff_base_s=1.0,
        error_backoff_max_s=100.0,
    )

    relay.run()

    waits = [seconds for kind, seconds in log if kind == "wait"]
    assert len(waits) == 4
    for failures, seconds in enumerate(waits, start=1):
        ceiling = 2.0 ** (failures - 1)
        assert isinstance(seconds, float) and ceiling / 2 <= seconds <= ceiling
    assert steps(log, "ack")[-1] == ("ack", (1, 2)) and relay.stats.published == 2


def test_a_run_until_idle_ends_when_the_broker_takes_nothing_so_its_orchestrator_retries_it() -> None:
    log: Log = []
    relay, _ = fake_relay(log, FakeStrategy(log, 2), FakePublisher(log, down=1), until_idle=True)

    stats = relay.run()

    assert stats.published == 0 and steps(log, "wait") == []
    assert steps(log, "start") == [("start", (1, 2))]  # tried once, then the run ended


def test_a_stop_while_a_batch_is_in_kafka_acks_it_and_the_batch_read_meanwhile_then_deregisters() -> None:
    log: Log = []
    strategy = FakeStrategy(log, 10)
    publisher = FakePublisher(log)
    relay, sessions = fake_relay(log, strategy, publisher, until_empty=True)
    publisher.on_finish = relay.stop.set  # stopped while the first batch is in Kafka

    relay.run()

    started = [entry[1] for entry in steps(log, "start")]
    acked = [entry[1] for entry in steps(log, "ack")]
    assert started == acked == [(1, 2), (3, 4)]  # nothing published is left unacked
    assert strategy.todo[0].id == 5  # the rest is still to publish
    assert sessions.disconnects[-1] is True and publisher.closed


def test_a_notify_while_the_strategy_knows_commits_cannot_be_visible_claims_nothing_and_a_poll_claims() -> None:
    log: Log = []
    strategy = FakeStrategy(log, 0, visible=False)
    relay, _ = fake_relay(log, strategy, FakePublisher(log), wakes=[True, False], stop_after_waits=3, max_seconds=None)

    relay.run()

    kinds = [kind for kind, _ in steps(log, "claim", "notify", "poll")]
    assert kinds == ["claim", "notify", "poll", "claim", "poll"]  # no claim between the NOTIFY and the poll


def test_a_notify_claims_at_once_when_commits_may_be_visible() -> None:
    log: Log = []
    relay, _ = fake_relay(log, FakeStrategy(log, 0), FakePublisher(log), wakes=[True], stop_after_waits=2)

    relay.run()

    kinds = [kind for kind, _ in steps(log, "claim", "notify", "poll")]
    assert kinds == ["claim", "notify", "claim", "poll"]


def test_a_database_error_abandons_the_claim_disconnects_backs_off_and_goes_on() -> None:
    log: Log = []
    strategy = FakeStrategy(log, 4)
    relay, sessions = fake_relay(log, strategy, FakePublisher(log), until_empty=True)
    strategy.fail_claims = [psycopg.OperationalError("server closed the connection unexpectedly\nmore")]

    stats = relay.run()

    assert stats.errors == 1 and sessions.disconnects[0] is False
    assert len(steps(log, "wait")) == 1
    assert stats.published == 4


def test_a_standby_waits_at_its_poll_interval_without_listening() -> None:
    log: Log = []

    class Standby(FakeStrategy):
        @property
        def standing_by(self) -> bool:
            return True

    relay, _ = fake_relay(log, Standby(log, 0), FakePublisher(log), stop_after_waits=3, max_seconds=None)

    relay.run()

    assert [kind for kind, _ in steps(log, "stand-by", "notify", "poll")] == ["stand-by"] * 3
