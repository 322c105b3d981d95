"""``ShmTensorStore``: a :class:`~torch_dtorch.collectives.store.TensorStore` for processes on one host.

One session is one directory, ``<base>/<prefix>-<owner pid>-<random>``, created mode ``0700`` under ``/dev/shm``
(memory-backed; falls back to the temp directory where ``/dev/shm`` is missing or not writable). Every value is one
file named by :meth:`TensorStore.key_str`: a small header (magic, format version, dtype name, shape, padded to 64 bytes)
followed by the raw bytes of the contiguous tensor — never pickle. Values of at least 64 KiB are read by mapping the
file (private, copy-on-write): the returned tensor uses the file's memory pages without copying them, and writes to
it never reach the stored value. Writers publish atomically: they write a private temp file and
hard-link it to the final name (which fails if the key already holds a value), so a reader never sees half a file.
:meth:`~ShmTensorStore.get` and :meth:`~ShmTensorStore.pop` poll with a short exponential backoff (50 µs to 5 ms);
``pop`` claims the file by renaming it first, so exactly one process gets each value, and unlinks it.

CUDA tensors are copied to the CPU on ``put`` and come back as CPU tensors (cluster mode sends CUDA tensors between
processes of one host as CUDA IPC handles instead: :mod:`torch_dtorch.cluster.ipc`; this store is their
fallback); conjugate/negative views are resolved, so values round-trip bit for bit. Exceptions (a worker's sticky
error answering a fetch) are stored as ``{type, message}`` JSON and come back as :class:`RemoteError`.

The store that created the directory owns it: its :meth:`~ShmTensorStore.close` removes the directory (idempotent);
stores attached to an existing directory (``ShmTensorStore(path)``) only stop using it. :func:`cleanup_stale` removes
directories whose owner process is gone (a crashed controller).
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import secrets
import shutil
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path

import torch

from torch_dtorch._proc import pid_alive
from torch_dtorch.collectives.errors import TensorStoreError, TensorStoreTimeout
from torch_dtorch.collectives.store import StoreKey, TensorStore, _check_key

__all__ = ["DEFAULT_PREFIX", "RemoteError", "ShmTensorStore", "cleanup_stale"]

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "dtorch-store"
_MAGIC = b"DTSH"
_VERSION = 2
_ALIGN = 64  # the data starts at a multiple of this (any dtype can be viewed in place)
_MMAP_MIN_BYTES = 64 << 10  # smaller values are read into a fresh tensor
_KIND_TENSOR, _KIND_ERROR = 0, 1
# magic, version, kind, dtype-name length, ndim
_HEAD = struct.Struct("<4sHHHH")
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_MIN_POLL_S, _MAX_POLL_S = 50e-6, 5e-3


class RemoteError(TensorStoreError):
    """An exception another process stored as a value: ``type_name`` (qualified) and its message."""

    def __init__(self, type_name: str, message: str) -> None:
        self.type_name = type_name
        self.message = message
        super().__init__(f"{type_name}: {message}")


def _default_base() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def _encode(value: object) -> list[bytes | memoryview]:
    if isinstance(value, BaseException):
        cls = type(value)
        body = json.dumps({"type": f"{cls.__module__}.{cls.__qualname__}", "message": str(value)}).encode()
        return [_HEAD.pack(_MAGIC, _VERSION, _KIND_ERROR, 0, 0), body]
    if not isinstance(value, torch.Tensor):
        raise TensorStoreError(
            f"ShmTensorStore.put: values are tensors (or exceptions), got {type(value).__qualname__}"
        )
    if value.layout != torch.strided:
        raise TensorStoreError(f"ShmTensorStore.put: only strided tensors can be stored, got {value.layout}")
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # documented: the file store carries CPU bytes
    t = t.resolve_conj().resolve_neg().contiguous()
    name = str(t.dtype).removeprefix("torch.").encode()
    head = _HEAD.pack(_MAGIC, _VERSION, _KIND_TENSOR, len(name), t.ndim) + name
    head += struct.pack(f"<{t.ndim}q", *t.shape)
    head += b"\0" * (-len(head) % _ALIGN)
    if t.numel() == 0:
        return [head]
    return [head, t.reshape(-1).view(torch.uint8).numpy().data]


def _read(path: Path) -> torch.Tensor | RemoteError:
    with open(path, "rb") as f:
        fixed = f.read(_HEAD.size)
        if len(fixed) != _HEAD.size:
            raise TensorStoreError(f"ShmTensorStore: {path.name} is truncated ({len(fixed)} header bytes)")
        magic, version, kind, name_len, ndim = _HEAD.unpack(fixed)
        if magic != _MAGIC or version != _VERSION:
            raise TensorStoreError(
                f"ShmTensorStore: {path.name} is not a store value of format {_VERSION} "
                f"(magic {magic!r}, version {version})"
            )
        if kind == _KIND_ERROR:
            record = json.loads(f.read())
            return RemoteError(str(record.get("type")), str(record.get("message")))
        dtype = _DTYPES.get(f.read(name_len).decode())
        if dtype is None:
            raise TensorStoreError(f"ShmTensorStore: {path.name} names an unknown dtype")
        shape = struct.unpack(f"<{ndim}q", f.read(8 * ndim))
        offset = _HEAD.size + name_len + 8 * ndim
        offset += -offset % _ALIGN
        nbytes = math.prod(shape) * dtype.itemsize
        size = os.fstat(f.fileno()).st_size
        if size != offset + nbytes:
            raise TensorStoreError(
                f"ShmTensorStore: {path.name} holds {size - offset} of {nbytes} data bytes"
            )
        if nbytes >= _MMAP_MIN_BYTES:
            mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            # the tensor keeps the mapping alive; the file may be unlinked at once (pop)
            return torch.frombuffer(mm, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
        out = torch.empty(shape, dtype=dtype, device="cpu")
        if nbytes:
            f.seek(offset)
            buf = out.reshape(-1).view(torch.uint8).numpy().data  # a writable memoryview of out's bytes
            got = f.readinto(buf)
            if got != buf.nbytes:
                raise TensorStoreError(f"ShmTensorStore: {path.name} holds {got} of {buf.nbytes} data bytes")
        return out


class ShmTensorStore(TensorStore):
    """File / shared-memory tensor store shared by the processes of one host.

    Args:
        path: an existing session directory to attach to (e.g. the controller's ``store.path`` passed to a worker);
            ``None`` creates a new one (this store then owns it).
        base: where a new session directory goes (default ``/dev/shm``, else the temp directory).
        prefix: name prefix of new session directories (and of :func:`cleanup_stale`).
        timeout_s: default wait of ``get``/``pop`` (see :class:`TensorStore`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        base: str | os.PathLike[str] | None = None,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(timeout_s=timeout_s)
        if path is None:
            root = Path(base) if base is not None else _default_base()
            self.path = root / f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
            os.mkdir(self.path, 0o700)
            self.owner = True
        else:
            self.path = Path(path)
            st = os.stat(self.path)  # raises FileNotFoundError naming the path
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                raise TensorStoreError(
                    f"ShmTensorStore: {self.path} is not a directory owned by this user; pass the path of a "
                    "store created by ShmTensorStore() in a process of the same user"
                )
            self.owner = False
        self._closed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("owner" if self.owner else "attached")
        return f"ShmTensorStore({str(self.path)!r}, {state})"

    def _file(self, key: StoreKey) -> Path:
        return self.path / self.key_str(key)

    def _check_open(self) -> None:
        if self._closed:
            raise TensorStoreError(f"{self!r}: the store is closed (shut down)")
        if not self.path.is_dir():
            raise TensorStoreError(f"{self!r}: the store directory is gone (its owner closed it)")

    def __contains__(self, key: object) -> bool:
        try:
            return self._file(_check_key(key)).exists()
        except TensorStoreError:
            return False

    def put(self, key: StoreKey, tensor: torch.Tensor) -> None:
        final = self._file(_check_key(key))
        self._check_open()
        parts = _encode(tensor)
        tmp = self.path / f".tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p)
            try:
                os.link(tmp, final)  # atomic, and refuses to replace an existing value
            except FileExistsError:
                raise TensorStoreError(
                    f"{self!r}: key {key!r} already holds a value; pop or delete it first"
                ) from None
        except FileNotFoundError as e:
            raise TensorStoreError(f"{self!r}: put({key!r}) failed, the store directory is gone") from e
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def get(self, key: StoreKey, timeout: float | None = None) -> torch.Tensor:
        return self._take(key, timeout, remove=False)

    def pop(self, key: StoreKey, timeout: float | None = None) -> torch.Tensor:
        return self._take(key, timeout, remove=True)

    def delete(self, key: StoreKey) -> bool:
        try:
            os.unlink(self._file(_check_key(key)))
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """Stop using the store; the owner also removes the directory and every value in it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.owner:
            shutil.rmtree(self.path, ignore_errors=True)
            log.debug("ShmTensorStore: removed %s", self.path)

    def _take(self, key: StoreKey, timeout: float | None, *, remove: bool) -> torch.Tensor:
        final = self._file(_check_key(key))
        wait = self.timeout_s if timeout is None else max(0.0, float(timeout))
        deadline = time.monotonic() + wait
        delay = _MIN_POLL_S
        while True:
            self._check_open()
            value = self._try_take(final, remove)
            if value is not None:
                return value  # type: ignore[return-value]  # a RemoteError is delivered as the value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TensorStoreTimeout(f"{self!r}: no value under {key!r} after {wait:g} s")
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_POLL_S)

    def _try_take(self, final: Path, remove: bool) -> torch.Tensor | RemoteError | None:
        path = final
        if remove:
            path = final.with_name(f".pop-{os.getpid()}-{threading.get_ident()}-{final.name}")
            try:
                os.rename(final, path)  # claims the value: exactly one popper wins
            except FileNotFoundError:
                return None
        try:
            return _read(path)
        except FileNotFoundError:
            return None
        finally:
            if remove:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def cleanup_stale(prefix: str = DEFAULT_PREFIX, *, base: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this user's session directories ``<base>/<prefix>-<pid>-*`` whose owner process no longer runs;
    returns the removed paths. Safe to call at start-up of every controller."""
    root = Path(base) if base is not None else _default_base()
    removed: list[Path] = []
    uid = os.getuid()
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix + "-"):
            continue
        pid_text, _, token = entry.name[len(prefix) + 1 :].partition("-")
        if not pid_text.isdigit() or not token:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or pid_alive(int(pid_text)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
        log.info("cleanup_stale: removed %s (owner pid %s is gone)", entry.path, pid_text)
    return removed
