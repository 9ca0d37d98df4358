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

from ..model import ORDERED_FIRST, RECORDED_NAMES, STRATEGY_NAMES
from .base import Strategy

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
