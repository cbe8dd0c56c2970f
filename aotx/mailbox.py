"""Mapped mailboxes between the broker and the device, and their doorbells.

The region is a file in the 0700 runtime folder, mapped by both processes::

    offset 0, 64 bytes: region header
        0 u32 magic 0x424D4F41 ("AOMB")   4 u32 version (1)
        8 u32 mailbox count             12 u32 data bytes per mailbox (65536)
       16..63 reserved zero
    offset 64 + i * 65600: mailbox i
        0 u32 state (atomic; 0 broker, 1 request published, 2 reply published)
        4 u32 packet length
        8 u64 sequence (broker-assigned, for tracing)
       16..63 reserved zero
       64..65599 packet bytes

Ownership changes only through the state word, with release stores and
acquire loads: the writer fills length and bytes, then stores the new state
with release order; the reader loads the state with acquire order before
touching the bytes.  On x86-64 every aligned 32-bit load is an acquire and every
aligned 32-bit store a release (the architecture's total store order), so the
state word is read and written as a plain ``uint32`` through a memoryview: one
``mov``, about 0.1 us from Python.  Elsewhere (ARM64 and others, whose memory
model is weaker) the ``atomics`` library's C11 acquire loads and release stores
are used, at 20-30 us each from Python on the reference machine: a read crosses
six of them.

A doorbell is a named FIFO per side (``device.bell``, ``broker.bell``).  A ring
writes the mailbox index as a 2-byte little-endian number (FIFO writes below
PIPE_BUF are atomic), so the woken side looks at exactly the mailboxes that
changed and never spins or scans while idle.  ``SCAN_ALL`` asks for a full scan
(used at start-up and when a FIFO is full).  Both FIFOs are opened O_RDWR so
that opening never blocks and a missing peer never raises SIGPIPE.
"""

from __future__ import annotations

import errno
import mmap
import os
import platform
import struct

import atomics

REGION_MAGIC = 0x424D4F41
REGION_VERSION = 1
REGION_HEADER = struct.Struct("<IIII48s")
CONTROL = struct.Struct("<IIQ48s")
DATA_SIZE = 65536
MAILBOX_SIZE = 64 + DATA_SIZE
DEFAULT_MAILBOXES = 128
#: Mailboxes the broker keeps for INFO packets (the supervisor's health check, the
#: gateway's poll): no principal's calls can take them, so a device that answers is
#: seen to answer however busy its other mailboxes are (broker/server.py).
RESERVED_FOR_INFO = 1
#: The part of the mailboxes one principal's calls may hold at once (parked WAITs and
#: EMBED calls included): the gateway holds its calls to it, the device its EMBEDs.
MAILBOX_SHARE = 0.25


def mailbox_share(count: int) -> int:
    """How many of ``count`` mailboxes one principal's calls may hold at once."""
    return max(2, int(count * MAILBOX_SHARE))

FREE, REQUEST, REPLY = 0, 1, 2
SCAN_ALL = 0xFFFF
WAKE = 0xFFFE  # wake the reader without naming a mailbox (in-process producers)
_IDX = struct.Struct("<H")
RING_BATCH = 2048  # indices a write: 4096 bytes, PIPE_BUF, so a write stays atomic
#: Architectures whose plain aligned loads and stores are acquire and release.
TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class RegionError(Exception):
    pass


