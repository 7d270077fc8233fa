"""`asteria-server`: the per-node preconditioner daemon: parse, load config, set up logging, run.

Two more things it does without serving, both on the same configuration as the daemon itself so
that what a supervisor checks is what it runs: ``--check-config`` (load, validate, print the
effective settings, exit) and ``--health-check`` (ask the daemon this configuration describes for
its standard gRPC health status: the probe of systemd, Kubernetes, Slurm scripts and the
container image, none of which then needs a client with torch).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from asteria_server import __version__
from asteria_server.config import (
    DEFAULT_METRICS_HOST,
    LOG_LEVELS,
    DaemonConfig,
    LogFormat,
    TcpAddress,
    default_listen,
    effective_settings,
    env_name,
    load_config,
    memory_limit_problem,
)

#: Exit status of a daemon that could not start (a port or socket taken, a bad directory, an
#: engine that would not start): the same as an engine that broke, so a supervisor restarts it.
EXIT_STARTUP_FAILED = 3
#: Exit status of an invalid configuration (``--check-config`` too).
EXIT_INVALID_CONFIG = 2

DESCRIPTION = """\
Asteria's per-node preconditioner daemon. Training processes on this node stream Kronecker factor
snapshots to it over gRPC; it computes inverse roots and eigenbases in solver worker processes and
streams the results back.

Settings are read from the --config TOML file, then from ASTERIA_* environment variables, then from
these flags (flags win). Every setting has the same name in all three: --chunk-bytes is TOML
`chunk_bytes` and env ASTERIA_CHUNK_BYTES. Tenant tokens come from a TOML [tenants] table
(tenant = "token") or ASTERIA_TOKENS="tenant1=tok1,tenant2=tok2"; without tokens only tenant
"local" with an empty token is accepted, and only on a Unix socket.

Once serving it prints one line: `asteria-server serving on ADDRESS incarnation=ID workers=N
pid=PID` (and ` metrics=URL` with --metrics-listen, which also serves /healthz and /readyz).

SIGTERM or SIGINT drains: no new sessions or snapshots, queued and running solves get
--grace-period-s to finish and reach their clients, what is left is dropped and counted in the
log; then it exits 0 (a second SIGTERM stops the drain). SIGHUP reloads tenant tokens, the log
level and the limits from the config file and environment and logs what it changed and what needs
a restart. Exit status: 2 for an invalid configuration, 3 when the daemon cannot start (one line
on stderr, one JSON object with --log-format json) or its engine broke.

