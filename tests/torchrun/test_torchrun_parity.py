"""``rdzv-run`` against the installed torchrun: every flag accepted, the same worker variables.

* The flags: torch's own parser (``torch.distributed.run.get_args_parser()``) against
  ``rdzv-run``'s; a torch release that adds a flag fails here.
* The worker variables: the same job under real ``torchrun`` and real ``rdzv-run``
  (two workers; the static rendezvous, and an elastic one: torchrun through the
  ``rdzv-file`` handler, rdzv-run with ``--rdzv-backend file``); each worker dumps
  its environment and the variables either launcher set are compared by name and value.

docs/torchrun.md has the parity table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
from torch.distributed.argparse_util import check_env, env
from torch.distributed.run import get_args_parser

from tests.support.agent_workers.harness import processes_of_run
from rdzv_agent.launch.args import _PetFlag, _PetValue, build_parser
from rdzv_agent.master_address import choose_port

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)

#: Variables whose values legitimately differ between the two launchers, and why.
DIFFERENT_VALUES = {
    "MASTER_PORT": "a free port each launcher picks (elastic), or the --master-port each test run is given",
    "TORCHELASTIC_ERROR_FILE": "a path in a new temporary log directory of each run (its layout is compared)",
}
#: Variables only rdzv-run sets, and why.
RDZV_ONLY = {
    "PYTHONUNBUFFERED": "rdzv-run sets 1 so that a Python under --no-python (a wrapper script) is unbuffered too; "
                        "torchrun relies on python -u, which rdzv-run passes as well",
    "RDZV_PROGRESS_FILE": "where the worker reports its step (rdzv_agent.progress; torchrun has no progress view)",
    "RDZV_STACK_FILE": "where the worker's stacks go on a hang (rdzv-run --hang-timeout; torchrun has none)",
    "RDZV_REAPER_TOKEN": "marks what the worker starts, stopped after a kill -9 of rdzv-run "
                         "(rdzv_agent.workers.reaper; torchrun stops nothing the workers start)",
}

DUMP = textwrap.dedent(
    """
    import json, os, sys
    record = dict(os.environ, __executable__=sys.executable)
    with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
        json.dump(record, f)
    """
)


def _option_strings(parser):
    return {s: a for a in parser._actions for s in a.option_strings}


def test_rdzv_run_accepts_every_torchrun_flag():
    torch_opts, ours = _option_strings(get_args_parser()), _option_strings(build_parser())
    missing = set(torch_opts) - set(ours)
    assert not missing, f"torchrun flags rdzv-run lacks: {sorted(missing)}"
    for name, action in torch_opts.items():
        mine = ours[name]
        assert set(mine.option_strings) >= set(action.option_strings), name  # both spellings
        if isinstance(action, (env, check_env)):  # torch reads PET_<OPTION>: so must we
            assert isinstance(mine, (_PetValue, _PetFlag)), f"{name} does not read PET_{action.dest.upper()}"
        if action.choices is not None:
            assert set(mine.choices or ()) == set(action.choices), name
        assert (action.nargs == 0) == (mine.nargs == 0), f"{name}: flag vs option with a value differs"


def _launch(module, argv, env_, cwd):
    proc = subprocess.run([sys.executable, "-m", module, *argv], env=env_, cwd=cwd, capture_output=True,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{module} {argv}: {proc.returncode}\n{proc.stderr.decode(errors='replace')[-3000:]}"


def _records(out):
    found = {}
    for name in os.listdir(out):
        with open(os.path.join(out, name)) as f:
            found[name.removesuffix(".json")] = json.load(f)
    return found


def _set_by_launcher(record, parent):
    return {k: v for k, v in record.items() if parent.get(k) != v}


CASES = {
    "static": ([], {}),
    "elastic": (["--nnodes", "1:2", "--rdzv-id", "RUN_ID", "--rdzv-conf", "last_call_timeout=0.5"], {}),
    "virtual-local-rank": (["--virtual-local-rank"], {"CUDA_VISIBLE_DEVICES": "7,3"}),
    "signals-and-python-exec": (["--signals-to-handle", "SIGTERM,SIGUSR1"], {"PYTHON_EXEC": "LINKED_PYTHON"}),
    "worker-identical": ([], {"TORCH_ELASTIC_WORKER_IDENTICAL": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_workers_see_the_variables_torchrun_gives(case, tmp_path):
    extra_args, extra_env = CASES[case]
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    python = tmp_path / "linked-python"
    python.symlink_to(sys.executable)
    run_id = f"parity{uuid.uuid4().hex[:8]}"
    parent = {k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS", "RDZV_URL")}
    parent.update({k: str(python) if v == "LINKED_PYTHON" else v for k, v in extra_env.items()})
    parent["TMPDIR"] = str(tmp_path)
    extra_args = [run_id if a == "RUN_ID" else a for a in extra_args]
    seen = {}
    for name, module, backend in (("torchrun", "torch.distributed.run", "rdzv-file"),
                                  ("rdzv-run", "rdzv_agent.launch.launcher", "file")):
        out = tmp_path / name
        out.mkdir()
        if case == "elastic":
            target = ["--rdzv-backend", backend, "--rdzv-endpoint", str(tmp_path / f"store-{name}")]
        else:
            target = ["--master-port", str(choose_port())]
        try:
            _launch(module, [*target, "--nproc-per-node", "2", "--monitor-interval", "0.1", *extra_args,
                             str(script), str(out)], parent, tmp_path)
        finally:
            for proc in processes_of_run(run_id):
                proc.kill()
        seen[name] = _records(str(out))
    torch_recs, rdzv_recs = seen["torchrun"], seen["rdzv-run"]
    assert sorted(torch_recs) == sorted(rdzv_recs) == ["0", "1"]
    for rank in ("0", "1"):
        theirs, ours = _set_by_launcher(torch_recs[rank], parent), _set_by_launcher(rdzv_recs[rank], parent)
        assert set(theirs) - set(ours) == set(), f"rank {rank}: torchrun sets, rdzv-run does not"
        assert set(ours) - set(theirs) == set(RDZV_ONLY), f"rank {rank}: only rdzv-run sets"
        differ = {k: (theirs[k], ours[k]) for k in theirs if theirs[k] != ours[k] and k not in DIFFERENT_VALUES}
        assert differ == {}, f"rank {rank}: torchrun's value, rdzv-run's"
        for record in (theirs, ours):  # the error file's layout: .../attempt_0/LOCAL_RANK/error.json
            local = record["LOCAL_RANK"] if case != "virtual-local-rank" else rank
            assert record["TORCHELASTIC_ERROR_FILE"].endswith(os.path.join("attempt_0", local, "error.json"))
    if case == "virtual-local-rank":
        assert [rdzv_recs[r]["CUDA_VISIBLE_DEVICES"] for r in "01"] == ["7", "3"]
        assert {rdzv_recs[r]["LOCAL_RANK"] for r in "01"} == {"0"}
    if case == "signals-and-python-exec":
        assert {rdzv_recs[r]["__executable__"] for r in "01"} == {str(python)}
        assert {rdzv_recs[r]["TORCHELASTIC_SIGNALS_TO_HANDLE"] for r in "01"} == {"SIGTERM,SIGUSR1"}


def _role_view(records):
    """``(ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, RANK, WORLD_SIZE)`` of every worker, in global rank order."""
    keys = ("ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "RANK", "WORLD_SIZE")
    return [tuple(r[k] for k in keys) for r in sorted(records.values(), key=lambda r: int(r["RANK"]))]


def _torch_role_ranks(roles_in_rank_order):
    """What torch's ``_assign_worker_ranks`` gives workers of these roles (global rank order)."""
    sizes = {role: roles_in_rank_order.count(role) for role in roles_in_rank_order}
    seen: dict[str, int] = {}
    out = []
    for rank, role in enumerate(roles_in_rank_order):
        out.append((role, str(seen.get(role, 0)), str(sizes[role]), str(rank), str(len(roles_in_rank_order))))
        seen[role] = seen.get(role, 0) + 1
    return out


