"""The harness's checker on evidence made by hand (no servers): what it must call a failure, and what it must not."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from tests.faults.helpers import TimedRecord

from . import ledger
from .context import CliResult, Span, Switch
from .ledger import DeadRow, Evidence, check
from .schedule import Relaying, Setup
from .writers import Written

SECRET = "Hs0123456789abcdefPw"


def _row(message_id: str, committed_at: float, key: str = "k1") -> Written:
    written = Written("enqueue", "t", key, {"n": 1}, {}, message_id=message_id)
    written.outcome, written.committed_at = "committed", committed_at
    return written


def _copy(
    message_id: str, at: float, offset: int, key: bytes = b"k1", value: bytes = b'{"n": 1}', outbox_id: int = 0
) -> TimedRecord:
    headers = {"message_id": message_id.encode(), **({"outbox_id": str(outbox_id).encode()} if outbox_id else {})}
    return TimedRecord("t", 0, offset, key, value, headers, int(at * 1000))


def _evidence(
    written: Sequence[Written],
    records: Sequence[TimedRecord],
    *,
    spans: Sequence[Span] = (),
    order: dict[str, tuple[int, int]] | None = None,
    outputs: dict[str, str] | None = None,
    strategy: str = "partitioned",
    switches: Sequence[Switch] = (),
    commands: Sequence[CliResult] = (),
    dead: Sequence[DeadRow] = (),
    released: Sequence[int] = (),
    held: Sequence[str] = (),
) -> Evidence:
    setup = Setup(strategy, 20, 2, 5.0, 50, "UTF8", "delete", 0.01, 0.05)
    return Evidence(
        setup,
        list(written),
        list(records),
        list(dead),
        order or {},
        list(spans),
        [],
        list(commands),
        outputs or {},
        SECRET,
        switches=list(switches),
        released=list(released),
        held=set(held),
    )


def _switch(at: float, old: str, new: str, republished: int = 0) -> Switch:
    return Switch(at, Relaying(old), Relaying(new), republished, killed=0)


def test_a_committed_row_that_never_arrived_is_lost() -> None:
    verdict = check(_evidence([_row("a", 0.0), _row("b", 0.0)], [_copy("a", 0.1, 0)]))

    assert [f.split(":")[0] for f in verdict.findings] == ["lost"] and "b" in verdict.findings[0]


def test_the_password_in_any_output_fails_the_run_and_the_finding_does_not_show_it() -> None:
    leak = f"connection to postgresql://harness_app:{SECRET}@127.0.0.1/db failed"

    verdict = check(_evidence([], [], outputs={"worker part-s0-g1": "ok", "outbox status #3": leak}))

    assert len(verdict.findings) == 1 and verdict.findings[0].startswith("secret shown in outbox status #3")
    assert SECRET not in verdict.findings[0] and "<PASSWORD>" in verdict.findings[0]


def test_a_partition_silent_past_lease_s_and_a_steal_while_a_row_waits_is_a_stall_unless_the_server_was_down() -> None:
    written = [_row("a", 0.0), _row("b", 1.0)]
    records = [_copy("a", 0.1, 0), _copy("b", 12.0, 1)]  # nothing from 0.1 s to 12 s: 11 s > 5 + 3

    stalled = check(_evidence(written, records))
    restarted = check(_evidence(written, records, spans=[Span("pg-restart", None, 1.0, 4.0)]))  # + 5 s to recover

    assert [f.split(" (")[0] for f in stalled.findings] == ["stalled"]
    assert restarted.ok, restarted.findings


def test_a_partition_publishing_again_after_a_rewind_is_served_not_silent() -> None:
    written = [_row("a", 0.0), _row("b", 1.0)]
    records = [_copy("a", 0.1, 0), *(_copy("a", t, n) for n, t in enumerate((3.0, 6.0, 9.0), 1)), _copy("b", 12.0, 4)]

    verdict = check(_evidence(written, records, spans=[Span("rewind", None, 1.0, 1.5)]))

    assert not [f for f in verdict.findings if f.startswith("stalled")], verdict.findings


def test_first_arrivals_of_a_key_out_of_the_strategy_order_are_a_finding() -> None:
    written = [_row("a", 0.0), _row("b", 0.0)]
    records = [_copy("b", 0.1, 0), _copy("a", 0.2, 1)]

    verdict = check(_evidence(written, records, order={"a": (7, 1), "b": (7, 2)}))

    assert len(verdict.findings) == 1 and verdict.findings[0].startswith("out of order")


def test_a_finding_of_a_defect_already_reported_is_listed_as_known_and_fails_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The defect of seed 66 (fixed since): while reported and not fixed, it was listed and failed no run."""
    reported = {"a header named as the relay's own, stored by a plain INSERT": re.compile(r"^bad row reserved-header")}
    monkeypatch.setattr(ledger, "KNOWN_DEFECTS", reported)
    bad = _row("r", 0.0)
    bad.writer, bad.bad = "insert", "reserved-header"

    verdict = check(_evidence([bad], [_copy("r", 0.1, 0)]))

    assert verdict.ok and len(verdict.known) == 1 and "reserved-header by insert" in verdict.known[0]