--check-config loads and validates the settings, prints them (tokens redacted) with an estimate of
the memory the daemon may use, and exits: 0 when valid, 2 when not (also when the estimate exceeds
the memory limit of its cgroup, from which the memory defaults come). Tokens shorter than 16
characters or holding a placeholder (REPLACE) are invalid. --health-check asks the daemon at the
configured address for its health: exit 0 when it is SERVING, 1 otherwise.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asteria-server",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--version", action="version", version=f"asteria-server {__version__}")
    add("--config", metavar="PATH", help="TOML config file (keys: the option names below with _)")
    add(
        "--listen",
        metavar="ADDR",
        help=(
            f"unix:///path/to.sock (default: {default_listen().replace('%', '%%')}; directory "
            "0700, socket 0600, a .lock file beside it) or HOST:PORT for TCP (needs tenant "
            "tokens; beyond loopback also --tls-cert and --tls-key; port 0 picks a free port)"
        ),
    )
    add("--workers", type=int, metavar="N", help="solver worker processes (default: CPUs - 1)")
    add("--blas-threads", type=int, metavar="N", help="BLAS threads per worker (default 1)")
    add("--max-message-bytes", type=int, metavar="B", help="largest gRPC message (default 4 MiB)")
    add("--chunk-bytes", type=int, metavar="B", help="array chunk size of streams (default 1 MiB)")
    add("--max-matrix-n", type=int, metavar="N", help="largest factor dimension (default 16384)")
    add(
        "--grace-period-s",
        type=float,
        metavar="S",
        help=(
            "at SIGTERM, seconds queued and running solves and in-flight calls may finish "
            "(the drain) before the rest is dropped and counted (default 10)"
        ),
    )
    add("--keepalive-time-s", type=float, metavar="S", help="keepalive ping interval (default 30)")
    add(
        "--keepalive-timeout-s",
        type=float,
        metavar="S",
        help="an unanswered keepalive ping closes the connection after this (default 10)",
    )
    add(
        "--handshake-timeout-s",
        type=float,
        metavar="S",
        help="a connection without a completed HTTP/2 handshake is closed after this (default 10)",
    )
    add(
        "--max-connections",
        type=int,
        metavar="N",
        help="gRPC connections per listener at once; one more is closed before its handshake "
        "(default 0: a quarter of the descriptor budget, at most 1024)",
    )
    add(
        "--connection-idle-s",
        type=float,
        metavar="S",
        help="a gRPC connection with no call in flight this long is closed (default 300)",
    )
    add(
        "--max-streams-per-connection",
        type=int,
        metavar="N",
        help="calls in flight on one gRPC connection at once (default 256)",
    )
    add("--max-sessions", type=int, metavar="N", help="open sessions at most (default 4096)")
    add("--tls-cert", metavar="PEM", help="TLS certificate chain (TCP only)")
    add("--tls-key", metavar="PEM", help="TLS private key of --tls-cert")
    add("--log-level", type=str.upper, choices=LOG_LEVELS, help="log level (default INFO)")
    add("--ready-file", metavar="PATH", help="write the serving line here once ready")
    add(
        "--stop-with-pid",
        type=int,
        metavar="PID",
        help=(
            "stop, as on SIGTERM, when process PID exits (for a launcher whose daemon must not "
            "outlive it, even one killed with SIGKILL; Linux >= 5.3)"
        ),
    )
    add(
        "--shared-memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "offer same-host clients the shared-memory transport: a segment-handover socket "
            "<socket>.shm next to a Unix --listen socket (default: on)"
        ),
    )
    add(
        "--max-upload-bytes",
        type=int,
        metavar="B",
        help=(
            "snapshot bytes received at once, all clients together; an upload waits for room, "
            "then fails RESOURCE_EXHAUSTED (default 2 GiB)"
        ),
    )
    add(
        "--upload-wait-s",
        type=float,
        metavar="S",
        help="how long an upload may wait for room in --max-upload-bytes (default 5)",
    )
    add(
        "--max-shm-segments",
        type=int,
        metavar="N",
        help="shared-memory segments one client may hand over (default 4096)",
    )
    _add_limit_flags(add)
    add(
        "--metrics-listen",
        metavar="HOST:PORT",
        help=(
            "serve Prometheus metrics at http://HOST:PORT/metrics; ':PORT' means "
            f"{DEFAULT_METRICS_HOST}:PORT, name a host (0.0.0.0) to be scraped from elsewhere "
            "(default: off)"
        ),
    )
    add(
        "--log-format",
        type=str.lower,
        choices=[f.value for f in LogFormat],
        help="text (default) or json: one object a line (time, level, event, tenant, job, block)",
    )
    add(
        "--socket-group-access",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "make the Unix socket 0660 so members of the daemon's group connect (its directory "
            "0750; needs tenant tokens) (default: off, 0600)"
        ),
    )
    add(
        "--solve-timeout-floor-s",
        type=float,
        metavar="S",
        help="the least time a solve is given before its worker counts as hung (default 30)",
    )
    add(
        "--solve-timeout-factor",
        type=float,
        metavar="X",
        help=(
            "a solve is given X times the calibrated cost model's estimate for its n (at least "
            "the floor); a hung or stopped worker is then killed and replaced (default 20)"
        ),
    )
    add(
        "--solve-timeout-s",
        type=float,
        metavar="S",
        help="the most any solve is given, whatever its estimate (default 600)",
    )
    add(
        "--cache-memory-bytes",
        "--cache-memory",
        type=int,
        metavar="B",
        help=(
            "results held in daemon memory beyond this leave, least recently used first, to "
            "--spill-dir, or are dropped and their clients resubmit "
            "(default: half of --max-memory-bytes)"
        ),
    )
    add(
        "--spill-dir",
        metavar="DIR",
        help=(
            "local directory for results leaving --cache-memory-bytes: one checksummed file "
            "each, read back on demand; its old spill files are removed at start (default: none, "
            "such results are dropped)"
        ),
    )
    modes = parser.add_argument_group("checks (run instead of the daemon)")
    modes.add_argument(
        "--check-config",
        action="store_true",
        help="load and validate the settings, print them (tokens redacted) and exit",
    )
    modes.add_argument(
        "--health-check",
        action="store_true",
        help="ask the daemon at the configured address for its health; exit 0 when SERVING",
    )
    modes.add_argument(
        "--health-timeout-s",
        type=float,
        default=5.0,
        metavar="S",
        help="how long --health-check waits for an answer (default 5)",
    )
    parser.epilog = f"Environment: {env_name('<option>')} for any option, and {env_name('tokens')}."
    return parser


