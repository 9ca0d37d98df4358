"""Engine room: the relay strategies, one module each, behind ``base.Strategy``.

| name        | seed variant | order            | rows mutated            | workers              |
|-------------|--------------|------------------|-------------------------|----------------------|
| locking     | talk 1       | none             | delete / mark sent      | many (SKIP LOCKED)   |
| advisory    | talk 1.1     | global, by id    | delete / mark sent      | one active at a time |
| lease       | talk 2       | none             | lease + delete / mark   | many (leases)        |
| partitioned | talk 3       | per partition    | never (offsets only)    | one per partition    |
| serialized  | talk 4       | per partition    | never (offsets only)    | one per partition    |

``wal`` is not a table strategy: writers emit logical decoding messages and the relay streams them from a
replication slot (store/wal/, relay/wal/). It is an outbox's strategy all the same (recorded, named by --strategy).
"""

from __future__ import annotations

import argparse
import importlib

from .base import Strategy

_MODULES = {
    "locking": ("locking", "LockingStrategy"),
    "advisory": ("advisory", "AdvisoryStrategy"),
    "lease": ("lease", "LeaseStrategy"),
    "partitioned": ("partitioned", "PartitionedStrategy"),
    "serialized": ("serialized", "SerializedStrategy"),
}
STRATEGY_NAMES = tuple(_MODULES)
WAL = "wal"
# What an outbox can be relayed by: the table strategies and the wal lane.
RECORDED_NAMES = (*STRATEGY_NAMES, WAL)
# The strategies that keep a position per partition (the others mark or delete rows).
POSITION_STRATEGIES = ("partitioned", "serialized")
# Every strategy, the ordered ones first (``all``).
ORDERED_FIRST = ("partitioned", "serialized", "advisory", "lease", "locking")


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
