"""A real PostgreSQL server for tests, and the ``rdzv_server_postgres`` pytest fixture.

:class:`PostgresServer` is a :class:`conformance_tests.servers.ServerProcess`:
a private ``initdb`` cluster in a temporary directory, a ``postgres`` on a free
loopback port (TCP only: no Unix socket), kill -9 / restart on the same port and
data / pause, as the suite's ``faults`` group expects. Settings are for tests:
``fsync=off`` — an acknowledged commit survives ``kill -9`` of the server (it was
written to the OS), not a crash of the OS.

``initdb`` and ``postgres`` refuse to run as root; as root they run as the
``postgres`` user (Debian's package creates it; else ``nobody``) through
``setpriv``, which execs, so the process started IS the postmaster.

Binaries: ``$PG_BIN`` if set, else the newest ``/usr/lib/postgresql/*/bin``
(Debian's layout), else ``PATH``. Debian: ``apt-get install -y postgresql``.

Use it as a pytest plugin (``-p rdzv_postgres.testing``) or import the fixture
into a ``conftest.py``; then ``--rdzv-url 'postgresql://{server:postgres}/'``
runs the conformance suite against it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Iterator, Sequence

import pytest

from conformance_tests.servers import ServerProcess

if TYPE_CHECKING:
    import psutil

__all__ = ["PostgresServer", "postgres_bin_dir", "rdzv_server_postgres"]

#: pg_hba.conf of the test cluster, for the plugin's own tests of ``tls`` and ``auth``: the role
#: ``rdzv_tls`` must come over TLS, ``rdzv_password`` must give its password; everyone else is
#: trusted on loopback (roles are created by the tests that need them).
PG_HBA = """\
hostssl all rdzv_tls       127.0.0.1/32 trust
host    all rdzv_tls       127.0.0.1/32 reject
host    all rdzv_password  127.0.0.1/32 scram-sha-256
host    all all            127.0.0.1/32 trust
"""


def postgres_bin_dir() -> str:
    """The directory holding ``initdb`` and ``postgres`` (see the module docstring).

    Raises:
        FileNotFoundError: no PostgreSQL server binaries were found.
    """
    candidates = [os.environ.get("PG_BIN", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    for directory in candidates:
        if directory and os.access(os.path.join(directory, "postgres"), os.X_OK):
            return directory
    found = shutil.which("postgres")
    if found:
        return os.path.dirname(found)
    raise FileNotFoundError("no PostgreSQL server binaries (apt-get install -y postgresql, or set PG_BIN)")


def _run_as() -> str | None:
    """The user to run the server as when we are root, else ``None`` (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("running as root, but there is neither a 'postgres' nor a 'nobody' user to run PostgreSQL")


class PostgresServer(ServerProcess):
    """``postgres`` on ``127.0.0.1:port`` with a fresh cluster whose superuser is :attr:`user` (trusted).

    The superuser is named after the OS user running the tests (libpq's default
    user), so ``postgresql://{server:postgres}/`` needs no user name.

    Args:
        settings: extra ``postgres -c NAME=VALUE`` settings (e.g. ``{"ssl": "on", ...}``).

    Attributes:
        user: the superuser: the name of the OS user running the tests (str).
        pgdata: the cluster directory (inside :attr:`data_dir`).

    Raises (from :meth:`start`):
        FileNotFoundError: no PostgreSQL binaries.
        RuntimeError: ``initdb`` failed, or the server did not accept a connection in time.
    """

    name = "postgres"

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.bin_dir = postgres_bin_dir()  # before the data directory exists: nothing to clean up if it fails
        super().__init__()
        self.pgdata = os.path.join(self.data_dir, "pgdata")
        self.settings = dict(settings or {})
        # libpq's default user is the client's OS user: name the superuser so, and URLs need no user.
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self.run_as = _run_as()
        if self.run_as is not None:
            pw = pwd.getpwnam(self.run_as)
            os.chown(self.data_dir, pw.pw_uid, pw.pw_gid)

    def _as_user(self, argv: Sequence[str]) -> list[str]:
        if self.run_as is None:
            return list(argv)
        return ["setpriv", f"--reuid={self.run_as}", f"--regid={self.run_as}", "--init-groups", *argv]

    def own(self, path: str) -> None:
        """Give ``path`` to the server's user, readable by it alone (for certificate and key files)."""
        os.chmod(path, 0o600)
        if self.run_as is not None:
            pw = pwd.getpwnam(self.run_as)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def initdb(self) -> None:
        """Create the cluster (once; a restart reuses it)."""
        if os.path.exists(os.path.join(self.pgdata, "PG_VERSION")):
            return
        argv = [os.path.join(self.bin_dir, "initdb"), "-D", self.pgdata, "-U", self.user, "--auth=trust",
                "-E", "UTF8", "--locale=C", "--no-sync"]
        done = subprocess.run(self._as_user(argv), capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        hba = os.path.join(self.pgdata, "pg_hba.conf")
        with open(hba, "w", encoding="ascii") as f:
            f.write(PG_HBA)
        self.own(hba)

    def command(self) -> Sequence[str]:
        settings = {
            "listen_addresses": self.host,
            "unix_socket_directories": "",
            # Every commit is written to the OS before it is acknowledged (synchronous_commit stays on, so a
            # kill -9 loses nothing acknowledged); fsync=off only skips the flush to disk (an OS crash could lose).
            "fsync": "off",
            "full_page_writes": "off",
            "max_connections": "300",
            "shared_buffers": "64MB",
            **self.settings,
        }
        argv = [os.path.join(self.bin_dir, "postgres"), "-D", self.pgdata, "-p", str(self.port)]
        for name, value in settings.items():
            argv += ["-c", f"{name}={value}"]
        return self._as_user(argv)

    def start(self) -> None:
        self.initdb()
        super().start()

    def ready(self) -> bool:
        """The server accepts a connection and answers ``SELECT 1`` (not "starting up")."""
        import psycopg

        try:
            with psycopg.connect(host=self.host, port=self.port, user=self.user, dbname="postgres",
                                 connect_timeout=2, sslmode="disable" if "ssl" not in self.settings else "prefer") as c:
                c.execute("SELECT 1")
                return True
        except psycopg.OperationalError:
            time.sleep(0.05)
            return False

    def sql(self, statement: str) -> None:
        """Run one statement as the superuser (e.g. ``CREATE ROLE ...``)."""
        import psycopg

        with psycopg.connect(host=self.host, port=self.port, user=self.user, dbname="postgres",
                             autocommit=True, connect_timeout=5) as conn:
            conn.execute(statement)  # type: ignore[arg-type]

    def url(self, run_id: str = "", **query: str) -> str:
        """A ``postgresql://`` URL for this server as :attr:`user` (``run_id`` and query keys optional)."""
        tail = "&".join(f"{k}={v}" for k, v in query.items())
        return f"postgresql://{self.user}@{self.address}/{run_id}" + (f"?{tail}" if tail else "")

    # PostgreSQL's children call setsid(): each leads its own session, so signal them one by one.
    def _cluster(self) -> list["psutil.Process"]:
        """The postmaster and every process it started (empty once it is gone)."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def _signal_group(self, sig: int) -> None:
        import psutil

        for proc in self._cluster():
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass  # exited meanwhile

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends (a crash; the next start recovers from the WAL)."""
        import psutil

        cluster = self._cluster()
        if cluster:
            self._signal_group(signal.SIGCONT)
            self._signal_group(signal.SIGKILL)
            psutil.wait_procs(cluster, timeout=10)
            if self.proc is not None:
                self.proc.wait(timeout=10)  # reap it

    def pause(self) -> None:
        """SIGSTOP every process of the cluster and wait (10 s at most) until all have stopped.

        Connections stay open; nothing answers. ``kill -STOP`` is asynchronous: a backend
        could still answer one request before the kernel stops it, hence the wait.
        """
        self._signal_group(signal.SIGSTOP)
        if self.proc is None or self.proc.poll() is not None:
            return
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and not self._all_stopped():
            time.sleep(0.005)

    def _all_stopped(self) -> bool:
        import psutil

        done = (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        try:
            return all(p.status() in done for p in self._cluster())
        except psutil.Error:
            return False  # one exited or appeared meanwhile: look again

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def stop(self) -> None:
        """Fast shutdown (SIGINT), SIGKILL after 10 s, then remove the data directory."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGCONT)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        super().stop()


@pytest.fixture(scope="session")
def rdzv_server_postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for the session (the ``{server:postgres}`` placeholder)."""
    try:
        server = PostgresServer()
    except (FileNotFoundError, RuntimeError) as exc:
        pytest.fail(f"could not start PostgreSQL: {exc}")
    try:
        server.start()
    except (FileNotFoundError, RuntimeError) as exc:
        server.stop()
        pytest.fail(f"could not start PostgreSQL: {exc}")
    try:
        yield server
    finally:
        server.stop()
