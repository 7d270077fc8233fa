"""A client's session with its daemon: connect, keep the result stream open, reconnect.

:class:`DaemonSession` runs one thread. It opens a session (``OpenSession``), tells its
listener, holds the ``StreamResults`` stream and hands every result to the listener, and when
the session ends — the daemon died, restarted, or a call on the session failed (:meth:`lost`) —
reconnects with **one** backoff policy: exponential from ``backoff_initial_s`` to
``backoff_max_s``, reset after a session that worked for a while. (The gRPC channel's own
reconnect backoff is pinned to the initial value, so the two never stack.)

It also tracks the daemon's *incarnation*: a new one means the daemon restarted and holds
nothing of ours, which the listener answers by resubmitting.

Thread-safety: the session shares the source's condition variable, so waiters in the source
see a session come and go under the same lock that guards the blocks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from asteria_client.transport.connection import DaemonClientConfig, DaemonConnection, SessionInfo
from asteria_client.transport.peer import UntrustedDaemonError
from asteria_server.errors import AsteriaError, UnknownSessionError
from asteria_server.protocol.shm import ArraySpec
from asteria_server.types import Credit, SolveResult

logger = logging.getLogger(__name__)


class SessionListener(Protocol):
    """What the session tells the source that owns it."""

    def session_opened(self, session: SessionInfo, restarted: bool) -> None:
        """A new session is up (``restarted``: the daemon is a new incarnation). Called with
        the shared lock held: quick, no I/O."""

    def session_ready(self, session: SessionInfo) -> Callable[..., Any] | None:
        """Set up for a new session before it is published (no lock held); returns the result
        stream's segment reader."""

    def held_versions(self) -> dict[str, int]:
        """The newest result version held per block (wire names): the stream resumes there."""

    def result(self, result: SolveResult) -> None:
        """One result from the stream."""

    def result_arrays(self, block: str, specs: list[ArraySpec]) -> list[np.ndarray]:
        """Where the chunks of a result of ``block`` (its wire name) are assembled."""

    def credit_wanted(self) -> bool:
        """Whether the stream should ask the daemon for Credit messages."""

    def credit_received(self, credit: Credit) -> None:
        """The daemon's capacity, from the stream (only when :meth:`credit_wanted`)."""

    def session_lost(self, session: SessionInfo) -> None:
        """The session ended (called with the shared lock held: quick, no I/O)."""

    def session_closed(self) -> None:
        """After a lost session, without the lock: release what belonged to it."""


