"""A rank's returned value, moved once: the worker writes it, the caller maps it.

The worker pickles the value (tensors moved to the CPU first) with pickle protocol 5. A buffer of
`IN_RECORD_BYTES` or more (a large tensor's or array's bytes) is written raw to a file of its own,
and so is the pickle stream itself when it is that large (a value of many small parts); the caller
maps that file and the tensor is rebuilt over the mapped pages, never a second copy in
the caller's memory, nothing checksummed or compressed on the way (``torch.save`` spent 1.9 s on a
500 MiB tensor, most of it its zip checksum). Smaller buffers travel inside the record.

Where the bytes go: the launch's folder, in shared memory (``/dev/shm``) when it has room, else a
folder of the launch's on disk (`LaunchDir.spill`; writing 500 MiB to a disk-backed temporary
directory took 1.2-1.7 s here against 0.35-0.48 s to ``/dev/shm``). Shared memory that fills up
while the bytes are written falls back to disk too; a disk that is full as well is the rank's
error, naming both places. Every file is private to the user (`private.private_file`).

The record: a header (the bytes' files and lengths), the pickle stream, and a commit trailer the
worker writes last (a marker and the record's length). The caller takes a value only with its
trailer whole; the worker says its function returned (the ``returned`` mark) only after the
record is in place, so a rank that dies while it sends is a rank that failed, never a value of
``None``.

The caller maps each file privately (a write to the tensor copies the page: it is the caller's to
change), closes the descriptor and removes the file: a kept tensor holds no descriptor, and its
pages go when the tensor goes. Nobody else can write the file meanwhile: it was made 0600 in a
folder only the user can open, and it is gone once mapped.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import json
import mmap
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from xlaunch.worker.launch_dir import RESULT, VALUE, LaunchDir
from xlaunch.worker.private import atomic_write, write_private

IN_RECORD_BYTES = 64 * 2**10  # a buffer smaller than this travels inside the record
ROOM_TO_SPARE = 256 * 2**20  # shared memory left to others after the bytes are written
_COMMIT = b"xlaunch-value-committed"  # the trailer's marker, then the record's length (8 bytes)
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class ValueNotSent(OSError):
    """The value's bytes could not be written anywhere (every file system full)."""


