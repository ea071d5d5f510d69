"""A column array that lies in a memory-mapped file, as the dataset reads it.

Reading a mapped file past its end kills the process (SIGBUS) instead of raising, and a path can come to
hold another file. So a file-backed column is read through a mapping of its own, opened once from the
file it was given: the file it maps is identified (device, inode, size, mtime), its size is read from
that mapping's descriptor and never from the path, and a process that maps it again by path (a spawned
worker, an unpickled copy) refuses when the path holds another file. A path deleted or renamed under
an intact mapping goes on working, as the mapping itself does.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import errno
import fcntl
import mmap
import os
import struct
from typing import Any

import numpy as np

from .._ext import _C
from .arrow_layout import layout_digest

__all__ = [
    "FileIdentity", "MappedFile", "MappedFileError", "WatchedFile", "is_read_fault", "read_fault_error",
]


class MappedFileError(RuntimeError):
    """A memory-mapped column's file no longer holds what the column was made from: it shrank, or its
    path now names another file. Raised before any byte of the batch is handed out."""


def is_read_fault(error: BaseException) -> bool:
    """Whether ``error`` is a guarded copy's read past the end of a mapped file (raised by the C++ copies
    instead of SIGBUS)."""
    return isinstance(error, RuntimeError) and _C.MAPPED_READ_FAULT in str(error)


def read_fault_error(error: RuntimeError) -> MappedFileError:
    """The error for a read fault in a batch of samples that fastcollate did not make (a list of tensors,
    some over a mapped file): the file cannot be named, only what happened and what to do."""
    return MappedFileError(
        f"{error}; nothing of the batch was handed out. A tensor of the batch lies in a memory-mapped file "
        "that shrank: keep the file as it is while it is mapped, or give fastcollate.Arrays the np.memmap, "
        "which checks its file before every read and names the column"
    )


@dataclasses.dataclass(frozen=True)
class FileIdentity:
    """What tells one file from another: a path can be given a new file with the same name and size."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    generation: int | None = None  # ext4, xfs, btrfs: a reused inode number gets another
    # An Arrow file's message headers (fastcollate.data.arrow_layout): where its record batches and
    # buffers lie.
    layout: bytes | None = None

    @classmethod
    def of(cls, descriptor: int) -> FileIdentity:
        status = os.fstat(descriptor)
        try:
            generation = struct.unpack("<I", fcntl.ioctl(descriptor, _FS_IOC_GETVERSION, bytes(8))[:4])[0]
        except OSError:  # not kept by this file system (tmpfs): the modification time stands in for it
            generation = None
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, generation)

    def same_file(self, other: FileIdentity) -> bool:
        """The same file, though it may have been written since: the same inode, and the same generation
        of that inode number (where the file system keeps one; else the same modification time)."""
        if (self.device, self.inode) != (other.device, other.inode):
            return False
        if self.generation is not None and other.generation is not None:
            return self.generation == other.generation
        return self.mtime_ns == other.mtime_ns

    def __str__(self) -> str:
        modified = datetime.datetime.fromtimestamp(self.mtime_ns / 1e9, datetime.timezone.utc)
        when = f"{modified:%Y-%m-%d %H:%M:%S}.{self.mtime_ns % 10**9:09d} UTC"
        return f"inode {self.inode} on device {self.device}, {self.size} bytes, modified {when}"


