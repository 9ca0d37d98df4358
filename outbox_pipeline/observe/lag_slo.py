"""The outbox lag SLO's verdict from per-partition lag, computed here so the Dagster check, its sensor and the CLI agree
on what lagging means. See docs/operations.md#lag-and-the-slo."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .. import settings
from ..errors import ConfigurationError
from .horizon import Horizon
from .lag import PartitionLag
from .wal_lag import WalLag

Severity = Literal["ok", "warn", "error"]


@dataclass(frozen=True)
class LagThresholds:
    """WARN above the warn values, ERROR above the error values (age in seconds, rows in the outbox)."""

    warn_age_s: float = settings.LAG_WARN_AGE_S.default
    error_age_s: float = settings.LAG_ERROR_AGE_S.default
    warn_pending: int = settings.LAG_WARN_PENDING.default
    error_pending: int = settings.LAG_ERROR_PENDING.default
    # A wal outbox: bytes of WAL its slot keeps (wal_lag.py).
    warn_retained_bytes: int = settings.WAL_RETAINED_WARN_BYTES.default
    error_retained_bytes: int = settings.WAL_RETAINED_ERROR_BYTES.default
    # A wal outbox: the fraction of max_slot_wal_keep_size its slot may use before a WARN.
    warn_keep_fraction: float = settings.WAL_KEEP_WARN_FRACTION.default

    def __post_init__(self) -> None:
        counts = (self.warn_pending, self.error_pending, self.warn_retained_bytes, self.error_retained_bytes)
        if min(self.warn_age_s, self.error_age_s) < 0 or min(counts) < 0:
            raise ConfigurationError(f"lag thresholds must be >= 0: {self}")
        if not 0 <= self.warn_keep_fraction <= 1:
            raise ConfigurationError(f"the keep-size warn fraction must be in 0..1: {self}")
        if (
            self.warn_age_s > self.error_age_s
            or self.warn_pending > self.error_pending
            or self.warn_retained_bytes > self.error_retained_bytes
        ):
            raise ConfigurationError(f"lag warn thresholds must not exceed the error thresholds: {self}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LagThresholds:
        return cls(
            warn_age_s=settings.LAG_WARN_AGE_S.read(env),
            error_age_s=settings.LAG_ERROR_AGE_S.read(env),
            warn_pending=settings.LAG_WARN_PENDING.read(env),
            error_pending=settings.LAG_ERROR_PENDING.read(env),
            warn_retained_bytes=settings.WAL_RETAINED_WARN_BYTES.read(env),
            error_retained_bytes=settings.WAL_RETAINED_ERROR_BYTES.read(env),
            warn_keep_fraction=settings.WAL_KEEP_WARN_FRACTION.read(env),
        )


@dataclass(frozen=True)
class LagVerdict:
    severity: Severity
    total_pending: int
    oldest_pending_age_s: float | None
    partitions: int
    lagging_partitions: int
    # The partitions that explain the verdict, worst first (oldest pending row, then most rows).
    worst: tuple[PartitionLag, ...]
    # Why, in words ("oldest pending 75.0 s > warn 60 s"); empty when passing.
    reasons: tuple[str, ...]
    thresholds: LagThresholds
    # Keys held behind dead letters, in words ("key 'K' of orders:3 held behind dead letter 4711, 37 rows ...").
    held: tuple[str, ...] = ()
    total_held: int = 0
    # Strategy partitioned: committed rows the xmin horizon holds back, and who holds it, in words (horizon.py).
    horizon: tuple[str, ...] = ()
    held_back: int = 0
    # `outbox status` of the partitions, as a Markdown table (status.markdown); empty when not read.
    status_table: str = ""
    # A wal outbox: its slot (no partitions, no rows: the counts above are 0).
    wal: WalLag | None = None

    @property
    def passed(self) -> bool:
        return self.severity == "ok"

    def summary(self) -> str:
        if self.wal is not None:
            head = self.wal.describe()
            return head if self.passed else f"{self.severity.upper()}: {head} ({'; '.join(self.reasons)})"
        oldest = f"{self.oldest_pending_age_s:.1f} s" if self.oldest_pending_age_s is not None else "none"
        head = (
            f"{self.total_pending} pending in {self.lagging_partitions}/{self.partitions} partitions, oldest {oldest}"
        )
        if self.total_held:
            head += f", {self.total_held} held: {'; '.join(self.held[:3])}"
        if self.horizon:
            head += f"; {' '.join(line.strip() for line in self.horizon[:4])}"
        return head if self.passed else f"{self.severity.upper()}: {head} ({'; '.join(self.reasons)})"


def evaluate_lag(
    lags: Sequence[PartitionLag],
    thresholds: LagThresholds,
    *,
    worst: int = 5,
    held: Sequence[str] = (),
    horizon: Horizon | None = None,
    status_table: str = "",
) -> LagVerdict:
    """Judge the outbox's lag against the thresholds; ``worst`` partitions are named in the verdict, and
    ``held`` (lag.held_keys, described) says which keys wait behind dead letters; ``horizon`` (partitioned)
    adds the committed rows older open transactions hold back, which partition_lag does not count."""
    lagging = [lag for lag in lags if lag.lag > 0]
    held_back = horizon.rows if horizon else 0
    total = sum(lag.lag for lag in lagging) + held_back
    ages = [lag.oldest_pending_age_s for lag in lagging if lag.oldest_pending_age_s is not None]
    ages += [h.oldest_age_s for h in (horizon.held_back if horizon else ()) if h.oldest_age_s is not None]
    oldest = max(ages) if ages else None
    severity: Severity = "ok"
    reasons: list[str] = []
    levels: tuple[tuple[Severity, float, int], ...] = (
        ("error", thresholds.error_age_s, thresholds.error_pending),
        ("warn", thresholds.warn_age_s, thresholds.warn_pending),
    )
    for level, age_limit, pending_limit in levels:
        found = []
        if oldest is not None and oldest > age_limit:
            found.append(f"oldest pending {oldest:.1f} s > {level} {age_limit:g} s")
        if total > pending_limit:
            found.append(f"{total} pending rows > {level} {pending_limit}")
        if found:
            severity, reasons = level, found
            break
    ranked = sorted(lagging, key=lambda lag: (-(lag.oldest_pending_age_s or 0.0), -lag.lag, lag.topic))
    return LagVerdict(
        severity=severity,
        total_pending=total,
        oldest_pending_age_s=oldest,
        partitions=len(lags),
        lagging_partitions=len(lagging),
        worst=tuple(ranked[:worst]),
        reasons=tuple(reasons),
        thresholds=thresholds,
        held=tuple(held),
        total_held=sum(lag.held for lag in lags),
        horizon=tuple(horizon.describe()) if horizon else (),
        held_back=held_back,
        status_table=status_table,
    )


def evaluate_wal_lag(wal: WalLag, thresholds: LagThresholds) -> LagVerdict:
    """Judge a wal outbox: its slot (``_slot_findings``) and what waits beside it (``_beside_findings``); the verdict
    is the worst finding's severity, with the reasons of that severity."""
    findings = _slot_findings(wal, thresholds) + _beside_findings(wal, thresholds)
    severity: Severity = "ok"
    for level in ("warn", "error"):
        if any(found == level for found, _ in findings):
            severity = level
    return LagVerdict(
        severity=severity,
        total_pending=0,
        oldest_pending_age_s=wal.oldest_unpublished_age_s,
        partitions=0,
        lagging_partitions=0,
        worst=(),
        reasons=tuple(reason for found, reason in findings if found == severity),
        thresholds=thresholds,
        held=tuple(key.describe() for key in wal.held),
        total_held=wal.held_messages,
        wal=wal,
    )


