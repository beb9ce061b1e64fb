"""The old name of ``rdzv-run``'s option modules: :mod:`rdzv_agent.launch_args` (the parser) and
:mod:`rdzv_agent.launch_config` (options -> :class:`LaunchConfig`). Import from those."""

from __future__ import annotations

import urllib.parse

from rdzv_core.url import QUERY_ALIASES

from .launch_args import *  # noqa: F403
from .launch_args import __all__ as _args_all
from .launch_args import _nnodes  # noqa: F401
from .launch_config import *  # noqa: F403
from .launch_config import __all__ as _config_all

__all__ = [*_args_all, *_config_all, "merge_query"]


def merge_query(url: str, extra: dict[str, str]) -> str:
    """``url`` with ``extra`` query keys set, replacing the same keys (and their aliases) there.

    Kept for old importers; the launcher uses :meth:`rdzv_core.url.RendezvousURL.with_params`.
    """
    base, sep, query = url.partition("?")
    if not extra:
        return url
    canonical = {QUERY_ALIASES.get(k, k) for k in extra}
    kept = [(k, v) for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True)
            if QUERY_ALIASES.get(k, k) not in canonical]
    return base + "?" + urllib.parse.urlencode(kept + list(extra.items()))