def test_order_is_the_logs_a_copy_stamped_earlier_but_appended_later_does_not_count_first() -> None:
    written = [_row("a", 0.0), _row("b", 0.0)]
    # a's first try timed out in a frozen broker and was appended after the retry of a and b: a late copy
    records = [_copy("a", 0.5, 0), _copy("b", 0.6, 1), _copy("a", 0.1, 2)]
    freeze = Span("broker-freeze", None, 0.0, 0.4)

    verdict = check(_evidence(written, records, spans=[freeze], order={"a": (7, 1), "b": (7, 2)}))

    assert verdict.ok, verdict.findings


def test_across_a_switch_between_two_ordered_strategies_a_keys_first_arrivals_stay_in_order() -> None:
    """serialized then partitioned (a run whose writers take the serialized lock): one promise across the switch."""
    written = [_row("a", 0.0), _row("b", 0.0)]
    records = [_copy("b", 0.5, 0), _copy("a", 1.5, 1)]  # b before the switch at 1 s, a (earlier in order) after it

    verdict = check(
        _evidence(
            written,
            records,
            order={"a": (7, 1), "b": (8, 2)},
            strategy="serialized",
            switches=[_switch(1.0, "serialized", "partitioned")],
        )
    )

    assert len(verdict.findings) == 1 and verdict.findings[0].startswith("out of order"), verdict.findings


def test_across_a_switch_to_a_row_strategy_order_is_promised_before_it_and_not_after() -> None:
    written = [_row("a", 0.0), _row("b", 0.0), _row("c", 0.0, key="k2"), _row("d", 0.0, key="k2")]
    before = [_copy("b", 0.2, 0), _copy("a", 0.3, 1)]  # partitioned: a (earlier in order) after b
    after = [_copy("d", 1.5, 0, key=b"k2"), _copy("c", 1.6, 1, key=b"k2")]  # lease keeps no order
    order = {"a": (7, 1), "b": (7, 2), "c": (9, 3), "d": (9, 4)}

    verdict = check(_evidence(written, before + after, order=order, switches=[_switch(1.0, "partitioned", "lease")]))

    assert len(verdict.findings) == 1 and "'k1'" in verdict.findings[0], verdict.findings


def test_copies_a_switch_publishes_again_are_duplicates_within_what_it_republishes_and_no_more() -> None:
    """The switch to a position strategy publishes again the rows relayed past its new positions (its
    ``republished``): that many copies across it are within the bound, one more is not."""
    written = [_row("a", 0.0), _row("b", 0.0)]
    once = [_copy("a", 0.1, 0), _copy("b", 0.2, 1), _copy("a", 2.0, 2), _copy("b", 2.1, 3)]
    twice = [*once, _copy("b", 2.2, 4)]
    switch = _switch(1.0, "lease", "partitioned", republished=2)

    within = check(_evidence(written, once, order={"a": (7, 1), "b": (7, 2)}, switches=[switch]))
    over = check(_evidence(written, twice, order={"a": (7, 1), "b": (7, 2)}, switches=[switch]))

    assert within.ok and within.figures["switch_dupes"] == "2/2", within.findings
    assert over.findings[0].startswith("duplicates:") and "2 published again" in over.findings[0], over.findings


def _committed(message_id: str, writer: str, tx: int, sent: float, returned: float, key: str = "k1") -> Written:
    """A wal writer's row: its transaction's COMMIT sent and returned at these (monotonic) times."""
    written = _row(message_id, returned, key)
    written.writer, written.tx, written.sent_at, written.returned_at = writer, tx, sent, returned
    return written