def _slot_findings(wal: WalLag, thresholds: LagThresholds) -> list[tuple[Severity, str]]:
    """ERROR when the slot is missing or lost (the relay cannot stream), or ``unreserved`` (PostgreSQL removes the WAL
    it needs at the next checkpoint); else the bytes of WAL it keeps against the retained thresholds and the oldest
    unpublished commit against the age thresholds, as for the table strategies; and WARN once it has used more than
    the warn fraction of max_slot_wal_keep_size, before PostgreSQL invalidates it."""
    slot = wal.slot
    if wal.problem is not None:
        return [("error", "the slot cannot stream")]
    if wal.gap is not None:
        return [("error", wal.gap)]
    if slot.wal_status == "unreserved":
        return [
            (
                "error",
                f"slot {slot.slot} is unreserved: the next checkpoint removes WAL it needs (max_slot_wal_keep_size)",
            )
        ]
    found: list[tuple[Severity, str]] = []
    levels: tuple[tuple[Severity, float, int], ...] = (
        ("error", thresholds.error_age_s, thresholds.error_retained_bytes),
        ("warn", thresholds.warn_age_s, thresholds.warn_retained_bytes),
    )
    age = wal.oldest_unpublished_age_s
    for level, age_limit, bytes_limit in levels:
        if age is not None and age > age_limit:
            found.append((level, f"oldest unpublished commit {age:.1f} s > {level} {age_limit:g} s"))
        if slot.disk_bytes is not None and slot.disk_bytes > bytes_limit:
            spill = f" and {slot.spill_bytes} bytes of spill files" if slot.spill_bytes else ""
            found.append(
                (level, f"slot {slot.slot} retains {slot.retained_bytes} bytes of WAL{spill} > {level} {bytes_limit}")
            )
        if found:
            break
    kept = slot.kept_fraction
    if kept is not None and kept > thresholds.warn_keep_fraction:
        found.append(
            (
                "warn",
                f"slot {slot.slot} has used {kept * 100:.0f} % of max_slot_wal_keep_size > warn "
                f"{thresholds.warn_keep_fraction * 100:.0f} % (safe_wal_size {slot.safe_wal_size} bytes): at 100 % "
                "PostgreSQL invalidates it, with the messages it has not confirmed; start or unblock the relay",
            )
        )
    return found


def _beside_findings(wal: WalLag, thresholds: LagThresholds) -> list[tuple[Severity, str]]:
    """Rows in the message table (no relay reads them: ERROR), held messages against the pending and age thresholds
    as held rows are for the table strategies, and a role that cannot stream while no relay does (WARN)."""
    found: list[tuple[Severity, str]] = []
    if wal.stored_rows:
        found.append(("error", f"{wal.stored_rows} rows stored in the message table, which no relay reads"))
    held = wal.held_messages
    ages = [key.oldest_age_s for key in wal.held if key.oldest_age_s is not None]
    levels: tuple[tuple[Severity, float, int], ...] = (
        ("error", thresholds.error_age_s, thresholds.error_pending),
        ("warn", thresholds.warn_age_s, thresholds.warn_pending),
    )
    for level, age_limit, count_limit in levels:
        here = [f"{held} held messages > {level} {count_limit}"] if held > count_limit else []
        if ages and max(ages) > age_limit:
            here.append(f"oldest held message {max(ages):.1f} s > {level} {age_limit:g} s")
        if here:
            found += [(level, reason) for reason in here]
            break
    if (why := wal.cannot_stream()) is not None:
        found.append(("warn", why))
    return found
