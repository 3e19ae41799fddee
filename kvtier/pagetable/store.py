"""Persistence of the page table in LMDB: what is on NVMe, and the namespaces.

Databases in one environment (``<data_dir>/meta``):

    namespaces        name -> msgpack {id, block_bytes, key_width, layout}
    ns:<id>           key -> fixed 40 + key_width bytes (RECORD below)
    meta              small service metadata (HBM demand history; ``durable:<id>``, per
                      segment of a namespace the file offset up to which LMDB holds every
                      record its batch headers name: coherence.journal)
    quarantine        "<db>/<key>" -> a damaged value moved aside by `kvtier check --repair`

Namespace records are read back with the decoder rules of the socket frames they came from
(``strict_map_key=False``): a map with integer keys written by an older service reads again.
A record that does not decode is skipped and listed in ``Catalog.damaged``; it never keeps the
other namespaces from opening, and its id is never given to a new namespace.

A record is written only for a version whose bytes and batch header are already in a segment
and fdatasync'ed; records are committed lazily, many flushes to one transaction, by
coherence.journal (the segments' batch headers are replayed after a crash). Because every value of a
namespace has one fixed size, restart reads a whole namespace with a cursor and turns it into
numpy columns with one frombuffer: about a second per million entries on the development machine.

MapFull is handled by doubling the map and retrying the transaction. LMDB is opened with
``lock=True`` and must be opened after a fork, never inherited across one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import lmdb
import msgpack
import numpy as np

from kvtier.checksums import block_checksums
from kvtier.errors import ConfigError, DataDirError, NamespaceError, StorageError

T = TypeVar("T")

_INITIAL_MAP = 64 << 20
MAX_NAMESPACES = 1000          # the store's ceiling; the service's own is max_namespaces
_OWN_DBS = ("namespaces", "meta", "quarantine")


@functools.lru_cache(maxsize=None)
def record_dtype(key_width: int) -> np.dtype:
    """The on-disk value of one NVMe record (little-endian, packed). ``binding`` was a reserved
    zero field before FLAG_BOUND existed (see bindings()). One per key width, built once: a
    flush asked for it twice a put (~7 us each under cProfile, issue 17, fio7); a dtype is
    immutable, so sharing it is safe."""
    return np.dtype([
        ("seg", "<u4"), ("off", "<u4"), ("size", "<u4"), ("flags", "<u4"),
        ("version", "<u8"), ("checksum", "<u8"), ("binding", "<u8"),
        ("parent", f"V{key_width}"),
    ])


FLAG_PARENT = 1
FLAG_BOUND = 2      # binding holds bindings() of the record; records without it predate it


def bindings(ns_id: int, keys: np.ndarray, records: np.ndarray) -> np.ndarray:
    """xxh3-64 of (namespace id, key, the record with binding zeroed), per record.

    The block checksum covers the bytes only, so a bit flip in a key stored in LMDB served the
    block under the flipped key, and `kvtier check` saw nothing (issue 20). Binding the
    namespace, the key and the whole record (version, place, checksum, parent) into one hash
    kept beside it makes any such flip a mismatch: the record is dropped and counted at load
    and listed by check. One C call for a batch (checksums.block_checksums over rows of
    4 + key_width + 40 + key_width bytes): ~75 ms per million records on the dev VM."""
    row = np.dtype([("ns", "<u4"), ("key", keys.dtype), ("rec", records.dtype)])
    rows = np.empty(len(keys), dtype=row)
    rows["ns"] = ns_id
    rows["key"] = keys
    rows["rec"] = records
    rows["rec"]["binding"] = 0
    return block_checksums(rows.view(np.uint8).reshape(len(keys), row.itemsize))


@dataclass(slots=True, frozen=True)
class NamespaceRecord:
    name: str
    ns_id: int
    block_bytes: int
    key_width: int
    layout: dict[str, Any]


def _runs(ops: list[tuple[int, Any, np.ndarray | None]]
          ) -> list[tuple[int, Any, np.ndarray | None]]:
    """Catalog.commit's operations with each run of consecutive puts into one namespace joined
    into one put: the same records in the same order (a key put twice in a run keeps its
    later record, as the puts one after the other did), deletes and other namespaces
    between them kept where they are. A checkpoint commits one put per flush since the last
    (a 16-block put's, hundreds a second in the fio jobs), and each cost a bindings() hash
    call and a cursor of its own (issue 17, fio7)."""
    out: list[tuple[int, Any, np.ndarray | None]] = []
    run: list[tuple[int, Any, np.ndarray | None]] = []

    def close() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append((run[0][0], np.concatenate([op[1] for op in run]),
                        np.concatenate([op[2] for op in run])))
        run.clear()

    for op in ops:
        ns_id, keys, records = op
        if records is None or (run and (ns_id != run[0][0] or keys.dtype != run[0][1].dtype
                                        or records.dtype != run[0][2].dtype)):
            close()
        if records is None:
            out.append(op)
        else:
            run.append(op)
    close()
    return out


class CatalogDamaged(DataDirError):
    """meta/data.mdb is truncated, corrupt or missing beside existing segments."""


def _verify_file(path: Path) -> None:
    """Refuse, by name, an LMDB file that LMDB itself would crash on or misread.

    LMDB maps data.mdb; a file shorter than its own meta page says (a truncation) makes the
    first read past the end a SIGBUS, which no Python code can catch (issue 20: serve and check
    died with no message). The two meta pages (64-bit layout: magic at 16, page size at 40,
    last page and txnid at 136) are read here first and the length compared. A lost data.mdb
    beside segments of namespaces would start an empty service over them: refused too."""
    mdb = path / "data.mdb"
    way_out = (f"stop the service and restore {path} from a backup, or run `kvtier check "
               f"--repair --data-dir {path.parent}`: it moves the file and the segments it "
               f"indexed to {path.parent / 'quarantine'}/ (their blocks are lost) so that the "
               "service starts empty")
    if not mdb.exists():
        nvme = path.parent / "nvme"
        held = sorted(p.name for p in nvme.glob("ns-*") if any(p.glob("seg-*.kvt"))) \
            if nvme.is_dir() else []
        if held:
            raise CatalogDamaged(f"{mdb} is missing but {nvme} holds the segments of "
                                 f"{len(held)} namespaces ({', '.join(held[:5])}); {way_out}")
        return
    size = mdb.stat().st_size
    with mdb.open("rb") as fh:
        head = fh.read(2 * 4096)
    metas = []
    for page in (0, 1):
        o = page * 4096
        if len(head) >= o + 152 and head[o + 16:o + 20] == _LMDB_MAGIC:
            psize = int.from_bytes(head[o + 40:o + 44], "little")
            last, txnid = (int.from_bytes(head[o + i:o + i + 8], "little") for i in (136, 144))
            metas.append((txnid, last, psize))
    if not metas:
        raise CatalogDamaged(f"{mdb} has no valid LMDB header ({size} bytes); {way_out}")
    _txnid, last, psize = max(metas)
    if not 512 <= psize <= 65536 or size < (last + 1) * psize:
        raise CatalogDamaged(f"{mdb} is truncated: {size} bytes, its header says "
                             f"{(last + 1) * psize}; {way_out}")


_LMDB_MAGIC = (0xBEEFC0DE).to_bytes(4, "little")


class Catalog:
    """The LMDB environment of one data directory."""

    def __init__(self, path: Path, map_size: int = _INITIAL_MAP) -> None:
        self.path = Path(path)
        _verify_file(self.path)
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            # max_dbs counts every named database: one per namespace and the catalog's own
            # (MDB_DBS_FULL at the 1,000th namespace when it counted only the namespaces).
            self.env = lmdb.open(str(self.path), map_size=map_size,
                                 max_dbs=MAX_NAMESPACES + len(_OWN_DBS), subdir=True, sync=True,
                                 metasync=True, lock=True, mode=0o600)
            _private(self.path, ("data.mdb", "lock.mdb"))
        except lmdb.CorruptedError as exc:
            raise self._damaged(exc) from None
        except (OSError, lmdb.Error) as exc:
            raise DataDirError(f"cannot open LMDB under {self.path}: {exc}; check that data_dir "
                               "is writable and not on a network file system") from None
        with self._reading():
            self._ns_db = self.env.open_db(b"namespaces")
            self._meta_db = self.env.open_db(b"meta")
            self._quarantine_db = self.env.open_db(b"quarantine")
        self._dbs: dict[int, Any] = {}
        self._write_lock = threading.RLock()
        self.map_grows = 0
        self.damaged: dict[bytes, str] = {}   # namespace record name -> why it was skipped

    # ------------------------------------------------------------------ transactions

    def _damaged(self, exc: Exception) -> CatalogDamaged:
        return CatalogDamaged(
            f"{self.path / 'data.mdb'} is damaged ({exc}); stop the service and restore "
            f"{self.path} from a backup, or run `kvtier check --repair --data-dir "
            f"{self.path.parent}`: it moves the file and the segments it indexed to "
            f"{self.path.parent / 'quarantine'}/ (their blocks are lost)")

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """LMDB's errors on a damaged file (MDB_CORRUPTED, MDB_PAGE_NOTFOUND, a transaction
        spoiled by one) become CatalogDamaged, which names the file and the way out."""
        try:
            yield
        except (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError,
                lmdb.InvalidError, lmdb.BadValsizeError) as exc:
            raise self._damaged(exc) from None

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run fn in a write transaction; on MapFull double the map and run it again."""
        # One writer at a time in this process: LMDB serialises write transactions anyway, and
        # growing the map needs no other transaction open (the engine's NVMe writer commits
        # records beside the engine's own namespace and meta writes).
        with self._write_lock:
            while True:
                try:
                    with self.env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
                    self.map_grows += 1
                except (lmdb.CorruptedError, lmdb.PageNotFoundError) as exc:
                    raise self._damaged(exc) from None
                except lmdb.Error as exc:
                    raise StorageError(f"LMDB write under {self.path} failed: {exc}") from None

    def _db(self, ns_id: int) -> Any:
        db = self._dbs.get(ns_id)
        if db is None:
            db = self._write(lambda txn: self.env.open_db(f"ns:{ns_id}".encode(), txn=txn))
            self._dbs[ns_id] = db
        return db

    # ------------------------------------------------------------------ namespaces

    def namespaces(self) -> list[NamespaceRecord]:
        """Every readable namespace record; damaged ones are skipped into ``self.damaged``."""
        out = []
        damaged: dict[bytes, str] = {}
        with self._reading(), self.env.begin(db=self._ns_db) as txn:
            for name, raw in txn.cursor():
                try:
                    out.append(_namespace_record(name, raw))
                except (ValueError, KeyError, TypeError, UnicodeDecodeError, msgpack.ExtraData,
                        msgpack.FormatError, msgpack.StackError) as exc:
                    damaged[bytes(name)] = f"{type(exc).__name__}: {exc}"
        self.damaged = damaged
        return out

    def add_namespace(self, name: str, block_bytes: int, key_width: int,
                      layout: dict[str, Any]) -> NamespaceRecord:
        existing = {r.name: r for r in self.namespaces()}
        if name in existing:
            return existing[name]
        if name.encode() in self.damaged:
            raise DataDirError(f"the record of namespace {name!r} in {self.path} is damaged "
                               f"({self.damaged[name.encode()]}); stop the service and run `kvtier check "
                               "--repair` to quarantine it, then create the namespace again")
        if len(existing) + len(self.damaged) >= MAX_NAMESPACES:
            raise NamespaceError(f"at most {MAX_NAMESPACES} namespaces per data directory")
        ns_id = max(self._taken_ids() | {r.ns_id for r in existing.values()}, default=0) + 1
        rec = NamespaceRecord(name, ns_id, block_bytes, key_width, layout)
        value = msgpack.packb({"id": ns_id, "block_bytes": block_bytes, "key_width": key_width,
                               "layout": layout})
        self._db(ns_id)         # its records' database exists before any put is acknowledged
        self._write(lambda txn: txn.put(name.encode(), value, db=self._ns_db))
        return rec

    def _taken_ids(self) -> set[int]:
        """Namespace ids in use by a database or a segment directory, readable record or not:
        a new namespace must never inherit a damaged one's records or segments."""
        ids: set[int] = set()
        with self._reading(), self.env.begin() as txn:
            for dbname, _ in txn.cursor():
                if dbname.startswith(b"ns:") and dbname[3:].isdigit():
                    ids.add(int(dbname[3:]))
        nvme = self.path.parent / "nvme"
        if nvme.is_dir():
            ids.update(int(p.name[3:]) for p in nvme.iterdir()
                       if p.name.startswith("ns-") and p.name[3:].isdigit())
        return ids

    def quarantine_namespace(self, key: bytes) -> None:
        """Move a damaged namespace record aside (``quarantine`` database), never delete it."""
        def move(txn: lmdb.Transaction) -> None:
            raw = txn.get(key, db=self._ns_db)
            if raw is not None:
                txn.put(b"namespaces/" + key, raw, db=self._quarantine_db)
                txn.delete(key, db=self._ns_db)
        self._write(move)

    # ------------------------------------------------------------------ service metadata

    def meta(self, key: str) -> Any:
        """A small msgpack value the service keeps between runs (None when absent or
        unreadable: metadata only tunes, it never holds blocks)."""
        with self._reading(), self.env.begin(db=self._meta_db) as txn:
            raw = txn.get(key.encode())
        if raw is None:
            return None
        try:
            return msgpack.unpackb(raw)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return None

    def set_meta(self, key: str, value: Any) -> None:
        packed = msgpack.packb(value)
        self._write(lambda txn: txn.put(key.encode(), packed, db=self._meta_db))

    # ------------------------------------------------------------------ records

    def put_records(self, ns_id: int, keys: np.ndarray, records: np.ndarray) -> None:
        """Write records (record_dtype) for keys (V{w}) in one transaction."""
        self.commit([(ns_id, keys, records)], {})

    def delete_records(self, ns_id: int, keys: list[bytes]) -> None:
        if keys:
            self.commit([(ns_id, keys, None)], {})

    def commit(self, ops: list[tuple[int, Any, np.ndarray | None]],
               marks: dict[int, dict[int, int]]) -> None:
        """One transaction: ops in order, each (ns_id, keys, records) to put records (keys
        V{w}) or (ns_id, [key bytes], None) to delete them, then the durable marks of the
        namespaces in ``marks`` (segment id -> file offset; see marks())."""
        staged = []
        for ns_id, keys, records in _runs(ops):
            db = self._db(ns_id)
            if records is None:
                staged.append((db, keys, None))
                continue
            records = records.copy()
            records["flags"] |= FLAG_BOUND
            records["binding"] = bindings(ns_id, keys, records)
            staged.append((db, keys, records))
        packed = {ns_id: msgpack.packb({str(int(k)): int(v) for k, v in m.items()})
                  for ns_id, m in marks.items()}

        def apply(txn: lmdb.Transaction) -> None:
            for db, keys, records in staged:
                if records is None:
                    for k in keys:
                        txn.delete(k, db=db)
                    continue
                kb, rb = keys.tobytes(), records.tobytes()
                w, r = keys.dtype.itemsize, records.dtype.itemsize
                with txn.cursor(db=db) as cur:
                    cur.putmulti(((kb[i * w:(i + 1) * w], rb[i * r:(i + 1) * r])
                                  for i in range(len(keys))))
            for ns_id, raw in packed.items():
                txn.put(f"durable:{ns_id}".encode(), raw, db=self._meta_db)
        self._write(apply)

    def marks(self, ns_id: int) -> dict[int, int] | None:
        """Per segment of a namespace, the file offset up to which every batch header's
        records are in LMDB (restart replays what lies past it). None when never written or
        unreadable: then every batch of every segment is replayed."""
        m = self.meta(f"durable:{ns_id}")
        if not isinstance(m, dict):
            return None
        try:
            return {int(k): int(v) for k, v in m.items()}
        except (TypeError, ValueError):
            return None

    def load(self, ns_id: int, key_width: int) -> tuple[np.ndarray, np.ndarray, int]:
        """All sound records of a namespace: (keys V{w}, records, count of entries skipped)."""
        keys, recs, bad = self.load_checked(ns_id, key_width)
        return keys, recs, len(bad)

    def load_checked(self, ns_id: int, key_width: int
                     ) -> tuple[np.ndarray, np.ndarray, list[tuple[bytes, str]]]:
        """(keys, records, [(key, problem)]) where problem is "malformed" (wrong sizes) or
        "binding" (a bound record whose key, namespace or fields changed since it was
        written). Records without FLAG_BOUND (written before it) are returned unchecked."""
        dt = record_dtype(key_width)
        db = self._db(ns_id)
        keys: list[bytes] = []
        vals: list[bytes] = []
        bad: list[tuple[bytes, str]] = []
        with self._reading(), self.env.begin(db=db) as txn:
            for k, v in txn.cursor():
                if len(k) != key_width or len(v) != dt.itemsize:
                    bad.append((bytes(k), "malformed"))
                    continue
                keys.append(k)
                vals.append(v)
        karr = np.frombuffer(b"".join(keys), dtype=f"V{key_width}")
        rarr = np.frombuffer(b"".join(vals), dtype=dt)
        bound = (rarr["flags"] & FLAG_BOUND) != 0
        if bound.any():
            ok = ~bound
            ok[bound] = bindings(ns_id, karr[bound], rarr[bound]) == rarr["binding"][bound]
            if not ok.all():
                bad += [(bytes(k), "binding") for k in karr[~ok]]
                karr, rarr = karr[ok], rarr[ok]
        return karr, rarr, bad

    def quarantine_records(self, ns_id: int, keys: list[bytes]) -> None:
        """Move records aside (``quarantine`` database, "ns:<id>/<key>"), never delete them."""
        db = self._db(ns_id)

        def move(txn: lmdb.Transaction) -> None:
            for k in keys:
                raw = txn.get(k, db=db)
                if raw is not None:
                    txn.put(f"ns:{ns_id}/".encode() + k, raw, db=self._quarantine_db)
                    txn.delete(k, db=db)
        self._write(move)

    def count(self, ns_id: int) -> int:
        with self._reading(), self.env.begin() as txn:
            return txn.stat(self._db(ns_id))["entries"]

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.env.close()


