"""Where the engine keeps results: host memory under a budget, cold ones spilled to local disk.

Every block keeps its newest good result so that a client that reconnects, a data-parallel
replica or a restarted trainer gets it without a new solve. Those results add up, so the host
tier has a budget (``cache_memory_bytes``). Results held in a client's own result segment cost
the daemon nothing and are not counted; results in the daemon's memory are, in least recently
used order (a result is *used* when it arrives, and whenever it is sent or taken).

When the host tier is over its budget, the least recently used results leave it:

- with a **spill directory**, each is written to one file there, atomically (a temporary file,
  then ``rename``), with one CRC-32 over its header and its arrays (an edited kind or dtype
  fails it as an edited byte of data does). The write happens *outside* the engine's lock
  (:meth:`ResultTiers.begin_spill`, then the engine's spill thread writes, then
  :meth:`ResultTiers.end_spill`): a slow or full disk must not hold up every tenant's calls.
  While it is written the result stays in memory and is served from there; a result used
  again, replaced or forgotten meanwhile stays (or goes) as if it had never been chosen, and
  its file is removed. It is brought back on demand (the next time it is asked for): the file
  is memory-mapped, its checksum verified, the arrays copied back into memory and the file
  removed, and the host tier enforces its budget again;
- without one, or when a spill file cannot be written or fails its checksum, the result is
  **dropped**: the block keeps its versions and counts, and a client that still needs that
  version submits the snapshot again (the registry accepts that one resubmission).

Spill files are named ``asteria-spill-<incarnation>-<n>.res``; a daemon that starts removes
every such file it finds (it knows none of them: they belong to a previous incarnation, whose
results no client can ask this one for). Other files in the directory are left alone. The
daemon checks the directory as it checks its socket directory (a real directory of its own user,
not writable by others) and holds a lock in it, so a second daemon cannot use it (and remove
the first one's files).

Not thread-safe: the engine calls it under its lock (all but the file writes themselves).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import mmap
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asteria_server.types import SolveKind, SolveResult

logger = logging.getLogger(__name__)

Key = tuple[str, str]

#: The first bytes of a spill file, then the header's length and the CRC-32 of the header and
#: the arrays together (little-endian u32 each): an edited header (a kind, a dtype) fails it.
MAGIC = b"ASTERIA-SPILL-2\n"
_HEADER_LEN = struct.Struct("<II")
#: The dtype each array of a result has (a spill file saying otherwise is corrupt).
_DTYPES = {
    "matrix": np.dtype(np.float32),
    "eigenvalues": np.dtype(np.float32),
    "permutation": np.dtype(np.int64),
    "rotation": np.dtype(np.float32),
}
#: Arrays start at multiples of this in the file (aligned views of the mapping).
_ALIGN = 64
_FIELDS = ("matrix", "eigenvalues", "permutation", "rotation")
SPILL_PREFIX = "asteria-spill-"
SPILL_SUFFIX = ".res"


def result_bytes(result: SolveResult) -> int:
    """The bytes of ``result``'s arrays."""
    return sum(getattr(result, f).nbytes for f in _FIELDS if getattr(result, f) is not None)


@dataclass(frozen=True)
class SpillEntry:
    """A result on disk: its file, version and size."""

    path: Path
    version: int
    num_bytes: int


class SpillEnd(enum.Enum):
    """How a spill write ended (see :meth:`ResultTiers.end_spill`)."""

    SPILLED = "spilled"
    DROPPED = "dropped"
    KEPT = "kept"


class SpillCorruptError(RuntimeError):
    """A spill file is truncated, malformed or fails its checksum."""