class Region:
    """The mapped mailbox region.  One instance per process."""

    def __init__(self, path: str, count: int = DEFAULT_MAILBOXES, plain: bool = TSO) -> None:
        """Map (creating if needed) the region of ``count`` mailboxes at ``path``.
        ``plain`` accesses the state words with plain loads and stores; only
        where the architecture makes those acquire and release (``TSO``)."""
        if not 1 <= count < SCAN_ALL:
            raise RegionError(f"mailbox count {count} out of range")
        size = 64 + count * MAILBOX_SIZE
        self.path = path
        if not os.path.exists(path):
            # Create atomically: a peer never maps a half-initialised file.
            tmp = f"{path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                os.pwrite(fd, REGION_HEADER.pack(REGION_MAGIC, REGION_VERSION, count,
                                                 DATA_SIZE, bytes(48)), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # fails if a peer won the race; then use theirs
            except FileExistsError:
                pass
            os.unlink(tmp)
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_size != size:
                raise RegionError(f"{path}: size {st.st_size}, expected {size} for {count} mailboxes")
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version, n, data = REGION_HEADER.unpack_from(self._map, 0)[:4]
        if (magic, version, n, data) != (REGION_MAGIC, REGION_VERSION, count, DATA_SIZE):
            raise RegionError(f"{path}: not a version-{REGION_VERSION} region of {count} mailboxes")
        self.count = count
        self.plain = plain
        self._view = memoryview(self._map)
        self._words = self._view.cast("I")  # native order: x86 is little-endian
        self._ctx = []
        self._states = []
        for i in range(count if not plain else 0):
            ctx = atomics.atomicview(buffer=self._view[self._off(i):self._off(i) + 4],
                                     atype=atomics.UINT)
            self._ctx.append(ctx)
            self._states.append(ctx.__enter__())

    @staticmethod
    def _off(i: int) -> int:
        return 64 + i * MAILBOX_SIZE

    def state(self, i: int) -> int:
        if self.plain:
            return self._words[(64 + i * MAILBOX_SIZE) >> 2]
        return int(self._states[i].load(atomics.MemoryOrder.ACQUIRE))

    def _store(self, i: int, state: int) -> None:
        if self.plain:
            self._words[(64 + i * MAILBOX_SIZE) >> 2] = state
        else:
            self._states[i].store(state, atomics.MemoryOrder.RELEASE)

    def publish(self, i: int, packet: bytes, state: int, sequence: int = 0) -> None:
        """Write ``packet`` into mailbox ``i`` and hand it over by storing ``state``."""
        if len(packet) > DATA_SIZE:
            raise RegionError(f"packet of {len(packet)} bytes does not fit a mailbox")
        off = self._off(i)
        self._view[off + 64:off + 64 + len(packet)] = packet
        struct.pack_into("<IQ", self._map, off + 4, len(packet), sequence)
        self._store(i, state)

    def read(self, i: int) -> bytes:
        """The packet in mailbox ``i``; call after an acquire load of its state."""
        off = self._off(i)
        (length,) = struct.unpack_from("<I", self._map, off + 4)
        length = min(length, DATA_SIZE)
        return bytes(self._view[off + 64:off + 64 + length])

    def release(self, i: int) -> None:
        """Give mailbox ``i`` back to the broker (state 0)."""
        self._store(i, FREE)

    def close(self) -> None:
        for ctx in self._ctx:
            ctx.__exit__(None, None, None)
        self._states.clear()
        self._ctx.clear()
        self._words.release()
        self._view.release()
        self._map.close()


def _open_fifo(path: str) -> int:
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:
        pass
    return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)


class Bell:
    """Two named FIFOs: ``mine`` is read here, ``theirs`` is rung by this side."""

    def __init__(self, mine: str, theirs: str) -> None:
        self.fd = _open_fifo(mine)
        self._out = _open_fifo(theirs)

    def ring(self, index: int) -> None:
        try:
            os.write(self._out, _IDX.pack(index))
        except BlockingIOError:
            # The FIFO is full: the peer is behind and will drain it; make it
            # scan everything once it does (a lost index must not lose a packet).
            try:
                os.write(self._out, _IDX.pack(SCAN_ALL))
            except BlockingIOError:
                pass

    def ring_many(self, indices: list[int]) -> None:
        """Ring for every index in ``indices``, in as few writes as PIPE_BUF allows: the
        peer wakes once and finds them all."""
        for at in range(0, len(indices), RING_BATCH):
            chunk = indices[at:at + RING_BATCH]
            try:
                os.write(self._out, struct.pack(f"<{len(chunk)}H", *chunk))
            except BlockingIOError:
                self.ring(SCAN_ALL)  # full: as ring() does
                return

    def ring_self(self, index: int = WAKE) -> None:
        """Wake this side's own reader (used by in-process producers).  ``WAKE``
        asks for no mailbox scan: the reader has in-process work to look at."""
        try:
            os.write(self.fd, _IDX.pack(index))
        except BlockingIOError:
            pass

    def drain(self) -> list[int]:
        """Every index rung since the last drain (non-blocking)."""
        chunks = []
        while True:
            try:
                b = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not b:
                break
            chunks.append(b)
            if len(b) < 65536:
                break
        data = b"".join(chunks)
        return [v for (v,) in _IDX.iter_unpack(data[:len(data) // 2 * 2])]

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._out)
