"""Names a package loads on first use (PEP 562), for parts that pull in an
optional or heavy dependency (torch, the privacy stack) which the rest of the
package must not import eagerly."""
from __future__ import annotations

import importlib


def lazy_attributes(package: str, where: dict):
    """A module ``__getattr__`` for ``package``: ``where`` maps each lazy name to
    the submodule (relative, e.g. ``".dpsgd"``) that defines it."""
    def __getattr__(name):
        if name in where:
            return getattr(importlib.import_module(where[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