def test_wal_a_key_arriving_against_a_commit_order_the_writers_prove_is_out_of_order() -> None:
    """b's COMMIT returned before a's was sent: b committed first, whatever a wrote first (a long transaction)."""
    written = [_committed("a", "long-transaction", 1, sent=5.0, returned=5.1), _committed("b", "sql", 1, 1.0, 1.1)]

    verdict = check(_evidence(written, [_copy("a", 6.0, 0), _copy("b", 6.1, 1)], strategy="wal"))

    assert len(verdict.findings) == 1 and verdict.findings[0].startswith("out of order"), verdict.findings


def test_wal_commits_that_overlapped_in_time_may_arrive_in_either_order() -> None:
    written = [_committed("a", "enqueue", 1, sent=1.0, returned=1.3), _committed("b", "sql", 1, 1.1, 1.2)]

    verdict = check(_evidence(written, [_copy("a", 2.0, 0), _copy("b", 2.1, 1)], strategy="wal"))

    assert verdict.ok, verdict.findings


def test_wal_messages_of_one_transaction_arrive_in_the_order_they_were_written() -> None:
    written = [_committed("a", "enqueue_many", 1, 1.0, 1.1), _committed("b", "enqueue_many", 1, 1.0, 1.1)]

    verdict = check(_evidence(written, [_copy("b", 2.0, 0), _copy("a", 2.1, 1)], strategy="wal"))

    assert len(verdict.findings) == 1 and "written after it" in verdict.findings[0], verdict.findings


def test_wal_duplicates_are_bounded_by_what_a_fault_leaves_unconfirmed() -> None:
    """One fault: two batches (50 each here) and the largest transaction less one; one copy more is over."""
    written = [_committed(str(n), "enqueue", n, n, n + 0.1) for n in range(101)]
    once = [_copy(str(n), n + 0.2, n) for n in range(101)]
    again = [_copy(str(n), 101 + n / 1000, 100 + n) for n in range(1, 101)]  # from the confirmed one to the newest
    kill = [Span("kill", 0, 100.5, 100.9)]

    within = check(_evidence(written, once + again, spans=kill, strategy="wal"))
    all_again = [_copy(str(n), 101 + n / 1000, 101 + n) for n in range(101)]  # one copy more, each row twice at most
    over = check(_evidence(written, once + all_again, spans=kill, strategy="wal"))

    assert within.ok and within.figures["dupe_bound"] == 100, within.findings
    assert [f.split(":")[0] for f in over.findings] == ["duplicates"], over.findings


# -- operator commands: judged by what they printed --------------------------------------------------------------


def _command(code: int | None, output: str, *argv: str) -> CliResult:
    return CliResult(argv or ("dead-letters", "retry", "--id", "7"), code, output)


def test_an_operator_command_that_exits_1_is_a_finding() -> None:
    verdict = check(_evidence([], [], commands=[_command(1, "relay: done, worker 0 crashed: boom")]))

    assert [f.split(":")[0] for f in verdict.findings] == ["operator command failed"], verdict.findings


@pytest.mark.parametrize(
    "output",
    [
        "usage: outbox dead-letters [-h] {list,retry,discard} ...\noutbox: error: argument --id: invalid int value",
        "error: no such dead letter: 7",
    ],
)
def test_exit_2_is_a_finding_unless_the_command_printed_a_refusal_it_documents(output: str) -> None:
    verdict = check(_evidence([], [], commands=[_command(2, output)]))

    assert [f.split(":")[0] for f in verdict.findings] == ["operator command failed"], verdict.findings


def test_exit_2_with_a_documented_refusal_is_accepted() -> None:
    restarting = _command(2, "error: cannot reach PostgreSQL: connection failed: Connection refused")
    rewind = _command(
        2,
        "error: refusing to move t/0 forward from xid=7 id=9 to xid=8 id=12: that would skip rows",
        *("replay", "--topic", "t", "--partition", "0", "--since", "2026-11-29T06:00:00+00:00", "--force"),
    )
    held = _command(
        2,
        "error: 2 keys are held behind dead letters: retry or discard them (`outbox dead-letters`) before switching",
        *("switch-strategy", "--to", "lease", "--mode", "delete"),
    )

    verdict = check(_evidence([], [], commands=[restarting, rewind, held]))

    assert verdict.ok, verdict.findings


