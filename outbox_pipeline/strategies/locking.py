"""Strategy `locking`: one long transaction per batch with `FOR UPDATE SKIP LOCKED`, the simplest relay that lets many
workers run side by side, at the price of row locks held for the whole publish. See
docs/strategies.md#locking-one-transaction-per-batch."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from typing import ClassVar, Literal

import psycopg
from psycopg import IsolationLevel

from ..model import AckResult, Claim, PublishOutcome
from .base import Strategy, StrategyConfig
from .rows import FairPick, claim_fair, finish


class LockingStrategy(Strategy):
    name: ClassVar[str] = "locking"
    ordered: ClassVar[bool] = False
    pipelining: ClassVar[Literal["shared", "own-connection"]] = "own-connection"

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        super().__init__(conn, config)
        # SKIP LOCKED semantics are defined for READ COMMITTED; say so rather than inherit a default.
        conn.isolation_level = IsolationLevel.READ_COMMITTED
        self._pick = FairPick.build(config, lock=True)

    def claim(self, limit: int, avoid: Collection[int] = ()) -> Claim | None:
        transaction = contextlib.ExitStack()
        transaction.enter_context(self.conn.transaction())
        try:
            records = claim_fair(self.conn, self.config, self._pick, limit, avoid)
        except BaseException:
            _rollback(transaction)
            raise
        if not records:
            _rollback(transaction)
            return None
        records.sort(key=lambda r: r.id)
        return Claim(records, state=transaction)

    def ack(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        transaction: contextlib.ExitStack = claim.state
        try:
            result = finish(self.conn, self.config, outcome)
        except BaseException:
            _rollback(transaction)
            raise
        transaction.close()  # COMMIT
        return result

    def give_back(self, claim: Claim, error: str) -> None:
        _rollback(claim.state)


def _rollback(transaction: contextlib.ExitStack) -> None:
    transaction.__exit__(psycopg.Rollback, psycopg.Rollback(), None)