def write_value(launch: LaunchDir, attempt_dir: Path, value: Any) -> None:
    """Send ``value`` back: its large buffers to files, then the record, committed last."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    pickler = _Pickler(stream, buffers)
    pickler.dump(to_cpu(value))
    views = [buffer.raw() for buffer in buffers]
    pickled = stream.getbuffer()
    stream_in_file = pickled.nbytes >= IN_RECORD_BYTES  # the stream itself, last, as a buffer
    if stream_in_file:
        views.append(pickled)
    place = Path(launch.folder)
    if views and not _room(place, sum(view.nbytes for view in views)):
        place = launch.spill(make=True) or place
    files: list[str] = []
    filled = None  # shared memory, once it filled up (or had no room) under an earlier buffer
    try:
        for index, view in enumerate(views):
            if filled is None and index and not _room(place, view.nbytes):
                # Something else took shared memory meanwhile: the rest goes to disk, and the
                # room left there stays for the records (the value's own, a failure's).
                spill = launch.spill(make=True)
                filled, place = (place, spill) if spill not in (None, place) else (None, place)
            # Named for its attempt: a rank that died while sending leaves its files until the
            # launch ends, and the next attempt's rank sends its own.
            file, now = _write_bytes(place, launch, VALUE.format(attempt_dir.name, index), view,
                                     filled)
            filled, place = (place if now != place else filled), now
            files.append(str(file))
        head = json.dumps({"files": files, "lengths": [view.nbytes for view in views],
                           "stream": stream_in_file}).encode()
        body = len(head).to_bytes(8, "little") + head + (b"" if stream_in_file else pickled)
        record = body + _COMMIT + len(body).to_bytes(8, "little")
        try:
            atomic_write(attempt_dir / RESULT, record)
        except OSError as error:
            raise _not_sent(error, memoryview(record), attempt_dir, None) from None
    except BaseException:  # the bytes are of no use now: their room goes to the rank's record
        for written in files:
            with contextlib.suppress(OSError):
                os.unlink(written)
        raise


def _room(folder: Path, size: int) -> bool:
    """Whether ``folder``'s file system has room for ``size`` bytes and some to spare (shared
    memory is memory: the rest of the machine needs some)."""
    try:
        room = os.statvfs(folder)
    except OSError:
        return False
    return room.f_bavail * room.f_frsize >= size + ROOM_TO_SPARE


def _write_bytes(place: Path, launch: LaunchDir, name: str, view: memoryview,
                 filled: Path | None) -> tuple[Path, Path]:
    """Write one buffer to a private file in ``place``; when shared memory fills up, in the
    launch's folder on disk instead. The file, and where the next buffer goes. ``filled``: the
    place that filled up under an earlier buffer (an error names it too)."""
    try:
        write_private(place / name, view)
        return place / name, place
    except OSError as full:
        spill = launch.spill(make=True) if full.errno in _FULL else None
        if spill is None or place == spill:
            raise _not_sent(full, view, place, filled) from None
    try:
        write_private(spill / name, view)
    except OSError as error:
        raise _not_sent(error, view, spill, place) from None
    return spill / name, spill


def _not_sent(error: OSError, view: memoryview, place: Path, first: Path | None) -> ValueNotSent:
    tried = f"{first} and then {place}" if first is not None else str(place)
    if error.errno in _FULL:
        why = (f"no room for its {view.nbytes} bytes: the file system of {tried} is full"
               if first is None else f"no room for its {view.nbytes} bytes: the file systems "
               f"of {tried} are full")
    else:
        why = f"writing its {view.nbytes} bytes to {tried} failed: {error.strerror or error}"
    return ValueNotSent(error.errno, f"the function returned a value, but {why}. Free space "
                        "there (or return a smaller value: save large results to a file and "
                        "return its path)")


def read_value(attempt_dir: Path | None) -> tuple[bool, Any]:
    """(True, the value local rank 0 sent back), or (False, None) when no committed record is
    there (the rank sent none, or died before its record was whole)."""
    if attempt_dir is None:
        return False, None
    try:
        record = (attempt_dir / RESULT).read_bytes()
    except OSError:
        return False, None
    trailer = len(_COMMIT) + 8
    if (len(record) < trailer or record[-trailer:-8] != _COMMIT
            or int.from_bytes(record[-8:], "little") != len(record) - trailer):
        return False, None
    length = int.from_bytes(record[:8], "little")
    head = json.loads(record[8:8 + length])
    buffers = [_mapped(Path(file), size)
               for file, size in zip(head["files"], head["lengths"], strict=True)]
    stream = buffers.pop() if head.get("stream") else memoryview(record)[8 + length:-trailer]
    return True, pickle.loads(stream, buffers=buffers)


def _mapped(file: Path, size: int) -> Any:
    """The file's bytes, mapped privately and owned by the returned buffer; the file's
    descriptor closed and the file removed (its pages stay while the buffer lives)."""
    with open(file, "rb") as opened:
        buffer = _Mapping.of(opened.fileno(), size)
    with contextlib.suppress(OSError):
        os.unlink(file)
    return buffer


class _Mapping:
    """A private mapping of a file that owns its pages and holds no descriptor: ``mmap.mmap``
    keeps a duplicate of the file's descriptor for as long as it lives (until Python 3.13's
    ``trackfd=False``), so 10,000 kept tensors would hold 10,000 descriptors. Through the C
    library's ``mmap``/``munmap`` instead; a buffer object that unmaps when the last view of it
    (a tensor's storage, an array) is gone."""

    @staticmethod
    def of(fd: int, size: int) -> Any:
        if size == 0:
            return bytearray()
        c_library = _libc()
        if c_library is None:  # no C library to map with: a copy (the bytes are read once)
            with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mapped:
                return bytearray(mapped)
        address = c_library.mmap(None, ctypes.c_size_t(size), mmap.PROT_READ | mmap.PROT_WRITE,
                                 mmap.MAP_PRIVATE, fd, ctypes.c_long(0))
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mapping a returned value's bytes failed: "
                          f"{os.strerror(ctypes.get_errno())}")

        class Pages(ctypes.c_char * size):  # type: ignore[misc,valid-type]
            def __del__(self) -> None:
                c_library.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))

        return memoryview(Pages.from_address(address)).cast("B")


_LIBC: list[Any] = []


def _libc() -> Any:
    """The C library's mmap and munmap, typed; None where there is none to load."""
    if not _LIBC:
        try:
            c_library = ctypes.CDLL(None, use_errno=True)
            c_library.mmap.restype = ctypes.c_void_p
            c_library.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_int, ctypes.c_long)
            c_library.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        except (OSError, AttributeError):
            c_library = None
        _LIBC.append(c_library)
    return _LIBC[0]


class _Pickler(pickle.Pickler):
    """Pickle protocol 5, each dense CPU tensor's bytes handed out as a buffer, not copied in;
    a buffer below `IN_RECORD_BYTES` stays in the pickle stream."""

    def __init__(self, stream: io.BytesIO, buffers: list[pickle.PickleBuffer]) -> None:
        def out_of_band(buffer: pickle.PickleBuffer) -> bool:  # False: it goes to a file
            if buffer.raw().nbytes < IN_RECORD_BYTES:
                return True
            buffers.append(buffer)
            return False

        super().__init__(stream, protocol=5, buffer_callback=out_of_band)
        self.kept: list[Any] = []  # the tensors the buffers point into, alive until written

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if (torch is None or type(obj) is not torch.Tensor or obj.layout != torch.strided
                or obj.is_quantized or obj.device.type != "cpu"):
            return NotImplemented
        dense = obj.detach().contiguous()
        raw = (ctypes.c_char * (dense.numel() * dense.element_size())).from_address(
            dense.data_ptr()) if dense.numel() else bytearray()
        self.kept.append(dense)
        return _tensor, (pickle.PickleBuffer(memoryview(raw)), str(dense.dtype).split(".")[-1],
                         tuple(dense.shape))


def _tensor(data: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    kind = getattr(torch, dtype)
    if len(data) == 0:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(data, dtype=torch.uint8).view(kind).reshape(shape)


def to_cpu(value: Any) -> Any:
    """Move tensors in a returned structure to the CPU so the caller can load them."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((key, to_cpu(item)) for key, item in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_cpu(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value