def test_exit_3_is_accepted_only_from_a_drain_stopped_by_its_max_seconds() -> None:
    drain = ("relay", "--strategy", "lease", "--until-empty", "--max-seconds", "6")
    stopped = _command(3, "not empty after --max-seconds: 1 reason(s)\n  12 rows pending", *drain)
    other = _command(3, "discarded 1 dead letters", "dead-letters", "discard", "--id", "7", "--reason", "x")

    assert check(_evidence([], [], commands=[stopped])).ok
    assert [f.split(":")[0] for f in check(_evidence([], [], commands=[other])).findings] == ["operator command failed"]


# -- content, on every copy ----------------------------------------------------------------------------------------


def test_a_later_copy_other_than_written_is_corrupted_even_when_the_first_is_right() -> None:
    records = [_copy("a", 0.1, 0), _copy("a", 0.2, 1, value=b'{"n": 2}')]

    verdict = check(_evidence([_row("a", 0.0)], records, spans=[Span("kill", 0, 0.15, 0.16)]))

    assert [f.split(":")[0] for f in verdict.findings] == ["corrupted"], verdict.findings


# -- duplicates: per fault, from what the nemesis and the operator actually did ----------------------------------


def test_a_skipped_fault_or_a_refused_command_allows_no_duplicate() -> None:
    written = [_row("a", 0.0)]
    records = [_copy("a", 0.1, 0), _copy("a", 2.0, 1)]
    skipped = Span("kill", 0, 1.0, 1.0, "skipped: not for lease/delete")
    refused = Span("rewind", None, 1.0, 1.2, "outbox replay --topic t --partition 0 -> exit 2 ")

    for span in (skipped, refused):
        verdict = check(_evidence(written, records, spans=[span]))

        assert [f.split(":")[0] for f in verdict.findings][:1] == ["duplicates"], (span, verdict.findings)


def test_one_kill_allows_two_batches_of_duplicates_and_not_one_more() -> None:
    """The table strategies' bound: IN_FLIGHT_BATCHES batches (50 rows here) per relay a fault hit."""
    written = [_row(str(n), 0.0, key=f"k{n}") for n in range(101)]
    once = [_copy(str(n), 0.1, n, key=f"k{n}".encode()) for n in range(101)]
    again = [_copy(str(n), 2.0, 101 + n, key=f"k{n}".encode()) for n in range(100)]
    kill = [Span("kill", 0, 1.0, 1.2, "part-s0-g1 -> part-s0-g3")]

    within = check(_evidence(written, once + again, spans=kill))
    over = check(_evidence(written, [*once, *again, _copy("100", 2.1, 201, key=b"k100")], spans=kill))

    assert within.ok and within.figures["dupe_bound"] == 100, within.findings
    assert [f.split(":")[0] for f in over.findings] == ["duplicates"], over.findings


def test_one_row_copied_more_often_than_the_faults_could_publish_it_again_is_a_finding() -> None:
    """100 copies of one row with one kill: within the run's sum (two batches), not what one kill can do to a row."""
    records = [_copy("a", 0.1 + n / 100, n) for n in range(100)]

    verdict = check(_evidence([_row("a", 0.0)], records, spans=[Span("kill", 0, 0.5, 0.6, "s0-g1 -> s0-g2")]))

    assert [f.split(":")[0] for f in verdict.findings] == ["duplicates of one row"], verdict.findings


def test_wal_held_messages_released_count_from_what_the_operator_released_not_from_the_relays_log() -> None:
    written = [_committed(str(n), "enqueue", n, n, n + 0.1) for n in range(10)]
    records = [_copy(str(n), n + 0.2, n) for n in range(10)] + [_copy(str(n), 20 + n / 10, 10 + n) for n in range(10)]
    log = {"worker wal-s0-g1": "key 'k1' of t released: 5000 held messages published"}

    claimed = check(_evidence(written, records, outputs=log, strategy="wal"))
    released = check(_evidence(written, records, strategy="wal", released=[10], spans=[Span("kill", 0, 19, 19.1)]))

    assert [f.split(":")[0] for f in claimed.findings][:1] == ["duplicates"], claimed.findings
    assert released.ok, released.findings


# -- switch_dupes: a rule ------------------------------------------------------------------------------------------