def _add_limit_flags(add: Callable[..., object]) -> None:
    """The per-tenant and daemon-wide resource limits (README: "Limits")."""
    add(
        "--max-memory-bytes",
        "--max-memory",
        dest="max_memory_bytes",
        type=int,
        metavar="B",
        help=(
            "host memory for queued snapshots, cached results and uploads (default: RAM / 4, "
            "at most half of the cgroup's memory limit)"
        ),
    )
    add(
        "--tenant-queued-bytes",
        type=int,
        metavar="B",
        help="snapshot bytes one tenant may have queued in daemon memory (default: half the above)",
    )
    add(
        "--tenant-cached-bytes",
        type=int,
        metavar="B",
        help="result bytes one tenant may have cached in daemon memory (default: half the above)",
    )
    add("--tenant-max-blocks", type=int, metavar="N", help="blocks per tenant (default 100000)")
    add("--max-block-name-bytes", type=int, metavar="B", help="longest block name (default 1024)")
    add(
        "--tenant-max-sessions",
        type=int,
        metavar="N",
        help="open sessions per tenant (default 1024)",
    )
    add(
        "--session-ttl-s",
        type=float,
        metavar="S",
        help="a session without calls or an open result stream expires after this (default 300)",
    )
    add(
        "--tenant-max-streams",
        type=int,
        metavar="N",
        help="result streams one tenant may hold open (default 1024)",
    )
    add(
        "--stream-stall-s",
        type=float,
        metavar="S",
        help="a result stream whose client reads nothing for this long ends (default 60)",
    )
    add(
        "--tenant-upload-share",
        type=float,
        metavar="F",
        help="fraction of --max-upload-bytes one tenant's uploads may hold (default 0.5)",
    )
    add(
        "--upload-idle-s",
        type=float,
        metavar="S",
        help="an upload that sends nothing for this long fails (default 30)",
    )
    add("--upload-max-s", type=float, metavar="S", help="longest one upload may take (default 300)")
    add("--tenant-max-jobs", type=int, metavar="N", help="registered jobs per tenant (default 64)")
    add(
        "--metrics-max-connections",
        type=int,
        metavar="N",
        help="connections the metrics endpoint serves at once (default 16)",
    )
    add(
        "--metrics-timeout-s",
        type=float,
        metavar="S",
        help="a metrics connection that sends nothing for this long is closed (default 5)",
    )
    add(
        "--max-job-daemons",
        type=int,
        metavar="N",
        help="distinct daemons one job's layout may list (default 64)",
    )
    add(
        "--tenant-max-peers",
        type=int,
        metavar="N",
        help="peer daemons one tenant's peer groups may contact together (default 256)",
    )
    add(
        "--tenant-max-push-streams",
        type=int,
        metavar="N",
        help="other daemons' PushResults streams one tenant may have open at once (default 16)",
    )
    add(
        "--peer-allow",
        metavar="PATTERNS",
        help=(
            "comma-separated networks (10.0.0.0/8) or host patterns (node-*.cluster) of the "
            "peer daemons a job's peer group may contact (default: loopback only for a daemon "
            "on loopback or a Unix socket, any for one on another interface)"
        ),
    )
    add(
        "--peer-listen",
        metavar="HOST:PORT",
        help=(
            "a second listener, for the peer daemons of multi-node jobs (mutual TLS: needs "
            "--peer-tls-cert, --peer-tls-key and --peer-tls-ca); the node's ranks keep --listen"
        ),
    )
    add(
        "--peer-advertise",
        metavar="HOST:PORT",
        help="the address other nodes dial for --peer-listen (default: it, or this host's name)",
    )
    add("--peer-tls-cert", metavar="PEM", help="certificate this daemon shows its peers")
    add("--peer-tls-key", metavar="PEM", help="private key of --peer-tls-cert")
    add("--peer-tls-ca", metavar="PEM", help="CA that signs the cluster's daemons (mutual TLS)")
    add(
        "--peer-tls-server-name",
        metavar="NAME",
        help="the name every peer's certificate carries (default asteria-peer)",
    )
    add(
        "--job-idle-s",
        type=float,
        metavar="S",
        help="a registered job with no session for this long is forgotten (default 120)",
    )
    add(
        "--job-ttl-s",
        type=float,
        metavar="S",
        help=(
            "a job's blocks and results are forgotten this long after its last session here "
            "closed or expired; 0: kept until `asteria forget` (default 600)"
        ),
    )
    add(
        "--tenant-shm-segments",
        type=int,
        metavar="N",
        help=(
            "shared-memory segments (descriptors) one tenant may hand over (default: half the "
            "daemon's descriptor budget; all of it without tenant tokens)"
        ),
    )


