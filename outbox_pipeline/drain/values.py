"""What a bulk drain's driver and its tasks hand each other (the plan, each task's report, the outcome), as JSON, so the
engine never depends on who runs the tasks. See docs/spark.md#the-drains-steps-and-who-runs-each."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from ..config import OutboxTable
from ..errors import OutboxError
from ..model import WAL
from ..strategies import strategy_class
from ..strategies.positions import PositionStrategy

OWNER_PREFIX = "bulk-drain:"
DRAIN_STRATEGIES = ("partitioned", "serialized")
DEFAULT_LEASE_S = 3600.0
DEFAULT_FETCH_ROWS = 10_000


class DrainError(OutboxError):
    """A bulk drain cannot run or its task cannot finish (nothing was committed)."""


class LeaseLostError(DrainError):
    """The drain no longer owns a partition (expired, released by an operator): stop publishing it."""


class DeliveryError(DrainError):
    """Kafka did not confirm every message of a range; ``delivered`` is what the range's pages before the failing
    one delivered (None: nothing), which the driver commits."""

    def __init__(self, message: str, *, delivered: RangeDelivery | None = None) -> None:
        super().__init__(message)
        self.delivered = delivered


def drain_owner(run_id: str) -> str:
    """The ``locked_by`` value of a drain's leases: recognisable in lag reports and by later drains."""
    return f"{OWNER_PREFIX}{run_id}"


def no_drain(strategy: str) -> str | None:
    """Why an outbox relayed by ``strategy`` gets no bulk drain (None: it does); one copy for the engine, the Spark
    asset and the drain sensor."""
    if strategy in DRAIN_STRATEGIES:
        return None
    if strategy == WAL:
        return (
            f"a bulk drain serves the position strategies ({', '.join(DRAIN_STRATEGIES)}), not wal: a wal outbox keeps "
            "no rows, its backlog is in the replication slot, which one relay streams (`outbox relay`; a backlog "
            "drain's speed is in docs/performance.md)"
        )
    return (
        f"a bulk drain serves the position strategies ({', '.join(DRAIN_STRATEGIES)}), not {strategy!r}: row "
        "strategies keep delivery state on every row, so drain those with the online relay"
    )


def position_class(strategy: str) -> type[PositionStrategy]:
    if (why := no_drain(strategy)) is not None:
        raise DrainError(why)
    cls = strategy_class(strategy)
    assert issubclass(cls, PositionStrategy)
    return cls


def position_key(strategy: str, xid: str, row_id: int) -> tuple[int, ...]:
    """A position as a comparable tuple, in the strategy's publishing order."""
    return (int(xid), row_id) if strategy == "partitioned" else (row_id,)


@dataclass(frozen=True)
class DrainRange:
    """One virtual partition's frozen range: the rows after (start) up to and including (end)."""

    topic: str
    partition: int
    start_xid: str
    start_id: int
    end_xid: str
    end_id: int

    @property
    def label(self) -> str:
        return f"{self.topic}/{self.partition}"


@dataclass(frozen=True)
class DrainPlan:
    """What a drain owns and how far it goes; JSON, so it can travel to tasks as a plain option."""

    owner: str
    strategy: str
    schema: str
    lease_s: float
    ranges: tuple[DrainRange, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DrainPlan:
        raw = json.loads(text)
        return cls(
            owner=raw["owner"],
            strategy=raw["strategy"],
            schema=raw["schema"],
            lease_s=float(raw["lease_s"]),
            ranges=tuple(DrainRange(**r) for r in raw["ranges"]),
        )

    @property
    def table(self) -> OutboxTable:
        return OutboxTable(schema=self.schema)


@dataclass(frozen=True)
class RangeDelivery:
    """What one task confirmed: every row of its range up to (last_xid, last_id), in order."""

    topic: str
    partition: int
    rows: int
    bytes: int
    last_xid: str
    last_id: int
    elapsed_s: float

    @property
    def label(self) -> str:
        return f"{self.topic}/{self.partition}"


@dataclass(frozen=True)
class RangeReport:
    """What one task reports: what it confirmed (None: nothing), and what stopped it short of its end."""

    label: str
    delivery: RangeDelivery | None
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {"label": self.label, "delivery": asdict(self.delivery) if self.delivery else None, "error": self.error}
        )

    @classmethod
    def from_json(cls, text: str) -> RangeReport:
        raw = json.loads(text)
        return cls(raw["label"], RangeDelivery(**raw["delivery"]) if raw["delivery"] else None, raw["error"])


@dataclass(frozen=True)
class DrainOutcome:
    """The driver's commit: positions moved, partitions it could not move (and why), and ranges that stopped short
    of their end (and what stopped them: their confirmed part is in ``committed``)."""

    committed: tuple[RangeDelivery, ...] = ()
    # label -> reason: lease lost, no delivery reported, delivery outside the planned range
    not_committed: Mapping[str, str] = field(default_factory=dict)
    # label -> the error that stopped the range (a message Kafka did not confirm, the lease lost)
    failed: Mapping[str, str] = field(default_factory=dict)
