"""Small helpers shared across rooms."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def config_from_dict(cls: type, options: Mapping[str, Any], where: str) -> Any:
    """Build a config dataclass, naming the offending key and the valid ones on a typo."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; known: {sorted(known)}")
    return cls(**options)