#: Record attributes that a structured log line carries when a call site names them (``extra=``).
LOG_FIELDS = ("tenant", "job", "rank", "block")


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, event and, where the call
    site gave them, tenant, job, rank and block; an exception as its formatted traceback."""

    def format(self, record: logging.LogRecord) -> str:
        time = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        doc: dict[str, object] = {
            "time": time.replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "event": record.getMessage(),
        }
        for name in LOG_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                doc[name] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def setup_logging(config: DaemonConfig) -> None:
    """The daemon's one log handler, on stderr, in the configured format."""
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format is LogFormat.JSON:
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=config.log_level, handlers=[handler], force=True)


def health_check(config: DaemonConfig, timeout_s: float) -> int:
    """Check the standard health service of the daemon ``config`` describes; 0 when SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = config.address
    target = address.target
    if isinstance(address, TcpAddress) and address.host in ("0.0.0.0", "::"):
        loopback = "127.0.0.1" if address.host == "0.0.0.0" else "::1"
        target = TcpAddress(loopback, address.port).target
    if isinstance(address, TcpAddress) and config.tls_cert is not None:
        # A self-signed certificate is its own root; a CA-signed one needs the CA's probe.
        roots = Path(config.tls_cert).read_bytes()
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots))
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()
            print(
                f"asteria-server: no healthy daemon at {target}: "
                f"{code.name if code else 'error'}: {exc.details()}",
                file=sys.stderr,
            )
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target} {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    args["test_fault_prefix"] = None  # TOML or env only: never a flag
    args["cgroup_root"] = None  # TOML or env only
    config_file = args.pop("config")
    check_config, check_health = args.pop("check_config"), args.pop("health_check")
    health_timeout_s = args.pop("health_timeout_s")
    try:
        config = load_config(config_file=config_file, overrides=args)
    except ValueError as exc:
        print(f"asteria-server: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    if check_config:
        print(effective_settings(config), end="")
        problem = memory_limit_problem(config)
        if problem is not None:
            print(f"asteria-server: invalid configuration: {problem}", file=sys.stderr)
            return EXIT_INVALID_CONFIG
        if config.spill_dir is not None:  # the checks the daemon makes at start
            from asteria_server.service.server import (
                SPILL_INSTEAD,
                StartupError,
                prepare_private_dir,
            )

            try:
                prepare_private_dir(
                    Path(config.spill_dir), "spill directory", SPILL_INSTEAD, create=False
                )
            except StartupError as exc:
                print(f"asteria-server: invalid configuration: {exc}", file=sys.stderr)
                return EXIT_INVALID_CONFIG
        return 0
    if check_health:
        return health_check(config, health_timeout_s)
    setup_logging(config)
    # Imported here so `--help` and config errors stay fast.
    from asteria_server.service.allocator import tune_allocator
    from asteria_server.service.server import StartupError, run

    tune_allocator()  # before any thread: freed memory goes back to the system

    def reload() -> DaemonConfig:
        """The configuration as it reads now (SIGHUP): the file again, env, the same flags."""
        return load_config(config_file=config_file, overrides=args)

    try:
        return run(config, reload=reload)
    except StartupError as exc:
        return _startup_failed(config, str(exc))
    except Exception as exc:  # whatever stops the start: one line, no traceback
        return _startup_failed(config, f"{type(exc).__name__}: {exc}")


def _startup_failed(config: DaemonConfig, why: str) -> int:
    """Say in one line why the daemon did not start (one JSON object in JSON log mode)."""
    line = f"asteria-server: could not start: {why}".replace("\n", " ")
    if config.log_format is LogFormat.JSON:
        logging.getLogger("asteria_server").error("%s", line)
    else:
        print(line, file=sys.stderr, flush=True)
    return EXIT_STARTUP_FAILED


if __name__ == "__main__":
    sys.exit(main())
