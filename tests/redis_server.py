"""A real Redis server of a test's own: ``redis-server`` on a free 127.0.0.1 port (or a Unix socket), nothing saved.

Use it through a fixture::

    from tests.redis_server import RedisServer, require_redis

    @pytest.fixture
    def redis_server(tmp_path):
        require_redis()  # skips the test, saying why, without redis-server or the redis client
        with RedisServer(tmp_path) as server:
            yield server  # server.url: "redis://127.0.0.1:PORT/0"

The server can be stopped and started again on the same port (``stop()``/``start()``) to test a store that goes away
and comes back, or frozen (``freeze()``/``thaw()``: SIGSTOP/SIGCONT) to test one that hangs; ``config`` passes
``redis-server`` options (``{"maxmemory": "4mb", "maxmemory-policy": "allkeys-lru"}``); ``client()`` is a raw
redis-py client for assertions (``PTTL``, ``DBSIZE``).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

__all__ = ["RedisServer", "free_port", "redis_server_path", "require_redis"]


def redis_server_path() -> str | None:
    """The ``redis-server`` executable on PATH, or None."""
    return shutil.which("redis-server")


def require_redis() -> None:
    """Skip the calling test, with the reason, unless ``redis-server`` is on PATH and the ``redis`` client installed."""
    if redis_server_path() is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server): the shared cache tests need one")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis client is not installed (pip install 'ragsieve[redis]')")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (no persistence, no daemon), as a context manager.

    Args:
        workdir: a folder for its working directory and log (default: a temporary folder removed at exit).
        port: the TCP port (default: a free one, kept across ``stop()``/``start()``).
        unixsocket: listen on this Unix socket instead of TCP (``url`` is then ``unix://...``).
        config: more ``redis-server`` options, name → value.
        start_timeout: how long ``start()`` waits for the server to answer PING, in seconds.
    """

    def __init__(
        self,
        workdir: str | Path | None = None,
        *,
        port: int | None = None,
        unixsocket: str | Path | None = None,
        config: Mapping[str, str] | None = None,
        start_timeout: float = 15.0,
    ) -> None:
        exe = redis_server_path()
        if exe is None:
            raise RuntimeError("redis-server is not on PATH")
        self.exe = exe
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="ragopt-redis-")) if workdir is None else Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._fixed_port = port is not None
        self.unixsocket = Path(unixsocket) if unixsocket is not None else None
        self.port = 0 if self.unixsocket is not None else (port if port is not None else free_port())
        self.config = dict(config or {})
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.workdir / "redis-server.log"

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        """The URL to give a :class:`~rag_opt.models.cache_redis.RedisTier` (database 0)."""
        if self.unixsocket is not None:
            return f"unix://{self.unixsocket}?db=0"
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _args(self) -> list[str]:
        args = [self.exe, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no"]
        args += ["--daemonize", "no", "--dir", str(self.workdir), "--logfile", ""]
        if self.unixsocket is not None:
            args += ["--unixsocket", str(self.unixsocket), "--unixsocketperm", "700"]
        for name, value in self.config.items():
            args += [f"--{name}", str(value)]
        return args

    def start(self) -> RedisServer:
        """Start the server (on its port again after a ``stop()``) and wait until it answers PING."""
        if self.running:
            return self
        for attempt in range(5):
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready():
                return self
            self._terminate()
            if self._fixed_port or self.unixsocket is not None or attempt == 4:
                break
            self.port = free_port()  # another process took the port between free_port() and the bind: try another
        tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
        raise RuntimeError(f"redis-server did not answer PING within {self.start_timeout}s; its log ends:\n{tail}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if self.ping():
                return True
            time.sleep(0.02)
        return False

    def ping(self) -> bool:
        """Whether the server answers PING now (a raw socket: no client needed)."""
        try:
            if self.unixsocket is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(1.0)
                sock.connect(str(self.unixsocket))
            else:
                sock = socket.create_connection((self.host, self.port), timeout=1.0)
            with sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL if it has not exited within 10 s); its data is gone."""
        self._terminate()

    def _terminate(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a frozen server must run to exit on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def freeze(self) -> None:
        """Suspend the server (SIGSTOP): connections are still accepted by the kernel but nothing answers, a store
        that hangs. ``thaw()`` resumes it."""
        assert self.proc is not None, "the server is not running"
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """Resume a server suspended by ``freeze()`` (SIGCONT)."""
        assert self.proc is not None, "the server is not running"
        self.proc.send_signal(signal.SIGCONT)

    def client(self, **kwargs: Any) -> Any:
        """A raw redis-py client of this server (for assertions)."""
        import redis

        return redis.Redis.from_url(self.url, **kwargs)

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server and remove its temporary folder (if it made one)."""
        self._terminate()
        if self._own_dir:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.workdir)