def test_copies_across_a_switch_past_what_it_publishes_again_are_a_finding_even_within_the_runs_bound() -> None:
    """A kill long before the switch covers the run's sum; the copy across the switch is none of its doing."""
    written = [_row("a", 0.0), _row("b", 0.0)]
    records = [_copy("a", 0.1, 0), _copy("b", 0.2, 1), _copy("a", 30.5, 2)]
    switch = _switch(30.0, "lease", "partitioned", republished=0)
    kill = Span("kill", 0, 0.3, 0.4, "s0-g1 -> s0-g2")

    verdict = check(_evidence(written, records, spans=[kill], order={"a": (7, 1), "b": (7, 2)}, switches=[switch]))

    assert [f.split(":")[0] for f in verdict.findings] == ["copies across switches"], verdict.findings


# -- advisory: a global order by id --------------------------------------------------------------------------------


def test_advisory_first_arrivals_of_a_key_out_of_id_order_are_a_finding() -> None:
    written = [_row("a", 5.0), _row("b", 5.0)]
    records = [_copy("b", 10.0, 0, outbox_id=2), _copy("a", 10.1, 1, outbox_id=1)]

    verdict = check(_evidence(written, records, strategy="advisory"))

    assert [f.split(":")[0] for f in verdict.findings] == ["out of order (first arrivals of a key)"], verdict.findings


def test_advisory_a_row_committed_after_a_later_id_went_out_comes_after_it() -> None:
    """docs/strategies.md: ids are allocation order; a transaction that commits after later ids were published is
    published after them."""
    written = [_row("a", 10.0), _row("b", 0.0)]
    records = [_copy("b", 1.0, 0, outbox_id=2), _copy("a", 10.1, 1, outbox_id=1)]

    verdict = check(_evidence(written, records, strategy="advisory"))

    assert verdict.ok, verdict.findings


# -- the silence check and keys with a bad row ------------------------------------------------------------------


def test_a_key_whose_bad_row_was_discarded_long_ago_is_checked_for_silence_again() -> None:
    bad = _row("x", 0.0)
    bad.bad = "oversize"
    written = [bad, _row("a", 0.5), _row("b", 10.0)]
    records = [_copy("a", 0.6, 0), _copy("b", 25.0, 1)]  # nothing from 10 s to 25 s
    dead = [DeadRow("x", "Broker: Message size too large", 1, False, True, closed_at=2.0)]

    verdict = check(_evidence(written, records, dead=dead))

    assert [f.split(" (")[0] for f in verdict.findings] == ["stalled"], verdict.findings


# -- the other rules, each held by a test of its own ---------------------------------------------------------------


def test_a_record_no_one_committed_is_a_phantom() -> None:
    verdict = check(_evidence([_row("a", 0.0)], [_copy("a", 0.1, 0), _copy("z", 0.2, 1)]))

    assert [f.split(":")[0] for f in verdict.findings] == ["phantom"] and "z" in verdict.findings[0]


def test_a_first_copy_other_than_written_is_corrupted() -> None:
    verdict = check(_evidence([_row("a", 0.0)], [_copy("a", 0.1, 0, key=b"k2")]))

    assert [f.split(":")[0] for f in verdict.findings] == ["corrupted"], verdict.findings


def test_a_good_row_dead_lettered_is_a_finding() -> None:
    dead = [DeadRow("a", "Broker: Message size too large", 1, True, False, closed_at=0.5)]

    verdict = check(_evidence([_row("a", 0.0)], [_copy("a", 1.0, 0)], dead=dead))

    assert [f.split(":")[0] for f in verdict.findings] == ["good row dead-lettered"], verdict.findings


def test_a_good_row_refused_at_enqueue_is_a_finding() -> None:
    refused = _row("a", 0.0)
    refused.outcome, refused.error = "refused", "InvalidMessageError: no"

    verdict = check(_evidence([refused], []))

    assert [f.split(":")[0] for f in verdict.findings] == ["good row refused at enqueue"], verdict.findings


@pytest.mark.parametrize(
    ("delivered", "dead", "finding"),
    [
        (True, [], "was delivered to Kafka"),
        (False, [], "was stored and never dead-lettered"),
        (False, [DeadRow("x", "topic does not exist", 3, False, True, 1.0)], "dead-lettered with another reason"),
    ],
)
def test_a_stored_bad_row_is_dead_lettered_with_its_reason_and_never_delivered(
    delivered: bool, dead: list[DeadRow], finding: str
) -> None:
    bad = _row("x", 0.0)
    bad.bad = "oversize"

    verdict = check(_evidence([bad], [_copy("x", 0.1, 0)] if delivered else [], dead=dead))

    assert len(verdict.findings) == 1 and finding in verdict.findings[0], verdict.findings