def _namespace_record(name: bytes, raw: bytes) -> NamespaceRecord:
    d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    layout = d.get("layout") or {}
    if not isinstance(layout, dict):
        raise TypeError("layout is not a map")
    return NamespaceRecord(name.decode(), int(d["id"]), int(d["block_bytes"]),
                           int(d["key_width"]), dict(layout))


def _private(directory: Path, files: tuple[str, ...]) -> None:
    """Mode 0700 on a directory of ours and 0600 on the named files in it: LMDB holds every
    namespace's name, layout, keys, versions and checksums, which other uids must not read
    (issue 20: data.mdb was 0644 in a 0755 directory). Directories made by an older kvtier are
    tightened at start. Best effort on a file system without modes; never follows a link."""
    try:
        os.chmod(directory, 0o700, follow_symlinks=False)
        for name in files:
            if (directory / name).exists():
                os.chmod(directory / name, 0o600, follow_symlinks=False)
    except (NotImplementedError, PermissionError):
        pass


def lock_data_dir(path: Path, who: str) -> int:
    """Own path's data until the returned fd is closed, or raise ConfigError naming the holder.

    Two owners would each think the page table and segments theirs: a second `kvtier serve`
    with another --socket used to start beside the first, and `kvtier check --repair` could
    quarantine segments a live service was writing. An flock on <data_dir>/serve.lock, which
    the kernel releases when the process ends, however it ends; the file holds the holder's
    pid and role for the message."""
    import fcntl
    lock = path / "serve.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot open {lock}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, _, role = os.pread(fd, 64, 0).decode(errors="replace").strip().partition(" ")
        os.close(fd)
        other = "another " + role if role.startswith("kvtier ") else "another process"
        raise ConfigError(f"{who}: {other} (pid {pid or 'unknown'}) is using data_dir "
                          f"{path}; stop it first, or give this one its own --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {who}\n".encode(), 0)
    return fd


def check_writable(path: Path) -> None:
    """Raise DataDirError with a clear message when path cannot be created or written."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise DataDirError(f"cannot create data_dir {path}: {exc.strerror}; choose a writable "
                           "directory with --data-dir or KVTIER_DATA_DIR") from None
    if not path.is_dir():
        raise DataDirError(f"data_dir {path} exists and is not a directory")
    # Try a real write rather than os.access(): root passes access() on a read-only mount or an
    # immutable directory, and then fails later with a less helpful error.
    _private(path, ())
    for sub in ("meta", "nvme"):
        if (path / sub).is_dir() and not (path / sub).is_symlink():
            _private(path / sub, ())
    nvme = path / "nvme"
    if nvme.is_dir() and not nvme.is_symlink():
        for d in nvme.iterdir():
            if d.is_dir() and not d.is_symlink() and d.name.startswith("ns-"):
                _private(d, ())
    probe = path / ".kvtier-write-probe"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise DataDirError(f"data_dir {path} is not writable by uid {os.getuid()} "
                           f"({exc.strerror}); fix its permissions or choose another with "
                           "--data-dir") from None
