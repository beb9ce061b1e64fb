"""Count full rendezvous-URL parses: every call of ``rdzv_core.url.parse_url``, and of ``urllib.parse.parse_qsl``
from this project's packages (``rdzv_*``; a client library's own calls are not counted).

:func:`install` replaces each function in every loaded module that holds it (``from x import f``
copies included), so no caller escapes the count; modules imported later get the wrapper from
the module that defines it.
"""

from __future__ import annotations

import sys
import urllib.parse
from typing import Any, Callable

import rdzv_core.url

COUNTED = ((rdzv_core.url, "parse_url"), (urllib.parse, "parse_qsl"))


def install(record: Callable[[str], None]) -> Callable[[], None]:
    """Wrap the :data:`COUNTED` functions so that each call runs ``record(name)``; returns the undo."""
    undo: list[tuple[Any, str, Any]] = []
    for owner, name in COUNTED:
        original = getattr(owner, name)

        def wrapper(*args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            if sys._getframe(1).f_globals.get("__name__", "").startswith("rdzv_"):
                record(__name)
            return __original(*args, **kwargs)

        for module in list(sys.modules.values()):
            for attr, value in list(vars(module).items()) if module is not None else ():
                if value is original:
                    setattr(module, attr, wrapper)
                    undo.append((module, attr, original))

    def uninstall() -> None:
        for module, attr, original in undo:
            setattr(module, attr, original)

    return uninstall
