"""The run's configuration: the settings every node of a run must share, recorded once per run.

The first node of a run creates ``ROOT/state/config`` (:class:`~.record.RunConfig`, with ``create``: one
node wins) holding its :data:`~.record.RUN_SETTINGS`. Every node checks its own against it at the start of
each ``next_round``, before it takes a ticket or counts as waiting, and is refused with a
:class:`~rdzv_core.errors.RunConfigMismatchError` naming the setting and both values: the run and its
round are not touched. A run without the key (created by an older version, reset, or lost by a backend
restarted empty) has it written by the next node that checks. The key lives under the run's tree, so
closing the run gives it the closed run's TTL with every other key (``Rendezvous.set_closed``), and
``rdzv reset`` deletes it.
"""

from __future__ import annotations

from typing import Any

from ..errors import CompareFailedError, KeyExistsError, KeyNotFoundError, RunConfigMismatchError
from ..kv import KVBackend
from .params import RendezvousParams
from .record import RUN_SETTINGS, RunConfig, RunKeys

__all__ = ["config_of", "check_run_config", "record_run_config", "mismatch_error", "shown"]

#: Passes of :func:`check_run_config`; each lost one means the key was created or deleted meanwhile.
_PASSES = 8


def config_of(params: RendezvousParams) -> RunConfig:
    """The run settings (:data:`~.record.RUN_SETTINGS`) of a node's ``params``."""
    return RunConfig(params.min_nodes, params.limit, float(params.last_call_timeout), float(params.keep_alive_ttl),
                     params.rank_policy, None if params.closed_run_ttl is None else float(params.closed_run_ttl),
                     params.reform)


def shown(value: Any) -> str:
    """A setting's value as written in a URL (``none`` for ``None``, ``5`` for 5.0)."""
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def mismatch_error(run_id: str, differences: tuple[tuple[str, Any, Any], ...],
                   run: RunConfig) -> RunConfigMismatchError:
    """The error for a node whose settings differ from the run's ``run`` (``differences``: as
    :meth:`RunConfig.differences`, not empty): every differing setting, both values, and what to do."""
    first = "; ".join(f"{name}={shown(mine)} differs from the run's {name}={shown(theirs)}"
                      for name, mine, theirs in differences)
    fix = ", ".join(f"{name}={shown(theirs)}" for name, _, theirs in differences)
    nnodes = f" (--nnodes {run.min_nodes}:{run.max_nodes})" if {"min_nodes", "max_nodes"} & {
        name for name, _, _ in differences} else ""
    message = (f"run {run_id}: {first} (set when the run was created); every node of a run must use the same "
               f"{', '.join(RUN_SETTINGS)}. Start this node with {fix}{nnodes}, or use a new run id for a job with "
               f"other settings. This node did not join; the run is left as it was")
    return RunConfigMismatchError(run_id, differences, message)


def check_run_config(kv: KVBackend, keys: RunKeys, params: RendezvousParams) -> tuple[RunConfig | None, bool]:
    """Check this node's run settings against the run's configuration, recording them if the run has none.

    Reads ``ROOT/state/`` once (a second read and a write only for the node that records). A closed run is
    not checked (``None``: the caller reports it closed). A configuration this node created is deleted again
    if the run turns out closed meanwhile, so that it never outlives the closed run's keys (their TTL was
    given before it existed).

    Returns:
        ``(the run's configuration, whether this call recorded it)``; the configuration is ``None`` when the
        run is closed, or the key kept being created and deleted under this node (it then goes on unchecked).

    Raises:
        RunConfigMismatchError: a setting of ``params`` differs from the run's (nothing was written).
        RendezvousStateError: the stored configuration is corrupt (names the key).
        BackendUnavailableError, BackendClosedError: from ``kv``.
    """
    mine = config_of(params)
    for _ in range(_PASSES):
        found = {e.key: e for e in kv.list(keys.state_dir)[0]}
        if keys.closed in found:
            return None, False
        entry = found.get(keys.config)
        if entry is not None:
            run = RunConfig.decode(entry)
            differences = mine.differences(run)
            if differences:
                raise mismatch_error(keys.run_id, differences, run)
            return run, False
        try:
            created = kv.create(keys.config, mine.encode())
        except KeyExistsError:
            continue  # another node recorded it first: compare with theirs
        if kv.get(keys.closed) is not None:  # closed between the read and the create
            try:
                kv.compare_and_delete(keys.config, created.revision)
            except (CompareFailedError, KeyNotFoundError):
                pass
            return None, False
        return mine, True
    return None, False


def record_run_config(kv: KVBackend, keys: RunKeys, params: RendezvousParams) -> bool:
    """Write this node's run settings as the run's configuration where the run has none (a member
    re-establishing its round after the backend lost the run's keys). Whether this call wrote it.

    Raises:
        BackendUnavailableError, BackendClosedError: from ``kv``.
    """
    try:
        kv.create(keys.config, config_of(params).encode())
    except KeyExistsError:
        return False
    return True
