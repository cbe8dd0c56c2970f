"""Mailboxes and the broker, with real processes, real shared memory and real sockets."""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from aotx import wire
from aotx.mailbox import FREE, REPLY, REQUEST, SCAN_ALL, TSO, Bell, Region
from aotx.paths import RuntimePaths

from ..helpers import short_tmpdir


def _echo_device(run_dir: str, count: int, n_packets: int, plain: bool,
                 ready: Any) -> None:
    """A device stand-in in another process: answers each request with status 200
    (``ready`` is set once it waits on its doorbell)."""
    region = Region(os.path.join(run_dir, "mailboxes"), count, plain=plain)
    bell = Bell(os.path.join(run_dir, "device.bell"), os.path.join(run_dir, "broker.bell"))
    ready.set()
    answered = 0
    while answered < n_packets:
        select.select([bell.fd], [], [], 5)
        for i in bell.drain():
            if i != SCAN_ALL and region.state(i) == REQUEST:
                h, payload = wire.decode_packet(region.read(i))
                region.publish(i, wire.encode_packet(h.reply(200), payload[::-1]), REPLY)
                bell.ring(i)
                answered += 1
    region.close()


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


# On x86-64 the state words are plain loads and stores; the other architectures use
# the atomics library.  Both must agree on the same words, so mix them here too.
_MODES = [(TSO, TSO)] + ([(True, False), (False, True)] if TSO else [])


@pytest.mark.parametrize(("plain_here", "plain_there"), _MODES)
def test_mailboxes_between_two_processes(plain_here: bool, plain_there: bool) -> None:
    run_dir = short_tmpdir()
    try:
        count = 8
        region = Region(os.path.join(run_dir, "mailboxes"), count, plain=plain_here)
        assert region.plain is plain_here
        bell = Bell(os.path.join(run_dir, "broker.bell"), os.path.join(run_dir, "device.bell"))
        spawn = mp.get_context("spawn")
        ready = spawn.Event()
        proc = spawn.Process(target=_echo_device, args=(run_dir, count, 40, plain_there, ready))
        proc.start()
        # started (however long its imports took on a busy machine), then a moment to
        # reach its select
        assert ready.wait(120)
        time.sleep(0.2)
        # Idle means asleep on the doorbell, not spinning: no CPU over a second.
        before = _cpu_ticks(proc.pid)
        time.sleep(1.0)
        assert _cpu_ticks(proc.pid) - before <= 2
        for round_ in range(5):
            sent = {}
            for i in range(count):
                payload = os.urandom(100 + i * 1000)
                h = wire.Header(op=wire.Op.READ, tag=round_ * 100 + i)
                region.publish(i, wire.encode_packet(h, payload), REQUEST)
                bell.ring(i)
                sent[i] = payload
            got = {}
            deadline = time.monotonic() + 10
            while len(got) < count and time.monotonic() < deadline:
                select.select([bell.fd], [], [], 1)
                for i in bell.drain():
                    if region.state(i) == REPLY:
                        h, body = wire.decode_packet(region.read(i))
                        assert h.status == 200 and h.tag == round_ * 100 + i
                        got[i] = body
                        region.release(i)
            assert got == {i: p[::-1] for i, p in sent.items()}
            assert all(region.state(i) == FREE for i in range(count))
        proc.join(10)
        assert proc.exitcode == 0
        region.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


class FakeDevice:
    """The device side of the mailboxes, in a thread: holds requests until told to answer."""

    def __init__(self, paths: RuntimePaths, count: int) -> None:
        self.region = Region(paths.region, count)
        self.bell = Bell(paths.device_bell, paths.broker_bell)
        self.held: dict[int, wire.Header] = {}
        self.lock = threading.Lock()
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            select.select([self.bell.fd], [], [], 0.2)
            for i in self.bell.drain():
                idx = range(self.region.count) if i == SCAN_ALL else [i]
                for j in idx:
                    if self.region.state(j) == REQUEST:
                        h, _ = wire.decode_packet(self.region.read(j))
                        with self.lock:
                            self.held[j] = h

    def wait_held(self, n: int, timeout: float = 5) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.held) >= n:
                    return
            time.sleep(0.01)
        raise AssertionError(f"device holds {len(self.held)} requests, expected {n}")

    def answer_all(self, size: int = 0) -> None:
        with self.lock:
            held, self.held = self.held, {}
        for i, h in held.items():
            body = (b"reply-%d" % h.tag).ljust(size, b".")
            self.region.publish(i, wire.encode_packet(h.reply(200), body), REPLY)
            self.bell.ring(i)

    def answer_one(self, i: int) -> None:
        with self.lock:
            h = self.held.pop(i)
        self.region.publish(i, wire.encode_packet(h.reply(200), b"reply-%d" % h.tag), REPLY)
        self.bell.ring(i)

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.region.close()


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(path)
    return s