class MappedFile:
    """One array in a file, read through a mapping this object owns.

    ``of(array)`` recognises an ``np.memmap`` and any numpy view of one (a slice, ``np.asarray(memmap)``)
    and maps the same bytes again; ``array`` is the new view, the one a column reads. Pickled, it is the
    file's path, position and identity (a few hundred bytes): unpickling maps the path again, or records
    why it cannot, for :meth:`check` to raise.
    """

    def __init__(
        self, path: str, offset: int, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...],
        identity: FileIdentity | None = None, writable: bool = False, mapped_at: int | None = None,
    ) -> None:
        self.path, self.offset, self.dtype = path, offset, dtype
        self.shape, self.strides, self.writable = shape, strides, writable
        self.identity = identity
        self.array: np.ndarray | None = None
        self._mapping: mmap.mmap | None = None
        self._refusal: str | None = None  # why this process cannot read the file (see check)
        self.path_stale = False  # the path named another file already when the column was made
        self._map(mapped_at)

    @classmethod
    def of(cls, array: Any) -> MappedFile | None:
        """The file under ``array``, mapped again, if ``array`` is a view of an ``np.memmap`` with no
        negative stride. A copy-on-write memmap (``mode="c"``) is the process's own memory once written,
        so it is read as memory. A torch tensor over a mapping (``torch.from_numpy(memmap)``,
        ``torch.from_file``) is not recognised: pass the ``np.memmap``."""
        memmap = array
        while isinstance(memmap, np.ndarray) and not isinstance(memmap, np.memmap):
            memmap = memmap.base
        mapping = getattr(memmap, "_mmap", None)  # np.memmap keeps its mmap object, slices included
        if not isinstance(memmap, np.memmap) or memmap.filename is None or mapping is None:
            return None
        if memmap.mode == "c" or any(stride < 0 for stride in array.strides):
            return None
        # np.memmap maps from its offset rounded down to the allocation granularity.
        start = memmap.offset - memmap.offset % mmap.ALLOCATIONGRANULARITY
        mapped_at = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
        return cls(
            os.fspath(memmap.filename),
            start + array.ctypes.data - mapped_at,
            array.dtype.str,
            tuple(array.shape),
            tuple(array.strides),
            writable=memmap.mode in ("r+", "w+"),
            mapped_at=mapped_at,
        )

    @property
    def span(self) -> int:
        """Bytes from the first element to the end of the last one."""
        if 0 in self.shape:
            return 0
        last = sum((n - 1) * stride for n, stride in zip(self.shape, self.strides, strict=True))
        return last + np.dtype(self.dtype).itemsize

    @property
    def needed(self) -> int:
        """The file size the array needs: its end's position in the file."""
        return self.offset + self.span

    def _map(self, mapped_at: int | None) -> None:
        """Maps the file: the one mapped at ``mapped_at`` (the user's memmap, when the column is made),
        or the one at the path, which must be the file the column was made from (in another process)."""
        dtype = np.dtype(self.dtype)
        if self.span == 0:
            self.array = np.empty(self.shape, dtype=dtype)
            return
        try:
            region = _region_at(mapped_at) if mapped_at is not None else None
            descriptor = _open(self.path, os.O_RDWR if self.writable else os.O_RDONLY, region)
        except OSError as error:
            self._refusal = self._cannot_open(error)
            return
        try:
            found = FileIdentity.of(descriptor)
            if self.identity is None:
                self.path_stale = _names_another_file(self.path, found)
            elif not self.identity.same_file(found):
                self._refusal = self._not_the_file(found)
                return
            if found.size < self.needed:
                self._refusal = self._shrank(found.size)
                return
            start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
            access = mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ
            try:
                # mmap keeps a duplicate of the descriptor: check() reads the file's size through it.
                self._mapping = mmap.mmap(descriptor, self.needed - start, access=access, offset=start)
            except OSError as error:
                hint = _LIMIT_HINTS.get(error.errno, "")
                self._refusal = f"its file {self.path} cannot be mapped ({error.strerror}){hint}"
                return
        finally:
            os.close(descriptor)
        self.identity = self.identity or found
        self.array = np.ndarray(
            self.shape, dtype, buffer=self._mapping, offset=self.offset - start, strides=self.strides
        )

    def _cannot_open(self, error: OSError) -> str:
        if isinstance(error, _Replaced):
            return (
                f"its path {self.path} names another file than the np.memmap maps (it was replaced after the "
                "memmap was made): make the memmap again, then the dataset"
            )
        if error.errno != errno.ENOENT:
            hint = _LIMIT_HINTS.get(error.errno, "")
            return f"its file {self.path} cannot be opened ({error.strerror}){hint}"
        if self.identity is None:  # the column is being made from a memmap whose file is gone
            return (
                f"its file {self.path} is no longer at its path (deleted or renamed after the np.memmap was "
                "made), and this process may not open the mapping itself (/proc/self/map_files needs "
                "CAP_CHECKPOINT_RESTORE): keep the file in place until the dataset is made"
            )
        if self.path_stale:
            return self._not_the_file(self.identity)
        return (
            f"its file {self.path} was deleted or renamed after the dataset was made, and this process (a "
            "spawned or forkserver worker, or an unpickled copy) maps files by path: keep the file in place "
            "while the dataset is used, or start workers by fork"
        )

    def _not_the_file(self, found: FileIdentity) -> str:
        if self.path_stale:
            return (
                f"its path {self.path} named another file, or none, already when the dataset was made (the "
                "np.memmap had been made before the path was replaced or deleted), and this process (a "
                "spawned or forkserver worker, or an unpickled copy) maps files by path: make the np.memmap "
                "again from the path, then the dataset"
            )
        return (
            f"its path {self.path} now holds another file than the one the dataset was made from (then "
            f"{self.identity}; now {found}), and this process (a spawned or forkserver worker, or an "
            "unpickled copy) maps files by path: make the dataset again after replacing the file, or start "
            "workers by fork"
        )

    def _shrank(self, size: int) -> str:
        return (
            f"its file {self.path} shrank to {size} bytes, but the column needs {self.needed}: it was "
            "truncated or rewritten in place while mapped (reading past its end would kill the process); "
            "make the np.memmap again with the file's new shape, then the dataset"
        )

    def unreadable(self) -> str | None:
        """Why the array cannot be read now, or None: the file shrank under the mapping, or this process
        could not map the file the dataset was made from. The size comes from the mapping's descriptor."""
        if self._refusal is not None:
            return self._refusal
        if self._mapping is not None:
            size = self._mapping.size()
            if size < self.needed:
                return self._shrank(size)
        return None

    def check(self, column: str) -> None:
        """Raises MappedFileError, naming ``column``, if the array cannot be read now (see unreadable)."""
        why = self.unreadable()
        if why is not None:
            raise MappedFileError(f"Arrays: column {column!r}: {why}")

    def __deepcopy__(self, memo: dict) -> MappedFile:
        return self  # a copy in this process reads the same mapping (nothing here is changed after made)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(array=None, _mapping=None, _refusal=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._map(None)


