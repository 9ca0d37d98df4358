"""A package whose names resolve on first use (PEP 562): importing it must not import every module it exports, where
that would be a cycle or would load Dagster into a Spark executor (docs/architecture.md#layers)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The package's ``__getattr__``: each name of ``exports`` (name -> relative module) imported from its module when
    first asked for; any other name is an AttributeError, as for a plain module."""

    def resolve(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name], package), name)

    return resolve
