"""A real PostgreSQL server for the tests: Debian's ``postgresql`` (installed by ``make postgres``, a prerequisite of
``make test``), started in a temporary folder on a free loopback port and stopped at the end of the session.

PostgreSQL refuses to run as root: as root, the server and ``initdb`` run as the ``postgres`` user the Debian package
creates (``runuser``), in a folder that user owns. Each test gets a database of its own (:func:`fresh_database`).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from ..conftest import free_port

USER = "chat_e"


def binaries() -> Path | None:
    """The folder of ``initdb`` and ``postgres``: Debian keeps them under /usr/lib/postgresql/<version>/bin."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("postgres")
    return Path(on_path).parent if on_path else None


def as_server_user(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


class PostgresServer:
    """``fsync``: the server syncs its commits to disk (as a production server does); off by default, for the tests."""

    def __init__(self, fsync: bool = False):
        bin_dir = binaries()
        if bin_dir is None:
            raise FileNotFoundError("PostgreSQL is not installed: run `make postgres` (Debian's postgresql package)")
        self.folder = Path(tempfile.mkdtemp(prefix="chat-e-postgres-"))
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        data = self.folder / "data"
        subprocess.run(as_server_user([str(bin_dir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust",
                                       "--no-sync", "-E", "UTF8"]),
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        self.port = free_port()
        self.log = (self.folder / "server.log").open("w")
        # fsync off: a test server in a temporary folder (a crash of the server itself is not what the tests check)
        self.process = subprocess.Popen(
            as_server_user([str(bin_dir / "postgres"), "-D", str(data), "-p", str(self.port), "-h", "127.0.0.1",
                            "-k", str(self.folder), *(() if fsync else ("-c", "fsync=off")),
                            "-c", "max_connections=200"]),
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._wait_ready()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}"

    def _wait_ready(self, seconds: float = 60) -> None:
        import psycopg

        deadline = time.monotonic() + seconds
        while True:
            try:
                psycopg.connect(f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres").close()
                return
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = (self.folder / "server.log").read_text()[-2000:]
                    raise RuntimeError(f"PostgreSQL did not start: {log}") from None
                time.sleep(0.1)

    def fresh_database(self, name: str) -> str:
        """A new empty database ``name``; its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)  # PostgreSQL's "fast" shutdown
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)
