"""Real processes for end-to-end tests: services and SDK workers, each its own OS process.

Nothing here sleeps for time: every wait polls a condition (a port, a file, a row count)
until a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from conveyor_runtime.cluster_key import generate_key
from conveyor_runtime.embedded_nats import free_port
from conveyor_testkit.polling import wait_until, wait_until_blocking
from conveyor_testkit.webhooks import LOCAL_ENDPOINTS, WEBHOOK_KEY

ROOT = Path(__file__).resolve().parents[2]

#: How often an end-to-end test checks a condition: each check reads a log or asks the
#: api or the database, and the processes under test share the machine with the test.
POLL_INTERVAL = 0.05


def port_open(port: int) -> bool:
    """True when something accepts connections on 127.0.0.1:port."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


@contextlib.contextmanager
def dev_server(log: Path) -> Iterator[str]:
    """``conveyor dev`` on a free port in its own process group, output in ``log``; yields
    its address once it accepts connections, and stops it (SIGTERM) afterwards."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor_cli", "dev", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until_blocking(
            lambda: port_open(port) or proc.poll() is not None,
            within=60,
            interval=POLL_INTERVAL,
            message="dev",
        )
        assert proc.poll() is None, log.read_text()
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@dataclass
class Proc:
    """One child process with its output in a log file."""

    name: str
    args: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    port: int | None = None

    def start(self) -> Proc:
        """Start the process (new session, so a kill reaches only it)."""
        env = {**os.environ, **self.env}
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            [sys.executable, *self.args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        """The process id (it must have been started)."""
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen is not None and self.popen.poll() is None

    def kill9(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            assert self.popen is not None
            self.popen.wait()

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then wait for a graceful exit (SIGKILL past ``timeout``)."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def log(self) -> str:
        """Everything the process printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Cluster:
    """The services of one end-to-end test: api(s), dispatcher(s), maintenance.

    They share ``cluster_key`` (the test run's, else a new one): a test's own bus seals
    with it to speak as a service, or with another key to play an intruder."""

    dsn: str
    nats_url: str
    workdir: Path
    settings_env: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    cluster_key: str = field(
        default_factory=lambda: os.environ.get("CONVEYOR_CLUSTER_KEY") or generate_key()
    )

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {
            "CONVEYOR_DSN": self.dsn,
            "CONVEYOR_NATS_URL": self.nats_url,
            "CONVEYOR_ALLOW_UNAUTHENTICATED": "true",
            "CONVEYOR_CLUSTER_KEY": self.cluster_key,
            "CONVEYOR_LOG_LEVEL": "info",
            "PYTHONUNBUFFERED": "1",
            # The tests' webhook endpoints listen on 127.0.0.1, which the services refuse
            # unless allowed: allow exactly that, and share one key for the secrets.
            "CONVEYOR_WEBHOOK_ALLOW_NETWORKS": LOCAL_ENDPOINTS,
            "CONVEYOR_WEBHOOK_SECRET_KEY": WEBHOOK_KEY,
            **self.settings_env,
        }
        env.update(extra or {})
        return env

    def spawn(self, name: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> Proc:
        """Start ``python <args>`` with the cluster's environment."""
        index = sum(1 for p in self.procs if p.name.startswith(name))
        proc = Proc(f"{name}{index}", args, self._env(env), self.workdir / f"{name}{index}.log")
        self.procs.append(proc.start())
        return proc

    async def start_api(
        self, env: Mapping[str, str] | None = None, *, port: int | None = None
    ) -> Proc:
        """An api process on ``port`` (default: a free one); returns once it accepts
        connections."""
        port = port or free_port()
        # On loopback only: plaintext needs no CONVEYOR_ALLOW_PLAINTEXT there.
        proc = self.spawn(
            "api",
            ["-m", "conveyor_api"],
            {"CONVEYOR_HOST": "127.0.0.1", "CONVEYOR_PORT": str(port), **(env or {})},
        )
        proc.port = port
        await wait_until(
            lambda: port_open(port) or not proc.alive(),
            within=30,
            interval=POLL_INTERVAL,
            message="api port",
        )
        if not proc.alive():
            raise RuntimeError(f"api exited:\n{proc.log()}")
        return proc

    async def start_services(self) -> str:
        """One api, one dispatcher and one maintenance process; the api's address."""
        api = await self.start_api()
        self.start_dispatcher()
        self.start_maintenance()
        return f"127.0.0.1:{api.port}"

    def start_dispatcher(self, env: Mapping[str, str] | None = None) -> Proc:
        """A dispatcher process."""
        return self.spawn("dispatcher", ["-m", "conveyor_dispatcher"], env)

    def start_maintenance(self, env: Mapping[str, str] | None = None) -> Proc:
        """A maintenance process."""
        return self.spawn("maintenance", ["-m", "conveyor_maintenance"], env)

    def start_webhook(self, env: Mapping[str, str] | None = None) -> Proc:
        """A webhook service process (``python -m conveyor_webhook``): a leader-elected
        webhook manager running one gateway per active webhook worker registration.

        It listens on no port: wait on what it does (its log, the leaders bucket, a
        delivery). Pass ``CONVEYOR_CALLBACK_ADDRESS`` in ``env`` for asynchronous
        deliveries."""
        return self.spawn("webhook", ["-m", "conveyor_webhook"], env)

    def start_worker(
        self,
        target: str,
        *,
        queues: Mapping[str, int],
        concurrency: int,
        record: Path,
        mode: str = "noop",
        grace: float = 30.0,
        tls: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Proc:
        """An SDK worker process (tests/e2e/worker_app.py) that records each run to ``record``;
        ``tls`` holds its ``--tls-ca``, ``--tls-cert`` and ``--tls-key`` by flag name
        (``{"ca": path}``...); ``env``: e.g. ``CONVEYOR_TOKEN``, the bearer secret it
        presents."""
        args = [
            str(ROOT / "tests" / "e2e" / "worker_app.py"),
            "--target",
            target,
            "--concurrency",
            str(concurrency),
            "--record",
            str(record),
            "--mode",
            mode,
            "--grace",
            str(grace),
        ]
        for queue, weight in queues.items():
            args += ["--queue", f"{queue}={weight}"]
        for name, path in (tls or {}).items():
            args += [f"--tls-{name}", path]
        return self.spawn("worker", args, env)

    def stop_all(self) -> None:
        """Terminate every process still running."""
        for proc in reversed(self.procs):
            if proc.alive():
                proc.terminate(timeout=10)

    def logs(self) -> str:
        """Every process's log, for a failing test's report."""
        return "\n".join(f"===== {p.name} =====\n{p.log()[-4000:]}" for p in self.procs)


async def conveyor_cli(
    *args: str, env: Mapping[str, str] | None = None
) -> tuple[int | None, str, str]:
    """Run ``python -m conveyor_cli *args`` from the repository root: its exit code, stdout
    and stderr. ``env`` adds variables (``COLUMNS`` for rich's tables, say)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "conveyor_cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()