def test_a_bad_row_still_held_at_the_end_is_a_finding_of_its_own() -> None:
    """A hold that outlived its dead letter keeps the key's later rows for good (a wal defect the CI schedule found)."""
    bad = _row("x", 0.0)
    bad.bad = "missing-topic"

    verdict = check(_evidence([bad], [], held=["x"]))

    assert [f.split(" (")[0] for f in verdict.findings] == ["bad row missing-topic by enqueue"]
    assert "still held at the end" in verdict.findings[0]


# issue 50: the wal lane's edges (edges.py)


def test_wal_a_stale_copy_published_after_a_newer_message_of_its_key_and_left_last_is_out_of_order() -> None:
    """A thawed streamer's producer sends its batch after the relay that took over published the newer value."""
    written = [_committed("old", "stale-thaw", 1, 1.0, 1.1), _committed("new", "stale-thaw", 2, 2.0, 2.1)]
    log = [_copy("old", 3.0, 0), _copy("new", 3.1, 1)]

    freeze = [Span("freeze", 0, 4.0, 8.0)]
    stale = check(_evidence(written, [*log, _copy("old", 9.0, 2)], spans=freeze, strategy="wal"))
    again = [*log, _copy("old", 9.0, 2), _copy("new", 9.1, 3)]
    republished = check(_evidence(written, again, spans=freeze, strategy="wal"))

    assert [f.split(":")[0] for f in stale.findings] == [
        "out of order (the last record of a key is not its newest message)"
    ], stale.findings
    assert republished.ok, republished.findings  # published again from the slot's position, on to the newest


def test_wal_what_a_restore_undid_may_be_absent_and_what_was_committed_after_it_must_arrive() -> None:
    snapshot = Span("storage-snapshot", None, 10.0, 30.0, "undid the commits from 10.000 to 20.000; the relays back")
    before, undone, after = _row("before", 5.0), _row("undone", 15.0), _row("after", 25.0)

    arrived_or_not = check(
        _evidence(
            [before, undone, after], [_copy("before", 6, 0), _copy("after", 26, 1)], spans=[snapshot], strategy="wal"
        )
    )
    arrived = check(_evidence([undone], [_copy("undone", 16, 0)], spans=[snapshot], strategy="wal"))
    lost = check(_evidence([before, after], [_copy("before", 6, 0)], spans=[snapshot], strategy="wal"))

    assert arrived_or_not.ok and arrived_or_not.figures["undone_by_restore"] == 1, arrived_or_not.findings
    assert arrived.ok, arrived.findings  # no phantom: its writer committed it
    assert [f.split(":")[0] for f in lost.findings] == ["lost"], lost.findings


def test_wal_a_dead_letter_of_a_message_no_writer_wrote_is_forged() -> None:
    evidence = _evidence([_row("a", 1.0)], [_copy("a", 2.0, 0)], strategy="wal")
    evidence.dead = [ledger.DeadRow("f0rged", "publishing: headers are not JSON", 1, False, False)]

    verdict = check(evidence)

    assert [f.split(":")[0] for f in verdict.findings] == [
        "dead letter of a message no writer wrote (forged under the prefix)"
    ], verdict.findings


@pytest.mark.parametrize(
    ("code", "output", "refused"),
    [
        (2, "error: no procedure moves a wal outbox to partitioned yet (its messages are in ...) (docs/wal.md)", True),
        (0, "positions of 0 partitions set for partitioned; start its relays now", False),
        (2, "error: the partitioned strategy reads the outbox by outbox_messages_position, which it lacks", False),
    ],
)
def test_wal_switch_strategy_must_be_refused_with_exit_2_naming_wal(code: int, output: str, refused: bool) -> None:
    evidence = _evidence([], [], strategy="wal")
    evidence.commands = [CliResult(("switch-strategy", "--to", "partitioned", "--mode", "delete"), code, output)]

    verdict = check(evidence)

    assert verdict.ok == refused, verdict.findings


def test_a_good_message_the_database_may_refuse_is_not_expected_once_refused_and_must_arrive_once_stored() -> None:
    """A UTF8 client's text a LATIN1 database cannot hold, a replica-role INSERT into a wal outbox's table."""
    refused, stored = _row("r", 1.0), _row("s", 1.0)
    refused.outcome, refused.refusable, stored.refusable = "refused", True, True

    verdict = check(_evidence([refused, stored], [], strategy="wal"))

    assert [f.split(":")[0] for f in verdict.findings] == ["lost"], verdict.findings