@pytest.mark.slow
def test_per_role_ranks_match_torchrun(tmp_path):
    """Three nodes, two roles, different worker counts: ROLE_RANK/ROLE_WORLD_SIZE as torchrun's agent gives them."""
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    nodes = [("trainer", "2"), ("reader", "1"), ("trainer", "1")]
    parent = {k: v for k, v in os.environ.items() if k != "RDZV_URL"}
    for name, module, backend in (("torchrun", "torch.distributed.run", "rdzv-file"),
                                  ("rdzv-run", "rdzv_agent.launch.launcher", "file")):
        out = tmp_path / name
        out.mkdir()
        run_id = f"roles{uuid.uuid4().hex[:8]}"
        argv = ["--nnodes", "3", "--rdzv-backend", backend, "--rdzv-endpoint", str(tmp_path / f"store-{name}"),
                "--rdzv-id", run_id, "--rdzv-conf", "last_call_timeout=0.5", "--monitor-interval", "0.1"]
        procs = [subprocess.Popen([sys.executable, "-m", module, *argv, "--role", role, "--nproc-per-node", n,
                                   str(script), str(out)], env=parent, cwd=tmp_path, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for role, n in nodes]
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=180)
                assert proc.returncode == 0, f"{name}: {err.decode(errors='replace')[-3000:]}"
        finally:
            for proc in procs:
                proc.kill()
            for proc in processes_of_run(run_id):
                proc.kill()
        view = _role_view(_records(str(out)))
        assert sorted(v[0] for v in view) == ["reader", "trainer", "trainer", "trainer"], name
        assert view == _torch_role_ranks([v[0] for v in view]), name