_FS_IOC_GETVERSION = 0x80087601  # _IOR('v', 1, long)

_LIMIT_HINTS = {
    errno.EMFILE: ": each memmap column holds one descriptor; raise the limit on open files (ulimit -n)",
    errno.ENFILE: ": the system's table of open files is full",
    errno.ENOMEM: ": the address space is exhausted (a memmap column maps its file once more; RLIMIT_AS?)",
}


class _Replaced(OSError):
    """The path names another file than the mapping the column is made from."""


def _open(path: str, flags: int, region: tuple[int, int, int, int, str] | None) -> int:
    """A descriptor of the file of the mapping ``region`` (see _region_at) when there is one, else of the
    file at ``path``. The mapping's own file comes from /proc/self/map_files (it may be deleted or replaced
    since it was mapped); where that is not allowed (it needs CAP_CHECKPOINT_RESTORE), the path's file,
    refused (_Replaced) if the mapping holds another inode of the same device."""
    if region is not None:
        try:
            return os.open(f"/proc/self/map_files/{region[0]:x}-{region[1]:x}", flags)
        except OSError:
            pass
    descriptor = os.open(path, flags)
    if region is not None:
        status = os.fstat(descriptor)
        if status.st_dev == region[2]:
            replaced = status.st_ino != region[3]
        else:  # a union file system (overlayfs) may show the lower file's device: compare the paths then
            replaced = region[4] != os.path.realpath(path)
        if replaced:
            os.close(descriptor)
            raise _Replaced(errno.ESTALE, "replaced")
    return descriptor