def write_spill_file(path: Path, result: SolveResult) -> int:
    """Write ``result`` to ``path`` atomically (temp file + rename); returns the file's size."""
    arrays = [(f, getattr(result, f)) for f in _FIELDS if getattr(result, f) is not None]
    offset = 0
    layout = []
    for name, array in arrays:
        layout.append({"field": name, "dtype": array.dtype.str, "shape": list(array.shape)})
        layout[-1]["offset"] = offset
        offset += -(-array.nbytes // _ALIGN) * _ALIGN
    payload_bytes = offset
    header = {
        "tenant": result.tenant,
        "block": result.block,
        "version": result.version,
        "kind": result.kind.value,
        "base_version": result.base_version,
        "epsilon_used": result.epsilon_used,
        "solve_time_s": result.solve_time_s,
        "attempts": result.attempts,
        "arrays": layout,
        "payload_bytes": payload_bytes,
    }
    encoded = json.dumps(header).encode()
    crc = zlib.crc32(encoded)
    for _, array in arrays:
        crc = zlib.crc32(np.ascontiguousarray(array).data, crc)
    start = -(-(len(MAGIC) + _HEADER_LEN.size + len(encoded)) // _ALIGN) * _ALIGN
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _HEADER_LEN.pack(len(encoded), crc) + encoded)
            f.write(b"\0" * (start - f.tell()))
            for entry, (_, array) in zip(layout, arrays, strict=True):
                f.seek(start + int(entry["offset"]))
                f.write(np.ascontiguousarray(array).data)
            f.truncate(start + payload_bytes)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return start + payload_bytes


def read_spill_file(path: Path) -> SolveResult:
    """The result in ``path``, its arrays copied into memory; SpillCorruptError when the file is
    malformed or its bytes fail the checksum (OSError when it cannot be read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size < len(MAGIC) + _HEADER_LEN.size:
            raise SpillCorruptError(f"spill file {path} is truncated ({size} bytes)")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
            if mapped[: len(MAGIC)] != MAGIC:
                raise SpillCorruptError(f"spill file {path} does not start with {MAGIC!r}")
            length, expected_crc = _HEADER_LEN.unpack_from(mapped, len(MAGIC))
            begin = len(MAGIC) + _HEADER_LEN.size
            if begin + length > size:
                raise SpillCorruptError(f"spill file {path} is truncated in its header")
            encoded = bytes(mapped[begin : begin + length])
            crc = zlib.crc32(encoded)
            try:
                header: dict[str, Any] = json.loads(encoded)
            except ValueError as exc:
                raise SpillCorruptError(f"spill file {path} has a malformed header") from exc
            start = -(-(begin + length) // _ALIGN) * _ALIGN
            if start + int(header["payload_bytes"]) != size:
                raise SpillCorruptError(f"spill file {path} has {size} bytes, not the expected")
            arrays: dict[str, np.ndarray] = {}
            for entry in header["arrays"]:
                dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
                if _DTYPES.get(entry["field"]) != dtype:
                    raise SpillCorruptError(f"spill file {path} has a {dtype} {entry['field']}")
                end = int(entry["offset"]) + dtype.itemsize * int(np.prod(shape))
                if not 0 <= int(entry["offset"]) <= end <= int(header["payload_bytes"]):
                    raise SpillCorruptError(f"spill file {path} has an array outside its data")
                view = np.frombuffer(
                    mapped,
                    dtype=dtype,
                    count=int(np.prod(shape)),
                    offset=start + int(entry["offset"]),
                ).reshape(shape)
                crc = zlib.crc32(view.data, crc)
                arrays[entry["field"]] = view.copy()
                del view  # no export of the mapping may outlive it
            if crc != expected_crc:
                raise SpillCorruptError(f"spill file {path} fails its checksum")
    finally:
        os.close(fd)
    return SolveResult(
        block=header["block"],
        version=int(header["version"]),
        kind=SolveKind(header["kind"]),
        matrix=arrays["matrix"],
        eigenvalues=arrays.get("eigenvalues"),
        permutation=arrays.get("permutation"),
        rotation=arrays.get("rotation"),
        base_version=int(header["base_version"]),
        epsilon_used=float(header["epsilon_used"]),
        solve_time_s=float(header["solve_time_s"]),
        attempts=int(header["attempts"]),
        tenant=header["tenant"],
    )


def remove_stale_spill_files(directory: Path) -> int:
    """Remove every spill file (and left-over temporary file) in ``directory``; their number."""
    removed = 0
    for entry in os.scandir(directory):
        name = entry.name.lstrip(".")
        if name.startswith(SPILL_PREFIX) and (
            name.endswith(SPILL_SUFFIX) or name.endswith(SPILL_SUFFIX + ".tmp")
        ):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
    return removed


class ResultTiers:
    """The host tier's LRU order and bytes, and the spill tier's files (see the module docstring).

    The registry still holds each block's result; this class decides which leave memory, and
    writes and reads their files. ``budget_bytes`` None: unbounded (nothing spills)."""

    def __init__(
        self, *, budget_bytes: int | None, spill_dir: Path | None, incarnation: str
    ) -> None:
        self.budget_bytes = budget_bytes
        self.spill_dir = spill_dir
        self._incarnation = incarnation
        self._host: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        self.host_bytes = 0
        self._spilled: dict[Key, SpillEntry] = {}
        self.spill_bytes = 0
        #: results being written to their spill files (outside the lock): result, size, file
        self._leaving: dict[Key, tuple[SolveResult, int, Path]] = {}
        self.leaving_bytes = 0
        self.dropped = 0
        self._serial = 0
        if spill_dir is not None:
            spill_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            removed = remove_stale_spill_files(spill_dir)
            if removed:
                logger.info("removed %d spill files left in %s", removed, spill_dir)

    # ------------------------------------------------------------------ queries
    @property
    def num_spilled(self) -> int:
        return len(self._spilled)

    def spilled_keys(self) -> Iterable[Key]:
        """The blocks whose newest result lies in a spill file."""
        return self._spilled.keys()

    def tier(self, key: Key, result: SolveResult | None) -> str:
        """``host``, ``shm``, ``spill`` or ``""`` for a block holding ``result`` in the registry."""
        if result is not None:
            return "shm" if result.shm is not None else "host"
        return "spill" if key in self._spilled else ""

    def tiers(self, keys: list[Key], results: list[SolveResult | None]) -> list[str]:
        """:meth:`tier` of many blocks, in one comprehension: a status read of 160,000 blocks
        made a method call per block."""
        spilled = self._spilled
        return [
            ("host" if result.shm is None else "shm")
            if result is not None
            else ("spill" if key in spilled else "")
            for key, result in zip(keys, results, strict=True)
        ]

    @property
    def memory_bytes(self) -> int:
        """Bytes of results in the daemon's memory: the host tier and those being spilled."""
        return self.host_bytes + self.leaving_bytes

    def spilled(self, key: Key) -> SpillEntry | None:
        return self._spilled.get(key)

    def tracks(self, key: Key) -> bool:
        """Whether the block's result counts in the host tier."""
        return key in self._host

    # ------------------------------------------------------------------ events
    def held(self, key: Key, result: SolveResult | None) -> None:
        """``result`` is now the block's held result (None: it holds none in memory)."""
        self._discard_spilled(key)
        self._cancel_spill(key)
        self._host_remove(key)
        if result is not None and result.shm is None:
            size = result_bytes(result)
            self._host[key] = size
            self.host_bytes += size

    def touch(self, key: Key) -> None:
        """The block's result was used: it becomes the most recently used (one being spilled
        stays in memory: its write is given up)."""
        leaving = self._leaving.get(key)
        if leaving is not None:
            self._cancel_spill(key)
            self._host[key] = leaving[1]
            self.host_bytes += leaving[1]
        elif key in self._host:
            self._host.move_to_end(key)

    def forget(self, key: Key) -> None:
        """The block is gone: its host entry and spill file too."""
        self._host_remove(key)
        self._cancel_spill(key)
        self._discard_spilled(key)

    def victims(self) -> list[Key]:
        """The least recently used blocks that must leave the host tier to meet the budget
        (never the most recently used one: a result that just arrived is first sent)."""
        if self.budget_bytes is None or self.host_bytes <= self.budget_bytes:
            return []
        out = []
        excess = self.host_bytes - self.budget_bytes
        for key, size in list(self._host.items())[:-1]:
            if excess <= 0:
                break
            out.append(key)
            excess -= size
        return out

    def drop(self, key: Key) -> None:
        """``key``'s result leaves the host tier without a copy (no spill directory)."""
        self._host_remove(key)
        self.dropped += 1

    def begin_spill(self, key: Key, result: SolveResult) -> Path:
        """``result`` leaves the host tier for a spill file: the path to write it to (outside
        the lock, with :func:`write_spill_file`); then :meth:`end_spill`. Needs a spill
        directory."""
        if self.spill_dir is None:
            raise RuntimeError("begin_spill without a spill directory")
        size = self._host.pop(key)
        self.host_bytes -= size
        self._serial += 1
        path = self.spill_dir / f"{SPILL_PREFIX}{self._incarnation}-{self._serial}{SPILL_SUFFIX}"
        self._leaving[key] = (result, size, path)
        self.leaving_bytes += size
        return path

    def leaving(self, key: Key, path: Path) -> SolveResult | None:
        """The result :meth:`begin_spill` asked to write to ``path``; None when it was used,
        replaced or forgotten since (nothing to write)."""
        entry = self._leaving.get(key)
        return entry[0] if entry is not None and entry[2] == path else None

    def end_spill(
        self, key: Key, result: SolveResult, size: int | None, *, still_held: bool = True
    ) -> SpillEnd:
        """The write :meth:`begin_spill` asked for is over (``size`` None: it failed;
        ``still_held``: the registry still holds ``result`` as the block's). SPILLED: the block
        now holds its result on disk (the registry lets go of it); DROPPED: the write failed,
        the result is gone; KEPT: the result was used, replaced or forgotten meanwhile, so
        nothing changes here and the writer removes the file it wrote."""
        leaving = self._leaving.get(key)
        if leaving is None or leaving[0] is not result or not still_held:
            if leaving is not None and leaving[0] is result:
                self._cancel_spill(key)
            return SpillEnd.KEPT
        del self._leaving[key]
        self.leaving_bytes -= leaving[1]
        if size is None:
            self.dropped += 1
            return SpillEnd.DROPPED
        self._spilled[key] = SpillEntry(leaving[2], result.version, size)
        self.spill_bytes += size
        return SpillEnd.SPILLED

    def load(self, key: Key) -> SolveResult | None:
        """Bring a spilled result back (the file is removed either way); None when it is
        corrupt or unreadable (counted as dropped)."""
        entry = self._spilled.get(key)
        if entry is None:
            return None
        try:
            result = read_spill_file(entry.path)
        except (OSError, SpillCorruptError, KeyError, ValueError) as exc:
            logger.warning("dropping a spilled result of block %r: %s", key[1], exc)
            self.dropped += 1
            self._discard_spilled(key)
            return None
        self._discard_spilled(key)
        if (result.tenant, result.block) != key or result.version != entry.version:
            logger.warning("dropping spill file %s: it holds another block", entry.path)
            self.dropped += 1
            return None
        return result

    def close(self) -> None:
        """Remove every spill file (the daemon stops; nobody will ask for them)."""
        for key in list(self._leaving):
            self._cancel_spill(key)
        for key in list(self._spilled):
            self._discard_spilled(key)

    # ------------------------------------------------------------------ internals
    def _host_remove(self, key: Key) -> None:
        size = self._host.pop(key, None)
        if size is not None:
            self.host_bytes -= size

    def _cancel_spill(self, key: Key) -> None:
        """Give up the write of ``key``'s spill file (it may be under way: :meth:`end_spill`
        then says KEPT, and the writer removes the file)."""
        leaving = self._leaving.pop(key, None)
        if leaving is not None:
            self.leaving_bytes -= leaving[1]

    def _discard_spilled(self, key: Key) -> None:
        entry = self._spilled.pop(key, None)
        if entry is not None:
            self.spill_bytes -= entry.num_bytes
            with contextlib.suppress(FileNotFoundError):
                entry.path.unlink()
