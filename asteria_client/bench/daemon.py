"""A real ``asteria-server`` subprocess for a benchmark, and the CPU time it and its workers used.

Benchmarks that involve the daemon start their own on a private Unix socket, so they never touch
a daemon the user runs, and stop it with SIGTERM at the end. ``os.wait4`` then reports the CPU
seconds of the daemon *and* its reaped worker processes, which is what "CPU-seconds including the
engine's workers" means for a daemon run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from asteria_client.bench.affinity import inherited_by_children

#: How long a daemon may take to start serving (its workers import SciPy).
START_TIMEOUT_S = 60.0
#: How long SIGTERM may take to drain and stop it.
STOP_TIMEOUT_S = 30.0


class DaemonStartError(RuntimeError):
    """The benchmark's daemon exited or hung before serving."""


@dataclass
class BenchDaemon:
    """A daemon subprocess on a private socket; use as a context manager.

    Attributes:
        workers: solver processes (``--workers``).
        blas_threads: BLAS threads per worker (``--blas-threads``).
        extra_args: more ``asteria-server`` flags.
        listen: ``--listen`` (default: a Unix socket in a private temporary folder).
        env: extra environment of the daemon (e.g. ``ASTERIA_TOKENS`` for TCP).
        cpu_affinity: CPUs the daemon and its workers run on (None: this thread's).
        address: what to pass as ``address=`` / ``ASTERIA_ADDRESS`` (set by ``start``).
        cpu_s: user + system CPU seconds of the daemon and its workers (set by ``stop``).
    """

    workers: int = 1
    blas_threads: int = 1
    extra_args: Sequence[str] = ()
    listen: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cpu_affinity: Sequence[int] | None = None
    address: str = ""
    cpu_s: float | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _dir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    def start(self) -> BenchDaemon:
        self._dir = tempfile.TemporaryDirectory(prefix="asteria-bench-")
        root = Path(self._dir.name)
        sock, ready = root / "d" / "asteria.sock", root / "ready"
        listen = self.listen or f"unix://{sock}"
        cmd = [sys.executable, "-m", "asteria_server", "--listen", listen]
        cmd += ["--workers", str(self.workers), "--blas-threads", str(self.blas_threads)]
        cmd += ["--ready-file", str(ready), *self.extra_args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASTERIA_")}
        env.setdefault("ASTERIA_LOG_LEVEL", "WARNING")
        env.update(self.env)
        log = (root / "daemon.log").open("wb")
        with inherited_by_children(self.cpu_affinity):  # its workers inherit it in turn
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._proc.kill()
                self._proc.wait()
                text = (root / "daemon.log").read_text(errors="replace")
                raise DaemonStartError(f"the benchmark's daemon did not start:\n{text}")
            time.sleep(0.05)
        # The serving line names the address (with the port a TCP ``:0`` got).
        self.address = ready.read_text().split("serving on ", 1)[1].split()[0]
        return self

    def stop(self) -> float:
        """SIGTERM, wait, and return the CPU seconds of the daemon and its workers."""
        assert self._proc is not None, "not started"
        if self._proc.returncode is None:
            self._proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while True:
                pid, _, usage = os.wait4(self._proc.pid, os.WNOHANG)
                if pid:
                    self._proc.returncode = 0
                    self.cpu_s = usage.ru_utime + usage.ru_stime
                    break
                if time.monotonic() > deadline:
                    self._proc.kill()
                    _, _, usage = os.wait4(self._proc.pid, 0)
                    self._proc.returncode = -signal.SIGKILL
                    self.cpu_s = usage.ru_utime + usage.ru_stime
                    break
                time.sleep(0.05)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        return self.cpu_s if self.cpu_s is not None else float("nan")

    def __enter__(self) -> BenchDaemon:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
