"""Run a command inside the confinement that deploy/systemd/asteria-server.service asks for.

systemd is not PID 1 on the test machines, so the unit cannot be started as a unit. This
launcher builds the same confinement with the kernel interfaces systemd itself uses, then
execs the command (the unit's ``ExecStart``, or a probe):

- ``ProtectSystem=strict``: a private mount namespace in which every mount is read-only except
  ``/dev``, ``/proc``, ``/sys`` and the RuntimeDirectory;
- ``ProtectKernelTunables``: ``/sys`` and ``/proc/sys`` read-only;
- ``PrivateTmp``: empty tmpfs on ``/tmp`` and ``/var/tmp``;
- ``ProtectHome``: empty read-only tmpfs on ``/home``, ``/root`` and ``/run/user``;
- ``PrivateDevices``: a tmpfs ``/dev`` holding only null, zero, full, random, urandom, tty,
  the std* links and an empty ``/dev/shm``;
- ``User=``: the command runs as the given uid/gid with no supplementary groups;
- ``CapabilityBoundingSet=`` (empty): every capability dropped from the bounding set;
- ``UMask=0077``, ``NoNewPrivileges=yes``;
- ``MemoryDenyWriteExecute=yes``: ``PR_SET_MDWE`` (what systemd uses where the kernel has it);
- ``SystemCallFilter=@system-service`` with ``SystemCallErrorNumber=EPERM``: a seccomp allow
  list of the group as ``systemd-analyze syscall-filter`` expands it on this machine, other
  calls fail with EPERM; ``RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6`` in the same
  filter (``socket()`` of any other family fails with EPERM).

The interpreter and the project may live under ``/root``, ``/home`` or ``/tmp`` on a test
machine (in production the daemon is installed under ``/usr``): those paths, given with
``--expose``, are bound back read-only inside the hidden directories. Nothing else is.

Needs root (to build the namespace), ``systemd-analyze``, ``libseccomp`` and Linux >= 6.3 (for
``PR_SET_MDWE``); ``--check`` says in one line what is missing and exits 3.

usage: unit_sandbox.py --runtime-dir DIR --user UID:GID [--expose PATH ...] -- COMMAND ...
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_MDWE, PR_GET_MDWE = 24, 38, 65, 66
PR_MDWE_REFUSE_EXEC_GAIN = 1
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ = 4
HIDDEN_HOME = ("/home", "/root", "/run/user")
PRIVATE_TMP = ("/tmp", "/var/tmp")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
ALLOWED_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
API_TREES = ("/proc", "/sys", "/dev")

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]


class SandboxError(RuntimeError):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype)]
    opts = data.encode() if data else None
    _check(libc.mount(enc[0], enc[1], enc[2], flags, opts), f"mount {target}")


def _unescape(field: str) -> str:
    """Mount points in /proc/self/mountinfo escape space, tab, newline and backslash as \\ooo."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> list[tuple[str, int]]:
    """(mount point, the per-mount flags to keep on a remount), parents before children."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point, options = _unescape(fields[4]), fields[5].split(",")
        keep = (MS_NOSUID if "nosuid" in options else 0) | (MS_NODEV if "nodev" in options else 0)
        keep |= MS_NOEXEC if "noexec" in options else 0
        found.append((point, keep))
    return sorted(found, key=lambda m: m[0].count("/") if m[0] != "/" else 0)


def under(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def syscall_group(name: str, seen: set[str] | None = None) -> set[str]:
    """The system calls of a systemd filter group, nested groups expanded."""
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    listing = subprocess.run(
        ["systemd-analyze", "syscall-filter", name], capture_output=True, text=True, check=True
    ).stdout
    calls: set[str] = set()
    for raw in listing.splitlines()[1:]:
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        calls |= syscall_group(entry, seen) if entry.startswith("@") else {entry}
    return calls


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def load_seccomp(allowed: set[str]) -> None:
    """Allow ``allowed`` (``socket`` only for the unit's families); everything else: EPERM."""
    path = ctypes.util.find_library("seccomp")
    if path is None:
        raise SandboxError("libseccomp is not installed")
    lib = ctypes.CDLL(path)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x00050000 | errno.EPERM)  # SCMP_ACT_ERRNO(EPERM)
    if not ctx:
        raise SandboxError("seccomp_init failed")
    for name in sorted(allowed - {"socket"}):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a call of this architecture
            continue
        if lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, nr, 0, None) != 0:
            raise SandboxError(f"seccomp rule for {name} refused")
    nr = lib.seccomp_syscall_resolve_name(b"socket")
    for family in ALLOWED_FAMILIES:
        cmp = (_ArgCmp * 1)(_ArgCmp(0, SCMP_CMP_EQ, int(family), 0))
        if lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, nr, 1, cmp) != 0:
            raise SandboxError("seccomp rule for socket refused")
    if lib.seccomp_load(ctx) != 0:
        raise SandboxError("seccomp_load failed")