def _send(s: socket.socket, tag: int, op: wire.Op = wire.Op.INFO) -> None:
    """An INFO (it may take any mailbox, the reserved one too) or ``op``."""
    s.send(wire.encode_packet(wire.Header(op=op, tag=tag), b""))


def _recv(s: socket.socket) -> wire.Header:
    data, anc, flags, _ = s.recvmsg(wire.MAX_PACKET + 1, socket.CMSG_SPACE(64))
    assert anc == [] and not flags & socket.MSG_CTRUNC  # never a file descriptor
    return wire.decode_packet(data)[0]


@pytest.fixture
def broker_env():
    state = short_tmpdir()
    paths = RuntimePaths(state)
    paths.ensure()
    count = 4
    device = FakeDevice(paths, count)
    proc = subprocess.Popen([sys.executable, "-m", "aotx", "broker", "--state-dir", state,
                             "--mailboxes", str(count)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while not os.path.exists(paths.socket):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    try:
        yield paths, device, proc, count
    finally:
        proc.terminate()
        proc.wait(10)
        device.close()
        shutil.rmtree(state, ignore_errors=True)


def test_socket_is_a_named_file_in_a_private_folder(broker_env) -> None:
    paths, _device, _proc, _count = broker_env
    import stat

    assert stat.S_ISSOCK(os.stat(paths.socket).st_mode)
    assert stat.S_IMODE(os.stat(paths.run_dir).st_mode) == 0o700
    with open("/proc/net/unix") as f:
        listing = f.read()
    assert paths.socket in listing
    assert "@" + paths.socket not in listing  # not an abstract socket


def test_disconnected_mailbox_reply_never_reaches_a_new_connection(broker_env) -> None:
    paths, device, proc, count = broker_env
    old = _connect(paths.socket)
    _send(old, tag=999)
    device.wait_held(1)
    old.close()  # the gateway goes away with its request in flight
    time.sleep(0.2)

    new = _connect(paths.socket)
    # The orphaned mailbox stays unavailable until its reply arrives: only count-1 are free.
    for tag in range(1, count):
        _send(new, tag)
    device.wait_held(count)
    _send(new, tag=50)
    assert _recv(new).status == 503  # no free mailbox, answered by the broker itself

    device.answer_all()  # includes the orphan's reply (tag 999)
    tags = sorted(_recv(new).tag for _ in range(count - 1))
    assert tags == list(range(1, count))
    new.settimeout(0.5)
    with pytest.raises(TimeoutError):
        _recv(new)  # the orphan's reply was dropped, not delivered here

    # Nothing leaked: every mailbox is usable again.
    for tag in range(100, 100 + count):
        _send(new, tag)
    device.wait_held(count)
    device.answer_all()
    new.settimeout(5)
    assert sorted(_recv(new).tag for _ in range(count)) == list(range(100, 100 + count))
    new.close()


def test_a_mailbox_stays_for_info_when_the_others_are_taken(broker_env) -> None:
    """The last mailbox is INFO's: READs take the other three and the fourth READ is
    refused, but an INFO (the supervisor's health check) still reaches the device, and
    the reserved mailbox is INFO's again once answered."""
    paths, device, _proc, count = broker_env
    s = _connect(paths.socket)
    for tag in range(1, count):
        _send(s, tag, wire.Op.READ)
    device.wait_held(count - 1)
    _send(s, 50, wire.Op.READ)
    refused = _recv(s)
    assert (refused.tag, refused.status, refused.reason) == (50, 503, wire.Reason.NO_MAILBOX)
    for round_ in range(2):
        _send(s, 60 + round_)  # INFO
        device.wait_held(count)
        with device.lock:
            held = sorted(device.held)
        assert held[-1] == count - 1  # the reserved mailbox
        device.answer_one(count - 1)
        assert _recv(s).tag == 60 + round_
        _send(s, 70 + round_, wire.Op.READ)  # still refused: the reserved one is INFO's
        assert _recv(s).status == 503
    device.answer_all()
    assert sorted(_recv(s).tag for _ in range(count - 1)) == list(range(1, count))
    s.close()


def test_replies_to_a_gateway_that_does_not_read_all_arrive(broker_env) -> None:
    """Large replies to a connection that is not reading fill its socket; the broker
    queues the rest behind them and delivers every one, in one writer, once the
    gateway reads (two pending sends on one socket would lose one)."""
    paths, device, _proc, count = broker_env
    s = _connect(paths.socket)
    size = wire.MAX_PACKET - wire.HEADER_SIZE - 64
    sent = []
    for r in range(5):  # 5 x 4 replies of ~64 KiB: far more than a socket buffer holds
        for k in range(count):
            sent.append(r * count + k)
            _send(s, sent[-1])
        device.wait_held(count)
        device.answer_all(size)
        time.sleep(0.1)  # the broker meets the full socket before the next round
    got = []
    for _ in sent:
        data = s.recv(wire.MAX_PACKET + 1)
        h, body = wire.decode_packet(data)
        assert h.status == 200 and len(body) == size and body.startswith(b"reply-%d" % h.tag)
        got.append(h.tag)
    assert sorted(got) == sent
    s.close()


def test_broker_rejects_malformed_packets_with_a_status(broker_env) -> None:
    paths, _device, _proc, _count = broker_env
    s = _connect(paths.socket)
    s.send(b"\x00" * 10)
    assert _recv(s).status == 400
    good = bytearray(wire.encode_packet(wire.Header(op=wire.Op.READ, tag=7), b""))
    good[28] = 255  # not a reason code (offset 28 was reserved flags)
    s.send(bytes(good))
    h = _recv(s)
    assert h.status == 400 and h.tag == 7
    s.close()


@pytest.mark.skipif(os.getuid() != 0, reason="switching uid needs root")
def test_broker_refuses_a_peer_with_another_uid(broker_env) -> None:
    paths, _device, proc, _count = broker_env
    nobody = 65534

    def attempt() -> str:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: become another user, then try the socket
            os.close(r)
            try:
                os.setgid(nobody)
                os.setuid(nobody)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.settimeout(3)
                try:
                    s.connect(paths.socket)
                except PermissionError:
                    os.write(w, b"EACCES")
                    os._exit(0)
                try:
                    # The broker may close the connection before the send: then the
                    # send itself fails with EPIPE or ECONNRESET.
                    s.send(wire.encode_packet(wire.Header(op=wire.Op.INFO, tag=1), b""))
                    data = s.recv(wire.MAX_PACKET)
                    os.write(w, b"CLOSED" if not data else b"ANSWERED")
                except (ConnectionResetError, BrokenPipeError):
                    os.write(w, b"CLOSED")
                except TimeoutError:
                    os.write(w, b"TIMEOUT")
            except BaseException as exc:  # say what went wrong instead of nothing
                os.write(w, repr(exc).encode()[:60])
            finally:
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        out = os.read(r, 64).decode()
        os.close(r)
        return out

    # The 0700 folder keeps other users away from the socket entirely.
    assert attempt() == "EACCES"
    # Even when the file system would let them in, SO_PEERCRED refuses them.
    os.chmod(paths.state_dir, 0o755)
    os.chmod(paths.run_dir, 0o755)
    os.chmod(paths.socket, 0o777)
    try:
        assert attempt() == "CLOSED"
    finally:
        os.chmod(paths.state_dir, 0o700)
        os.chmod(paths.run_dir, 0o700)
        os.chmod(paths.socket, 0o600)
    # The broker itself is fine and still serves its own user.
    assert proc.poll() is None
    s = _connect(paths.socket)
    s.close()


def test_broker_restart_drops_orphans_and_recovers_all_mailboxes(broker_env) -> None:
    paths, device, proc, count = broker_env
    s = _connect(paths.socket)
    _send(s, 1)
    _send(s, 2)
    device.wait_held(2)
    proc.kill()  # kill -9 with two mailboxes in flight
    proc.wait()
    s.close()
    device.answer_all()  # replies arrive while no broker runs
    proc2 = subprocess.Popen([sys.executable, "-m", "aotx", "broker", "--state-dir",
                              paths.state_dir, "--mailboxes", str(count)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                s = _connect(paths.socket)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        for tag in range(10, 10 + count):
            _send(s, tag)
        device.wait_held(count)
        device.answer_all()
        assert sorted(_recv(s).tag for _ in range(count)) == list(range(10, 10 + count))
        s.close()
    finally:
        proc2.terminate()
        proc2.wait(10)


def test_ring_many_is_one_wake_up_for_every_index() -> None:
    """A pass's replies rung together reach the peer as one readable burst, every index
    in order; more than one write's worth (PIPE_BUF) still arrives whole."""
    run_dir = short_tmpdir()
    try:
        mine = Bell(os.path.join(run_dir, "a.bell"), os.path.join(run_dir, "b.bell"))
        peer = Bell(os.path.join(run_dir, "b.bell"), os.path.join(run_dir, "a.bell"))
        mine.ring_many([3, 1, 7])
        assert select.select([peer.fd], [], [], 1)[0] and peer.drain() == [3, 1, 7]
        many = list(range(5000))
        mine.ring_many(many)
        assert peer.drain() == many
        mine.ring_many([])
        assert peer.drain() == []
        mine.close()
        peer.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
