"""A real ``asteria-server`` as a child process: started, waited for, measured and stopped.

Benchmarks and the test suite both run their own daemons, never one the user runs: on a private
Unix socket (or ``127.0.0.1:0`` TCP, the port picked by the system), with no ``ASTERIA_*``
variable of this process leaking into it. :class:`DaemonProcess` is that one launcher.

- **Ready** means serving: the daemon writes its serving line to ``--ready-file`` only once its
  gRPC server (and its health service) accept calls, so the launcher waits for that file, and
  reads the address from the line (with the port a TCP ``:0`` got).
- **CPU time**: ``os.wait4`` on the daemon reports the user + system seconds of the daemon *and*
  of the worker processes it reaped, which is what "CPU-seconds including the engine's workers"
  means for a daemon run. It is known only when the launcher itself reaps the daemon.
- **Output** goes to files, not pipes: a pipe nobody reads fills and blocks the daemon.
- **It never outlives its launcher**: the daemon runs with ``--stop-with-pid`` of this process
  and stops, as on SIGTERM, when this process exits without stopping it (killed, crashed).
- **CPU affinity**: Linux keeps a mask per thread and a child copies the mask of the thread that
  forked it, so the launching thread is confined to the CPUs just for the fork; the daemon's
  workers inherit the mask in turn.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from asteria_client.config import environ_without_asteria

#: How long a daemon may take to start serving (its workers import SciPy).
START_TIMEOUT_S = 60.0
#: How long SIGTERM may take to drain and stop it before it is killed.
STOP_TIMEOUT_S = 30.0
#: The socket's name in its directory.
SOCKET_NAME = "asteria.sock"


class DaemonStartError(RuntimeError):
    """The daemon exited or hung before serving; the message carries its output."""


@dataclass(frozen=True)
class DaemonExit:
    """How a stopped daemon ended.

    Attributes:
        returncode: its exit status (negative: the signal that ended it).
        cpu_s: user + system CPU seconds of the daemon and its reaped workers; None when the
            daemon was reaped elsewhere (e.g. by ``process.poll()``) before ``stop``.
        killed: True when it ignored SIGTERM for ``stop_timeout_s`` and was killed.
        stdout: what it printed (the serving line).
        stderr: its log.
    """

    returncode: int
    cpu_s: float | None
    killed: bool
    stdout: str
    stderr: str


@contextlib.contextmanager
def _confined(cpus: Sequence[int] | None) -> Iterator[None]:
    """The calling thread on ``cpus`` for the body, so that a child started there keeps them."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class DaemonProcess:
    """One ``asteria-server`` child process; a context manager (start, then stop).

    Args:
        workers: solver processes (``--workers``).
        blas_threads: BLAS threads per worker (``--blas-threads``; None: the daemon's default).
        extra_args: more ``asteria-server`` flags.
        listen: ``--listen``; None: ``unix://<socket_dir>/asteria.sock``. Give ``127.0.0.1:0``
            for TCP on a free port (a TCP daemon needs tokens: ``ASTERIA_TOKENS`` in ``env``).
        socket_dir: the directory of the Unix socket (the daemon creates it, mode 0700); None:
            one in a private temporary folder, removed by ``stop``.
        env: variables added to the daemon's environment, which otherwise is this process's
            without any ``ASTERIA_*`` (and ``ASTERIA_LOG_LEVEL=WARNING`` unless given).
        cpu_affinity: CPUs the daemon and its workers run on (None: those of this thread).
        start_timeout_s / stop_timeout_s: the waits of ``start`` and ``stop``.

    After ``start``: ``address`` (what a client passes as ``address=`` / ``ASTERIA_ADDRESS``),
    ``serving_line``, ``pid``, ``process``; after ``stop``: ``exit``.
    """

    def __init__(
        self,
        *,
        workers: int = 1,
        blas_threads: int | None = None,
        extra_args: Sequence[str] = (),
        listen: str | None = None,
        socket_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
        cpu_affinity: Sequence[int] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.blas_threads = blas_threads
        self.extra_args = tuple(extra_args)
        self.listen = listen
        self.socket_dir = socket_dir
        self.env = dict(env or {})
        self.cpu_affinity = cpu_affinity
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.address = ""
        self.serving_line = ""
        self.exit: DaemonExit | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._files: tempfile.TemporaryDirectory[str] | None = None

    # ------------------------------------------------------------------ what it is
    @property
    def process(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise RuntimeError("the daemon has not been started")
        return self._process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def socket_path(self) -> Path | None:
        """The Unix socket the daemon serves on (None for TCP)."""
        return Path(self.address[len("unix://") :]) if self.address.startswith("unix://") else None

    @property
    def cpu_s(self) -> float | None:
        """CPU seconds of the daemon and its workers, once stopped (see :class:`DaemonExit`)."""
        return None if self.exit is None else self.exit.cpu_s

    def command(self, listen: str, ready_file: Path) -> list[str]:
        cmd = [sys.executable, "-m", "asteria_server", "--listen", listen]
        cmd += ["--workers", str(self.workers), "--ready-file", str(ready_file)]
        # It stops when this process exits, however that happens: a test run or benchmark
        # killed with SIGKILL leaves no daemon behind.
        cmd += ["--stop-with-pid", str(os.getpid())]
        if self.blas_threads is not None:
            cmd += ["--blas-threads", str(self.blas_threads)]
        return cmd + list(self.extra_args)

    # ------------------------------------------------------------------ start and stop
    def start(self) -> DaemonProcess:
        """Start the daemon and wait until it serves; DaemonStartError with its output if it
        exits or does not serve within ``start_timeout_s``."""
        if self._process is not None:
            raise RuntimeError("the daemon was started already")
        self._files = tempfile.TemporaryDirectory(prefix="asteria-daemon-")
        files = Path(self._files.name)
        socket_dir = self.socket_dir if self.socket_dir is not None else files / "d"
        listen = self.listen or f"unix://{socket_dir / SOCKET_NAME}"
        ready = files / "ready"
        env = environ_without_asteria()
        env.setdefault("ASTERIA_LOG_LEVEL", "WARNING")
        env.update(self.env)
        with (
            (files / "stdout").open("wb") as out,
            (files / "stderr").open("wb") as err,
            _confined(self.cpu_affinity),
        ):
            self._process = subprocess.Popen(
                self.command(listen, ready), stdout=out, stderr=err, env=env
            )
        deadline = time.monotonic() + self.start_timeout_s
        while not ready.exists():
            if self._process.poll() is not None or time.monotonic() > deadline:
                why = (
                    f"exited with {self._process.returncode}"
                    if self._process.returncode is not None
                    else f"did not serve within {self.start_timeout_s:g} s"
                )
                self._process.kill()
                self._process.wait()
                stdout, stderr = self.output()
                self._cleanup()
                raise DaemonStartError(f"asteria-server {why}:\n{stdout}{stderr}")
            time.sleep(0.05)
        self.serving_line = ready.read_text().strip()
        # "asteria-server serving on ADDRESS incarnation=... pid=..."
        self.address = self.serving_line.split("serving on ", 1)[1].split()[0]
        return self

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> DaemonExit:
        """Send ``sig`` (unless it has exited), wait up to ``stop_timeout_s``, kill it if it
        is still there, and report how it ended. Calling it again returns the same exit."""
        if self.exit is not None:
            return self.exit
        proc = self.process
        cpu_s: float | None = None
        killed = False
        if proc.returncode is None:  # not reaped yet: wait4 gets its CPU time
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            deadline = time.monotonic() + self.stop_timeout_s
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() > deadline:
                    proc.kill()
                    killed = True
                    _, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.05)
            proc.returncode = os.waitstatus_to_exitcode(status)
            cpu_s = usage.ru_utime + usage.ru_stime
        stdout, stderr = self.output()
        self._cleanup()
        assert proc.returncode is not None
        self.exit = DaemonExit(proc.returncode, cpu_s, killed, stdout, stderr)
        return self.exit

    def output(self) -> tuple[str, str]:
        """What the daemon has written so far to its stdout and its stderr (its log)."""
        if self._files is None:
            return "", ""
        files = Path(self._files.name)
        stdout = (files / "stdout").read_text(errors="replace")
        return stdout, (files / "stderr").read_text(errors="replace")

    def _cleanup(self) -> None:
        if self._files is not None:
            self._files.cleanup()
            self._files = None

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
