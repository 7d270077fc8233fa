"""The peer groups of a daemon: one per (tenant, job) registered with more than one daemon.

Everything runs on the daemon's event loop (heartbeats, pushes, the snapshot gate the servicer
calls) except the engine's result listener, which hands its news to the loop.

**Membership.** A job's layout (RegisterJob) lists its nodes and the daemon of each; nodes
served by the same daemon are one *member*. Every member calls Heartbeat on every other one
every ``heartbeat_s``; the answer carries the callee's state, so each call tells both sides.
A member not heard for ``suspect_s`` is *suspect* (snapshots waiting for its push are claimed
from it at once), for ``dead_s`` *dead* (its blocks move to the living by the owner rule), and
``takeover_grace_s`` later *gone*. Until it is gone, a quiet owner's versions (those it had and
those that arrive meanwhile: its ranks send it the same ones) are held for its push, not solved
elsewhere: stopped, it may be solving them, and it solves them when it runs again. One never
heard counts as pending for ``dead_s`` after the job was registered here, then as dead.
A new incarnation (a restarted daemon) or a dead one heard again *rejoins*: the owner rule moves
exactly its blocks back, and everything it needs is pushed to it again (versions never go back:
a peer keeps a pushed result only when newer than its own).

**Agreement.** The owner map depends on the job's blocks and on which members use each one, so
owners are decided only while every live member holds the same block lists of all of them (a
digest of its own list in every heartbeat, the list itself when it changed, and a digest of
all the lists it holds), and that for ``settle_s``. Before, a snapshot waits (at most
``patience_s``). A replicated block is used by every member; a block of a parameter shard (a
name with the shard mark ``@``) only by the members whose ranks hold that shard (HSDP: its
replicas on several nodes; plain FSDP: one member, which then owns it), and it is owned by one
of them (:func:`asteria_server.owners.owner_map` with ``users``).

**The gate.** A snapshot of a block in the job's namespace is solved here only when this
member owns it. Otherwise it waits for the owner's
push. When the push has not come by the snapshot's deadline, ``max(patience_s, (deadline -
version) * step_s)`` after it arrived (``step_s`` being the job's seconds per step as seen from
its snapshots), or at once when the owner is suspect or its ranks are behind, it is *claimed*
(Peer.Claim): the owner grants a version it has not started (taken out of its queue, or not
arrived there yet, in which case it will not solve it when it comes: it waits for this
member's push instead), and refuses one it runs or has solved, by its engine's computed
version (its push is on its way; asked again after ``patience_s``). A granted version is
solved here and pushed to every peer, the owner included, so each (block, version) is still
solved once in the cluster. It is solved here without a grant (a *fallback*, which may
duplicate the owner's work) only when the owner is gone, cannot take claims, or the members
do not agree on the blocks in time. A push that brings the version (or a newer one) ends the
wait, and takes an older-or-equal snapshot of the block out of this member's queue (latest
wins).

**Pushes.** When a block this member owns gets a result, it is queued for every live member
whose ranks use the block; a sender per peer sends the queue (the most urgent deadline first,
only each block's newest result, never one the peer already got) as one PushResults stream, in
``chunk_bytes`` chunks. A peer that does not read (SIGSTOPped) holds up only its own sender,
for at most ``push_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager

import grpc

from asteria_server.engine import PreconditionerEngine
from asteria_server.errors import AuthenticationError, DaemonBusyError, InvalidInputError
from asteria_server.protocol import convert, framing
from asteria_server.protocol.generated.asteria.v1 import jobs_pb2 as jpb
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb
from asteria_server.service.budget import UploadBudget
from asteria_server.service.limits import AuthThrottle, RefusalLog
from asteria_server.sync.config import SyncConfig
from asteria_server.sync.decide import Held
from asteria_server.sync.group import JobSync
from asteria_server.sync.links import PeerDialer
from asteria_server.sync.membership import Peer, synced
from asteria_server.sync.policy import UNPROVEN_HEARTBEAT_MAX_S, PeerPolicy, RateLimit
from asteria_server.sync.push import PushStream, PushTimeouts, check_header
from asteria_server.types import SolveResult, SolveTask, SubmitOutcome

logger = logging.getLogger(__name__)

#: Seconds between heartbeats to a peer declared dead.
DEAD_PEER_HEARTBEAT_S = 1.0
#: PushResults streams one tenant may have open on a daemon at once (tenant_max_push_streams).
MAX_PUSH_STREAMS = 16


def job_token(token: str, job: str, run_nonce: str = "") -> str:
    """The job token: hex HMAC-SHA256 under the tenant's token of the job id and the run nonce
    its layout was registered with (``job + "\\n" + run_nonce``), or of the job id alone for a
    layout without a nonce (a client older than ``JobLayout.run_nonce``). A new run of the job
    draws a new nonce, so a token of an earlier run stops working once the job registers again
    or leaves the registry."""
    message = job if not run_nonce else f"{job}\n{run_nonce}"
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


class SyncManager:
    """Every peer group of this daemon; the gate the servicer submits through."""

    def __init__(
        self,
        engine: PreconditionerEngine,
        tokens: Mapping[str, str],
        *,
        chunk_bytes: int,
        max_message_bytes: int,
        max_matrix_n: int,
        config: SyncConfig | None = None,
        tls_root: bytes | None = None,
        peer_credentials: grpc.ChannelCredentials | None = None,
        peer_server_name: str | None = None,
        uploads: UploadBudget | None = None,
        push_timeouts: PushTimeouts | None = None,
        policy: PeerPolicy | None = None,
        max_push_streams: int = MAX_PUSH_STREAMS,
    ) -> None:
        self.engine = engine
        self.policy = policy or PeerPolicy()
        self.config = config or SyncConfig.from_env()
        self._tokens = dict(tokens)
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.max_matrix_n = max_matrix_n
        self._dialer = PeerDialer(
            config=self.config,
            max_message_bytes=max_message_bytes,
            tls_root=tls_root,
            credentials=peer_credentials,
            server_name=peer_server_name,
        )
        self.jobs: dict[tuple[str, str], JobSync] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._tick_wake: asyncio.Event | None = None
        self._claims: set[asyncio.Task[None]] = set()
        self._closed = False
        #: How many sessions of (tenant, job) are open here; None: never ends a group (set by
        #: the daemon to its session table's count).
        self.job_sessions: Callable[[str, str], int] | None = None
        self._idle_since: dict[tuple[str, str], float] = {}
        self.groups_removed = 0
        #: the daemon's upload budget, which pushes share with clients' uploads (None: none)
        self.uploads: UploadBudget | None = uploads
        self.push_timeouts = push_timeouts or PushTimeouts()
        #: PushResults streams one tenant may have open here at once, and those open now
        self.max_push_streams = max_push_streams
        self._pushes: dict[str, int] = {}
        #: failed authentications (the daemon sets the one its OpenSession uses)
        self.auth_throttle = AuthThrottle()
        #: told the claimed tenant of every failed authentication (the daemon's counter)
        self.on_auth_failed: Callable[[str], None] | None = None
        self._refusals = RefusalLog(logger)
        #: every peer group's heartbeats to unproven peers, together (see sync.policy)
        self.unproven_heartbeats = RateLimit(
            self.config.unproven_heartbeats_per_s,
            burst=max(1, int(self.config.unproven_heartbeats_per_s)),
        )
        self.heartbeats_delayed = 0
        engine.add_result_listener(self._on_result)

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Start the ticker on the running loop (the daemon's)."""
        self._loop = asyncio.get_running_loop()
        self._tick_wake = asyncio.Event()
        self._ticker = self._loop.create_task(self._tick_loop())

    def set_tokens(self, tokens: Mapping[str, str]) -> None:
        """New tenant tokens (SIGHUP): job tokens and peers' credentials are checked with them
        from now on."""
        self._tokens = dict(tokens)

    async def stop(self) -> None:
        self._closed = True
        self.engine.remove_result_listener(self._on_result)
        tasks = [t for js in self.jobs.values() for t in js._tasks] + list(self._claims)
        if self._ticker is not None:
            tasks.append(self._ticker)
        await _cancel(tasks)
        for js in self.jobs.values():
            await _close_channels(js)

    def wake_ticker(self) -> None:
        if self._tick_wake is not None:
            self._tick_wake.set()

    async def _tick_loop(self) -> None:
        assert self._tick_wake is not None
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._tick_wake.wait(), self.config.heartbeat_s / 2)
            self._tick_wake.clear()
            now = time.monotonic()
            for js in list(self.jobs.values()):
                try:
                    js.tick(now)
                except Exception:
                    logger.exception("job %r: the sync tick failed", js.job)
            await self._end_idle_groups(now)

    async def _end_idle_groups(self, now: float) -> None:
        """End the peer group of every job with no session here for ``group_idle_s``: its
        heartbeat and push tasks stop and its state goes (the peers see it gone and fail its
        blocks over, as for a dead daemon, if their ranks still train)."""
        if self.job_sessions is None:
            return
        for key, js in list(self.jobs.items()):
            if self.job_sessions(*key) > 0:
                self._idle_since.pop(key, None)
                continue
            since = self._idle_since.setdefault(key, now)
            if now - since < self.config.group_idle_s or self.jobs.get(key) is not js:
                continue
            del self.jobs[key]
            self._idle_since.pop(key, None)
            self.groups_removed += 1
            logger.info(
                "job %r: peer group ended, no session of the job here for %g s",
                js.job,
                self.config.group_idle_s,
                extra={"tenant": key[0], "job": js.job},
            )
            await _cancel(js._tasks)
            await _close_channels(js)

    def forget_job(self, tenant: str, job: str) -> None:
        """End the job's peer group now (its blocks were forgotten here); on the event loop."""
        js = self.jobs.pop((tenant, job), None)
        self._idle_since.pop((tenant, job), None)
        if js is None or self._loop is None:
            return
        self.groups_removed += 1
        task = self._loop.create_task(self._end_group(js))
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    async def _end_group(self, js: JobSync) -> None:
        await _cancel(js._tasks)
        await _close_channels(js)

    # ------------------------------------------------------------------ jobs

    def check_job(self, tenant: str, layout: jpb.JobLayout, node_rank: int) -> None:
        """Refuse a layout whose peer group the operator's rules do not allow (before the job
        registry keeps it): too many daemons, for the job or the tenant, or an address outside
        ``peer_allow`` (see :mod:`asteria_server.sync.policy`)."""
        addresses = list(dict.fromkeys(n.daemon_address for n in layout.nodes))
        if len(addresses) < 2:
            return
        others = sum(
            len(js.peers) for (t, job), js in self.jobs.items() if t == tenant and job != layout.job
        )
        me = layout.nodes[node_rank].daemon_address
        self.policy.check(layout.job, me, addresses, others)

    def job_registered(self, tenant: str, layout: jpb.JobLayout, node_rank: int) -> None:
        """A node leader registered ``layout`` here (RegisterJob; on the event loop)."""
        if self._closed:
            return
        key = (tenant, layout.job)
        old = self.jobs.get(key)
        addresses = [n.daemon_address for n in layout.nodes]
        if old is not None:
            same = (
                [old.view.addresses[m] for m in old.view.member_of_node] == addresses
                and old.node_of(old.me) == node_rank
                and old.run_nonce == layout.run_nonce  # a new run: a new token, a new group
            )
            if same:
                return
            for task in old._tasks:
                task.cancel()
        js = JobSync(self, tenant, layout, node_rank)
        if old is not None:  # what its ranks use and what it holds stay known
            js.view.known, js.view.digest, js.stats = old.view.known, old.view.digest, old.stats
            js.kinds = old.kinds
        self.jobs[key] = js
        if js.syncing:
            unreachable = [a for a in js.view.addresses if a.startswith("unix:")]
            if unreachable:
                logger.warning(
                    "job %r spans %d daemons but some listen on Unix sockets (%s), which other "
                    "nodes cannot reach: start one daemon per node on TCP (--listen HOST:PORT "
                    "with tenant tokens) for the daemons to sync",
                    layout.job,
                    len(js.view.addresses),
                    ", ".join(unreachable),
                )
            logger.info(
                "job %r: peer group of %d daemons, this one is member %d",
                layout.job,
                len(js.view.addresses),
                js.me,
                extra={"tenant": tenant, "job": layout.job},
            )
            loop = self._loop or asyncio.get_running_loop()
            for peer in js.peers.values():
                js._tasks.append(loop.create_task(self._heartbeats(js, peer)))
                js._tasks.append(loop.create_task(self._sender(js, peer)))

    def _job_of(self, tenant: str, block: str) -> JobSync | None:
        for (t, _), js in self.jobs.items():
            if t == tenant and synced(block, js.prefix):
                return js
        return None

    # ------------------------------------------------------------------ the gate

    def submit(self, task: SolveTask, job: str = "") -> SubmitOutcome:
        """The servicer's submit: the engine's, unless another daemon owns the block."""
        js = self._job_of(task.tenant, task.block) if self.jobs else None
        if js is None:
            return self.engine.submit(task, job=job)
        return js.submit(task, job)

    def _on_result(self, tenant: str, block: str, version: int | None) -> None:
        """The engine's news (dispatcher thread, or an install on the loop)."""
        loop = self._loop
        if loop is None or self._closed or not self.jobs:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._result_ready, tenant, block, version)

    def _result_ready(self, tenant: str, block: str, version: int | None) -> None:
        js = self._job_of(tenant, block)
        if js is not None and version is not None:  # a peer's result: see JobSync.received
            js.local_result(block, version)

    # ------------------------------------------------------------------ calls out

    def credentials(self, js: JobSync) -> ppb.PeerCredentials:
        return ppb.PeerCredentials(
            tenant=js.tenant,
            job=js.job,
            job_token=job_token(self._tokens.get(js.tenant, ""), js.job, js.run_nonce),
            node=js.node_of(js.me),
            incarnation_id=self.engine.incarnation_id,
        )

    async def _heartbeats(self, js: JobSync, peer: Peer) -> None:
        if peer.address.startswith("unix:"):
            return  # unreachable from another node: it stays unknown, then dead
        while not self._closed:
            if not peer.proven:  # the daemon-wide cap on heartbeats to strangers
                wait = self.unproven_heartbeats.reserve(time.monotonic())
                if wait > 0:
                    self.heartbeats_delayed += 1
                    await asyncio.sleep(wait)
            started = time.monotonic()
            try:
                reply = await self._dialer.stub(js.links[peer.member]).Heartbeat(
                    ppb.HeartbeatRequest(
                        credentials=self.credentials(js),
                        state=js.my_state(peer.acked),
                        known_digest=peer.digest,
                    ),
                    timeout=self.config.call_timeout_s,
                )
                peer.acked = reply.known_digest
                js.heard(peer, reply.state)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                ):
                    # Not (or no longer) a daemon of this run of the job: asked at most once
                    # a second again, and pushed nothing, until it proves itself (so a peer
                    # that restarted and has not registered the job yet does not use up its
                    # authentication throttle on our calls).
                    peer.proven = False
                    self._refusals.refused(
                        "heartbeat of ours by a peer",
                        f"job {js.job!r}, {peer.address}: {exc.details()}",
                    )
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("job %r: heartbeat to %s failed", js.job, peer.address)
            js.refresh_states(time.monotonic())
            # A dead peer (or a job that ended there) is asked less often, never given up: it
            # may come back (a restart, SIGCONT) and must be heard within a few seconds. One
            # never heard (an address a layout names, perhaps no daemon at all) is asked at
            # most once a second, backing off: it proves itself by calling here meanwhile.
            if not peer.proven:
                peer.misses += 1
                every = min(
                    UNPROVEN_HEARTBEAT_MAX_S,
                    max(self.config.heartbeat_s, DEAD_PEER_HEARTBEAT_S) * 2 ** (peer.misses - 1),
                )
            elif peer.state != "dead":
                every = self.config.heartbeat_s
            else:
                every = DEAD_PEER_HEARTBEAT_S
            left = every - (time.monotonic() - started)
            await asyncio.sleep(max(0.01, left))

    async def _sender(self, js: JobSync, peer: Peer) -> None:
        link = js.links[peer.member]
        while not self._closed:
            await link.wake.wait()
            link.wake.clear()
            if peer.state != "alive" or not peer.proven or not link.queued:
                if link.queued:  # try again once it is heard (and took our token)
                    await asyncio.sleep(self.config.heartbeat_s)
                    link.wake.set()
                continue
            results = js.next_push(peer)
            if not results:
                continue
            sent: list[tuple[str, int, int]] = []
            try:
                await self._dialer.stub(link).PushResults(
                    self._frames(js, results, sent), timeout=self.config.push_timeout_s
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # it missed them: queued again, pushed once it answers
                logger.info("job %r: push to %s failed: %s", js.job, peer.address, exc)
                for result in results:
                    link.queue(result.block)
                link.wake.clear()
                await asyncio.sleep(self.config.heartbeat_s)
                link.wake.set()
                continue
            for block, version, size in sent:
                link.got(block, version)
                link.bytes_sent += size
                link.results_sent += 1

    def start_claim(self, js: JobSync, held: Held, owner: int) -> None:
        """Ask ``owner`` for ``held``'s version (a task on the loop; the answer goes to
        :meth:`JobSync.claim_answered`)."""
        if self._loop is None or self._closed:
            return
        held.claiming = True
        js.claims_sent += 1
        task = self._loop.create_task(self._claim(js, js.peers[owner], held))
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    async def _claim(self, js: JobSync, peer: Peer, held: Held) -> None:
        config = self.config
        # A suspect owner gets a short deadline: a stopped one must not hold up its ranks.
        timeout = config.call_timeout_s
        if peer.state != "alive":
            timeout = min(timeout, config.suspect_s / 2)
        try:
            reply = await self._dialer.stub(js.links[peer.member]).Claim(
                ppb.ClaimRequest(
                    credentials=self.credentials(js),
                    block=held.task.block,
                    version=held.task.version,
                ),
                timeout=timeout,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            js.claim_failed(held, peer.member, exc)
        else:
            js.claim_answered(held, peer.member, reply)
        self.wake_ticker()

    async def _frames(
        self, js: JobSync, results: list[SolveResult], sent: list[tuple[str, int, int]]
    ) -> AsyncIterator[ppb.PushResultsRequest]:
        """A push's messages: the hello, then each result's frames; ``sent`` gets (block,
        version, bytes) of each result once all its frames went."""
        yield ppb.PushResultsRequest(hello=ppb.PushHello(credentials=self.credentials(js)))
        for result in results:
            size = 0
            for message in framing.result_messages(result, chunk_bytes=self.chunk_bytes):
                data = message.SerializeToString()
                size += len(data)
                yield ppb.PushResultsRequest(frame=data)
            sent.append((result.block, result.version, size))

    # ------------------------------------------------------------------ calls in

    def authenticate(self, creds: ppb.PeerCredentials, caller: str = "") -> tuple[JobSync, Peer]:
        """The caller's job and peer record; AuthenticationError otherwise.

        The token is checked against the job as registered here (its run nonce), so the job is
        looked up first. ``caller`` is the peer host the call came from: its failures count in
        the daemon's authentication throttle (per host and claimed tenant, shared with
        OpenSession), which refuses it with DaemonBusyError once used up; each class of refusal
        is logged, at most one line per class every few seconds. An unknown tenant, a job not
        registered here (not yet, or no longer) and a wrong token (one of an earlier run of the
        job included) get one message: a caller learns neither which tenants nor which jobs
        exist. (A daemon of the job that calls before its peer's ranks registered it is asked
        again, at most once a second while unproven: within the throttle's refill.)"""
        key = f"{caller or 'unknown peer'} for tenant {creds.tenant[:64]!r}"
        self.auth_throttle.check(key)
        token = self._tokens.get(creds.tenant)
        js = self.jobs.get((creds.tenant, creds.job))
        expected = job_token(token or "", creds.job, js.run_nonce if js is not None else "")
        wrong = not hmac.compare_digest(expected.encode(), creds.job_token.encode())
        if (token is None and self._tokens) or js is None or wrong:
            self.auth_throttle.failed(key)
            if self.on_auth_failed is not None:
                self.on_auth_failed(creds.tenant)
            self._refusals.refused("peer call with a wrong job token", f"from {key}")
            raise AuthenticationError(
                f"unknown tenant, job not registered here or wrong job token for job "
                f"{creds.job[:64]!r}; the daemons of a job must share the tenant's token, and "
                "a token is good for the run of the job registered here only"
            )
        if not 0 <= creds.node < len(js.view.member_of_node):
            raise InvalidInputError(f"node {creds.node} is not one of the job's nodes")
        member = js.view.member_of_node[creds.node]
        peer = js.peers.get(member)
        if peer is None:
            raise InvalidInputError(f"node {creds.node} is served by this daemon itself")
        return js, peer

    def claim(self, request: ppb.ClaimRequest, caller: str = "") -> ppb.ClaimResponse:
        js, peer = self.authenticate(request.credentials, caller)
        return js.claim(peer, request.block, request.version)

    def heartbeat(self, request: ppb.HeartbeatRequest, caller: str = "") -> ppb.HeartbeatResponse:
        js, peer = self.authenticate(request.credentials, caller)
        js.heard(peer, request.state)
        return ppb.HeartbeatResponse(
            state=js.my_state(request.known_digest), known_digest=peer.digest
        )

    async def receive(
        self, requests: AsyncIterator[ppb.PushResultsRequest], caller: str = ""
    ) -> ppb.PushResultsResponse:
        """A peer's push (see :mod:`asteria_server.sync.push`): authenticated, then each result
        checked by its header before its arrays are allocated, held in the upload budget while
        it arrives, and validated as a local result once complete."""
        stream = PushStream(requests, self.push_timeouts)
        first = await stream.next_request()
        if first is None or first.WhichOneof("part") != "hello":
            raise InvalidInputError("PushResults: the first message must be a hello")
        js, peer = self.authenticate(first.hello.credentials, caller)
        pushing = self._pushes.get(js.tenant, 0)
        if pushing >= self.max_push_streams:
            raise DaemonBusyError(
                f"PushResults: tenant {js.tenant!r} has {pushing} pushes open on this daemon "
                f"(tenant_max_push_streams = {self.max_push_streams}); push again once they end"
            )
        self._pushes[js.tenant] = pushing + 1
        try:
            return await self._receive(stream, js, peer)
        finally:
            left = self._pushes[js.tenant] - 1
            if left:
                self._pushes[js.tenant] = left
            else:
                del self._pushes[js.tenant]

    async def _receive(
        self, stream: PushStream, js: JobSync, peer: Peer
    ) -> ppb.PushResultsResponse:
        receiver = framing.ResultReceiver(
            max_chunk_bytes=self.chunk_bytes, max_matrix_n=self.max_matrix_n
        )
        kept = dropped = 0
        while (frame := await stream.next_frame()) is not None:
            frames_before = stream.frame_bytes - stream.last_frame_bytes
            if frame.WhichOneof("part") != "header":
                raise InvalidInputError("PushResults: a chunk arrived before any result header")
            header = frame.header
            announced = convert.result_arrays_announced(header, max_matrix_n=self.max_matrix_n)
            num_bytes = sum(array.num_bytes for array in announced)
            what = f"PushResults: result of block {header.block[:128]!r} version {header.version}"
            if not check_header(
                header, tenant=js.tenant, prefix=js.prefix, job=js.job, use=js.use(header.block)
            ):  # its ranks do not use it (yet): nothing to serve
                await stream.skip(num_bytes, what)
                dropped += 1
                continue
            async with self._upload_hold(num_bytes, what, js.tenant):
                result = receiver.feed(frame)
                while result is None:
                    chunk = await stream.next_frame()
                    if chunk is None:
                        raise InvalidInputError(f"{what}: the stream ended inside the result")
                    result = receiver.feed(chunk)
            if not result.is_finite():
                raise InvalidInputError(f"{what}: it holds non-finite values")
            if js.received(peer, result, stream.frame_bytes - frames_before):
                kept += 1
            else:
                dropped += 1
        receiver.close()
        return ppb.PushResultsResponse(kept=kept, dropped=dropped)

    def _upload_hold(
        self, num_bytes: int, what: str, tenant: str
    ) -> AbstractAsyncContextManager[None]:
        if self.uploads is None:
            return contextlib.nullcontext()
        return self.uploads.hold(
            num_bytes, wait_s=self.push_timeouts.wait_s, what=what, tenant=tenant
        )

    def status(self, tenant: str) -> ppb.PeerStatusResponse:
        now = time.monotonic()
        return ppb.PeerStatusResponse(
            groups=[js.status(now) for (t, _), js in sorted(self.jobs.items()) if t == tenant]
        )

    def groups(self) -> list[tuple[str, ppb.PeerGroup]]:
        """Every tenant's peer groups (the metrics endpoint's view); call on the event loop."""
        now = time.monotonic()
        return [(tenant, js.status(now)) for (tenant, _), js in sorted(self.jobs.items())]


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait until each has ended (whatever it ended with)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def _close_channels(js: JobSync) -> None:
    for link in js.links.values():
        await link.close()


def is_peer_error(exc: BaseException) -> bool:
    return isinstance(exc, AuthenticationError | LookupError | InvalidInputError)


class GatedEngine:
    """The engine as the Preconditioner servicer sees it: ``submit`` goes through the sync's
    gate (another daemon may own the block); everything else is the engine's own."""

    def __init__(self, engine: PreconditionerEngine, manager: SyncManager) -> None:
        self._engine = engine
        self._manager = manager

    def submit(self, task: SolveTask, *, job: str = "") -> SubmitOutcome:
        return self._manager.submit(task, job)

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)