def _names_another_file(path: str, mapped: FileIdentity) -> bool:
    """Whether ``path`` no longer names the file just opened from the mapping (same device only: a union
    file system may show other devices for one file)."""
    try:
        status = os.stat(path)
    except OSError:
        return True
    return status.st_dev == mapped.device and status.st_ino != mapped.inode


def _region_at(address: int) -> tuple[int, int, int, int, str] | None:
    """(start, end, device, inode, path) of the file mapping that holds ``address``, from /proc/self/maps;
    None where there is no such file (not Linux). A deleted file's path ends in " (deleted)"."""
    regions = _file_regions()
    at = bisect.bisect_right([region[0] for region in regions], address) - 1
    return regions[at] if at >= 0 and address < regions[at][1] else None


class WatchedFile:
    """A file another library mapped (pyarrow maps Arrow files, and Hugging Face datasets through it),
    whose bytes a column reads through that mapping. No descriptor is kept (a dataset may span thousands
    of files): each check stats the mapping's own file through /proc/self/map_files, or, where that is
    not permitted, the path while it still names that file. A file that shrank, or whose size changed (its
    offsets, read when the column was made, would no longer fit its values), is named before a read; a
    read that faults anyway is named after it.

    Content decides, not timestamps: a file whose modification time changed but whose size did not (a
    ``touch``, as scratch file systems' purges make users do) has its Arrow message headers read again
    (fastcollate.data.arrow_layout) and is read on if its record batches and buffers are where they were, as
    pyarrow reads on; its new time is then remembered. Another layout is refused, naming the file.

    ``of(addresses)`` finds the files mapped at those addresses (one ``/proc/self/maps`` read), one object
    a file. ``expect(identities)`` refuses, on every check, a file that is none of the files
    ``identities`` describe (a process that opened a dataset's files again by path, which now name
    others, or hold other layouts).
    """

    def __init__(self, region: tuple[int, int, int, int, str]) -> None:
        start, end, _, _, path = region
        self.path = path.removesuffix(" (deleted)")
        self._mapping = f"/proc/self/map_files/{start:x}-{end:x}"
        self._refusal: str | None = None
        status = self._stat()
        if status is None:
            raise FileNotFoundError(self.path)
        found = FileIdentity(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)
        # Read now, when the dataset is made, for a touched file to be compared with: a file's headers
        # are a few hundred bytes a record batch (1,000 files of one record batch each: about 20 ms). The
        # other way, the layout derived from the table's buffer addresses, would cost nothing here, but a
        # spawned worker, whose table is read from the file as it is now, would have nothing to compare.
        self.identity = dataclasses.replace(found, layout=self._layout(found))

    @classmethod
    def of(cls, addresses: list[int]) -> dict[int, WatchedFile]:
        """The file mapped at each of ``addresses`` that lies in a file mapping, by address."""
        regions = _file_regions()
        starts = [region[0] for region in regions]
        found: dict[tuple[int, int], WatchedFile] = {}
        watched: dict[int, WatchedFile] = {}
        for address in addresses:
            at = bisect.bisect_right(starts, address) - 1
            if at < 0 or address >= regions[at][1]:
                continue
            device, inode = regions[at][2:4]
            if (device, inode) not in found:
                try:
                    found[device, inode] = cls(regions[at])
                except OSError:
                    continue  # neither its mapping nor its path can be read: reads are still guarded
            watched[address] = found[device, inode]
        return watched

    def _stat(self) -> os.stat_result | None:
        """The mapped file's status; None when neither its mapping nor its path shows that file."""
        try:
            return os.stat(self._mapping)
        except OSError:
            pass
        try:
            status = os.stat(self.path)
        except OSError:
            return None
        known = getattr(self, "identity", None)
        if known is not None and (status.st_dev, status.st_ino) != (known.device, known.inode):
            return None  # the path names another file now; the mapping still reads the one it mapped
        return status

    def _layout(self, identity: FileIdentity) -> bytes | None:
        """The file's layout (arrow_layout.layout_digest) as it is now; None when it is no Arrow file, or
        cannot be opened: the mapping's own file, else the path while it names ``identity``'s inode."""
        for where in (self._mapping, self.path):
            try:
                descriptor = os.open(where, os.O_RDONLY)
            except OSError:
                continue
            try:
                status = os.fstat(descriptor)
                if (status.st_dev, status.st_ino) == (identity.device, identity.inode):
                    return layout_digest(descriptor, status.st_size)
            finally:
                os.close(descriptor)
        return None

    def expect(self, identities: list[FileIdentity]) -> None:
        mine = self.identity
        same = [i for i in identities if (i.device, i.inode, i.size) == (mine.device, mine.inode, mine.size)]
        # The same layout where both are known (a touched file is read on), else the same time.
        if any(i.layout == mine.layout if None not in (i.layout, mine.layout) else i.mtime_ns == mine.mtime_ns
               for i in same):
            return
        if same:
            self._refusal = self._relaid(same[0], mine)
            return
        self._refusal = (
            f"its file {self.path} ({mine}) is not one the dataset was made from, as it was "
            "then: it was replaced or written since, and this process (a spawned or forkserver worker, "
            "or an unpickled copy) opened it again by path. Make the dataset again after changing its "
            "files, or start workers by fork"
        )

    def _relaid(self, then: FileIdentity, now: FileIdentity) -> str:
        if then.layout is None or now.layout is None:
            why = "no Arrow message headers could be read to compare its layout with then"
        else:
            why = "its Arrow message headers differ from then"
        return (
            f"its file {self.path} was written since the dataset was made (then {then}; now {now}), and "
            f"{why}: its record batches and buffers may no longer be where the dataset found them. Keep a "
            "dataset's files as they are while it is read (touching them is fine), or load it again"
        )

    def unreadable(self) -> str | None:
        if self._refusal is not None:
            return self._refusal
        status = self._stat()
        if status is None:
            return None
        known = self.identity
        if (status.st_size, status.st_mtime_ns) == (known.size, known.mtime_ns):
            return None
        now = FileIdentity(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)
        if status.st_size < known.size:
            return (
                f"its file {self.path} shrank to {status.st_size} bytes from {known.size}: it was "
                "truncated or rewritten in place while mapped (reading past its end would kill the "
                "process). Keep a dataset's files as they are while it is read, or load the dataset again"
            )
        if status.st_size != known.size:
            return (
                f"its file {self.path} was written since the dataset was made (then {known}; now {now}): "
                "its rows may no longer be where the dataset found them. Keep a dataset's files as they "
                "are while it is read, or load the dataset again"
            )
        layout = self._layout(now) if known.layout is not None else None
        if layout is not None and layout == known.layout:
            self.identity = dataclasses.replace(known, mtime_ns=now.mtime_ns)  # touched: not read again
            return None
        # Refused for good: its rows moved, and its headers are not read again on every batch.
        self._refusal = self._relaid(known, dataclasses.replace(now, layout=layout))
        return self._refusal

    def check(self, column: str) -> None:
        why = self.unreadable()
        if why is not None:
            raise MappedFileError(f"Arrays: column {column!r}: {why}")


def _file_regions() -> list[tuple[int, int, int, int, str]]:
    """(start, end, device, inode, path) of every file mapping of this process, by start."""
    regions = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or int(fields[4]) == 0 or not fields[5].startswith("/"):
                    continue
                start, _, end = fields[0].partition("-")
                major, _, minor = fields[3].partition(":")
                device = os.makedev(int(major, 16), int(minor, 16))
                regions.append((int(start, 16), int(end, 16), device, int(fields[4]), fields[5].rstrip("\n")))
    except OSError:
        return []
    return sorted(regions)