def missing_requirements() -> str | None:
    """Why this machine cannot build the confinement, or None."""
    if os.geteuid() != 0:
        return "needs root to build a mount namespace"
    if not os.access("/run", os.W_OK | os.X_OK):
        return "/run (the unit's %t) is not writable here"
    if shutil.which("systemd-analyze") is None:
        return "systemd-analyze is not installed (it expands @system-service)"
    if ctypes.util.find_library("seccomp") is None:
        return "libseccomp is not installed"
    if libc.prctl(PR_GET_MDWE, 0, 0, 0, 0) < 0:
        return "the kernel has no PR_SET_MDWE (Linux >= 6.3)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no mount namespace here: {probe.stderr.strip()}"
    return None


def confine(runtime_dir: str, uid: int, gid: int, expose: list[str]) -> None:
    allowed = syscall_group("@system-service")  # before the mounts hide nothing it needs
    _check(libc.unshare(CLONE_NEWNS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)

    # Stage what will be bound back after tmpfs mounts cover it: the exposed paths, old /dev.
    stage = Path(runtime_dir).parent / ".stage"
    stage.mkdir(mode=0o700)
    staged: list[tuple[str, str]] = []
    for i, path in enumerate(sorted(set(expose))):
        if any(under(path, hidden) for hidden in HIDDEN_HOME + PRIVATE_TMP):
            spot = stage / str(i)
            spot.mkdir()
            mount(path, str(spot), None, MS_BIND | MS_REC)
            staged.append((path, str(spot)))
    old_dev = stage / "dev"
    old_dev.mkdir()
    mount("/dev", str(old_dev), None, MS_BIND | MS_REC)
    mount(runtime_dir, runtime_dir, None, MS_BIND)

    # ProtectSystem=strict, ProtectKernelTunables.
    for point, keep in mounts():
        if point == runtime_dir or any(under(point, t) for t in ("/proc", "/dev")):
            continue
        if under(point, str(stage)):
            continue
        mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
    mount("/proc/sys", "/proc/sys", None, MS_BIND | MS_REC)
    mount(None, "/proc/sys", None, MS_REMOUNT | MS_BIND | MS_RDONLY)

    # PrivateTmp, ProtectHome (with the exposed paths bound back read-only).
    for tree in PRIVATE_TMP + HIDDEN_HOME:
        if not os.path.isdir(tree):
            continue
        private_tmp = tree in PRIVATE_TMP
        mode = "1777" if private_tmp else "0755"
        mount("tmpfs", tree, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode}")
        for path, spot in staged:
            if under(path, tree):
                os.makedirs(path, exist_ok=True)
                mount(spot, path, None, MS_BIND | MS_REC)
                mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        if not private_tmp:
            mount(None, tree, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)

    # PrivateDevices.
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755")
    for name in DEVICES:
        node = f"/dev/{name}"
        Path(node).touch()
        mount(str(old_dev / name), node, None, MS_BIND)
    os.mkdir("/dev/shm")
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777")
    os.symlink("/proc/self/fd", "/dev/fd")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"/dev/{name}")

    # User=, CapabilityBoundingSet=, UMask=, NoNewPrivileges, MemoryDenyWriteExecute.
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    os.umask(0o077)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    _check(libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0), "PR_SET_MDWE")
    # SystemCallFilter=@system-service, SystemCallErrorNumber=EPERM, RestrictAddressFamilies.
    load_seccomp(allowed)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="say what is missing, exit 0 or 3")
    parser.add_argument("--runtime-dir", help="the RuntimeDirectory: stays writable")
    parser.add_argument("--user", help="UID:GID to run the command as")
    parser.add_argument("--expose", action="append", default=[], help="bind back read-only")
    parser.add_argument("command", nargs="*")
    args = parser.parse_args(argv)
    missing = missing_requirements()
    if args.check or missing:
        if missing:
            print(missing)
        return 3 if missing else 0
    if not args.command or not args.runtime_dir or not args.user:
        parser.error("--runtime-dir, --user and a command are required")
    uid, _, gid = args.user.partition(":")
    runtime_dir = os.path.realpath(args.runtime_dir)
    expose = [os.path.realpath(p) for p in args.expose]
    try:
        confine(runtime_dir, int(uid), int(gid or uid), expose)
    except (SandboxError, OSError, subprocess.CalledProcessError) as exc:
        print(f"unit_sandbox: {exc}", file=sys.stderr)
        return 4
    os.execvp(args.command[0], args.command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
