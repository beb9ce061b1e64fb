"""PEP 562 module ``__getattr__`` for the backend packages: names served from their implementation
module on first use, so importing a package (the entry point) imports no client library."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_attributes(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the module ``module`` that returns ``names[name]``'s attribute
    ``name`` (``names``: attribute -> the module that defines it), importing it then.

    Raises:
        AttributeError: ``name`` is not one of ``names``.
    """

    def __getattr__(name: str) -> Any:
        source = names.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(importlib.import_module(source), name)

    return __getattr__