class DaemonSession:
    """One connection to a daemon and its session thread; see the module docstring."""

    def __init__(
        self,
        connection: DaemonConnection,
        config: DaemonClientConfig,
        lock: threading.Condition,
        listener: SessionListener,
    ) -> None:
        self.connection = connection
        self.config = config
        self.address = connection.address
        self._lock = lock
        self._listener = listener
        self._session: SessionInfo | None = None
        self._incarnation = ""
        self._peer_address = ""
        self.incarnations_seen = 0
        self._cancel_stream: Any = None
        self._closed = False
        self.last_connect_error = ""
        #: True while the last attempt to connect refused the daemon (its uid, transport.peer)
        self.refused = False
        self._thread = threading.Thread(
            target=self._run, name="asteria-daemon-session", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ state (lock held or not)
    @property
    def current(self) -> SessionInfo | None:
        """The open session, or None (read under the shared lock for a consistent view)."""
        return self._session

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def incarnation_id(self) -> str:
        return self._incarnation

    @property
    def peer_address(self) -> str:
        return self._peer_address

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until a session is open (True), or ``timeout_s`` passes or the daemon is
        refused for its uid (False)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._session is None and not self._closed and not self.refused:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return self._session is not None

    # ------------------------------------------------------------------ the loop
    def _backoffs(self) -> Iterator[float]:
        backoff = self.config.backoff_initial_s
        while True:
            yield backoff
            backoff = min(2 * backoff, self.config.backoff_max_s)

    def _sleep(self, seconds: float) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._closed, timeout=seconds)

    def _run(self) -> None:
        backoffs = self._backoffs()
        while not self._closed:
            try:
                session = self.connection.open_session()
            except AsteriaError as exc:
                self._note_connect_error(exc)
                self._sleep(next(backoffs))
                continue
            opened = time.monotonic()
            # The listener sets up first (its segments are handed over to the new session), then
            # the session is published: nothing is sent on a session half set up.
            reader = self._listener.session_ready(session)
            self._open(session)
            reason = self._stream(session, reader)
            self.lost(session, reason)
            self._listener.session_closed()
            if time.monotonic() - opened > self.config.backoff_max_s:
                backoffs = self._backoffs()  # it was a working session: retry at once
                continue
            self._sleep(next(backoffs))  # a session that fails at once must not spin

    def _open(self, session: SessionInfo) -> None:
        with self._lock:
            restarted = bool(self._incarnation) and self._incarnation != session.incarnation_id
            if restarted:
                logger.warning(
                    "the daemon at %s restarted (incarnation %s -> %s); resubmitting",
                    self.address,
                    self._incarnation,
                    session.incarnation_id,
                )
            if self._incarnation != session.incarnation_id:
                self.incarnations_seen += 1
            self._incarnation = session.incarnation_id
            self._peer_address = session.peer_address
            self._session = session
            self.last_connect_error = ""
            self.refused = False
            self._listener.session_opened(session, restarted)
            self._lock.notify_all()
        logger.info("session open with the daemon at %s (%s)", self.address, session.incarnation_id)

    def _stream(self, session: SessionInfo, reader: Callable[..., Any] | None) -> BaseException:
        """Hold the result stream until it ends; returns why it ended."""
        try:
            results = self.connection.results(
                session,
                self._listener.held_versions(),
                self._set_cancel,
                reader=reader,
                allocate=self._listener.result_arrays,
                on_credit=self._listener.credit_received
                if self._listener.credit_wanted()
                else None,
            )
            for result in results:
                self._listener.result(result)
                if self._closed:
                    break
            return UnknownSessionError("the result stream ended")
        except AsteriaError as exc:
            return exc
        except Exception as exc:  # a bug here must cost results, never the training run
            logger.exception("receiving results from the daemon failed")
            return exc

    def _note_connect_error(self, exc: AsteriaError) -> None:
        message = str(exc)
        if isinstance(exc, UntrustedDaemonError):
            # transport.peer logged it once for the process, with the fix. Waiting for a
            # first session is over: the uid behind the socket does not change by waiting.
            with self._lock:
                self.refused = True
                self.last_connect_error = message
                self._lock.notify_all()
        elif message != self.last_connect_error:
            self.last_connect_error = message
            logger.warning("cannot open a session with the daemon at %s: %s", self.address, exc)

    def _set_cancel(self, cancel: Any) -> None:
        with self._lock:
            self._cancel_stream = cancel
            closed = self._closed
        if closed:
            cancel()

    def lost(self, session: SessionInfo, exc: BaseException) -> None:
        """``session`` failed (any thread): drop it, once, so the session thread reconnects."""
        with self._lock:
            if self._session is not session:
                return
            self._session = None
            self._listener.session_lost(session)
            cancel = self._cancel_stream
            closed = self._closed
            self._lock.notify_all()
        if not closed:
            logger.warning(
                "lost the daemon at %s (%s); reconnecting in the background", self.address, exc
            )
        if cancel is not None:
            cancel()

    def close(self) -> None:
        """End the session (CloseSession when one is open) and the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            session, cancel = self._session, self._cancel_stream
            self._lock.notify_all()
        if cancel is not None:
            cancel()
        if session is not None:
            with contextlib.suppress(AsteriaError):  # a daemon gone or restarted: nothing to close
                self.connection.close_session(session.session_id)
        self._thread.join(timeout=self.config.call_timeout_s)
