"""The table strategies, one module each behind ``base.Strategy``: which rows a worker may claim and what its ack
records. Each module: docs/architecture.md#strategies; the strategies compared: docs/strategies.md."""

from __future__ import annotations

import argparse
import importlib

from ..model import ORDERED_FIRST, RECORDED_NAMES, STRATEGY_NAMES
from . import positions
from .advisory import ADVISORY_LOCK_CLASS, AdvisoryStrategy
from .base import RECORD_COLUMNS, AckMode, Strategy, StrategyConfig, fetch_records
from .lease import LeaseStrategy
from .positions import PositionStrategy
from .quarantine import ON_POISON_CHOICES, OnPoison, dead_letter_held, on_poison_from_env

# The position strategies' own names are in ``positions``.
__all__ = [
    "ADVISORY_LOCK_CLASS",
    "ON_POISON_CHOICES",
    "RECORD_COLUMNS",
    "AckMode",
    "AdvisoryStrategy",
    "LeaseStrategy",
    "OnPoison",
    "PositionStrategy",
    "Strategy",
    "StrategyConfig",
    "dead_letter_held",
    "fetch_records",
    "on_poison_from_env",
    "positions",
    "strategy_class",
    "strategy_list",
]

# Each strategy's module and class: ``locking`` is ``locking.LockingStrategy``.
_MODULES = {name: (name, f"{name.capitalize()}Strategy") for name in STRATEGY_NAMES}


def strategy_list(text: str) -> list[str]:
    """An argparse type: ``a,b`` or ``all`` (the ordered strategies first); a wrong name is a usage error."""
    names = list(ORDERED_FIRST) if text == "all" else [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(RECORDED_NAMES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown strategies {unknown}; choose from {', '.join(RECORDED_NAMES)}")
    return names


def strategy_class(name: str) -> type[Strategy]:
    try:
        module, cls = _MODULES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(_MODULES)}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)  # type: ignore[no-any-return]
