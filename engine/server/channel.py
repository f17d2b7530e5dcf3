"""The front end's end of the socketpair to the engine process: pickled messages, never blocking the event loop.

Frames are multiprocessing.connection's (a 4-byte big-endian length, or -1 and an 8-byte length past 2 GiB,
then the pickle), so the engine process reads and writes them with a plain `Connection`. Here the socket is
non-blocking: writes the kernel cannot take yet wait in a buffer behind `loop.add_writer`, and reads collect
bytes until a whole frame is there. A frozen engine (SIGSTOP, a paused container, a native call that never
returns) therefore can never stall HTTP, /health or the watchdog, whatever the size of a message half-sent.
"""
from __future__ import annotations

import pickle
import socket
import struct
from collections.abc import Callable

_SMALL = 0x7FFFFFFF
# Bytes one read takes. Read into one reused buffer: `sock.recv(1 << 20)` allocates 1 MiB per call, which cost
# ~15 us per read (measured on a socketpair, Zen 4) on the front end that shares the inference CPUs.
READ_BYTES = 1 << 18


def frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > _SMALL:
        return struct.pack("!i", -1) + struct.pack("!Q", len(data)) + data
    return struct.pack("!i", len(data)) + data


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._in = bytearray()
        self._out = bytearray()
        self._read = memoryview(bytearray(READ_BYTES))
        self._loop = None
        self._on_message: Callable = lambda msg: None
        self._on_eof: Callable[[], None] = lambda: None
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_blocking(self, obj, timeout: float = 10.0) -> None:
        """Before the event loop runs (the first message) or after it stopped (the last one)."""
        self.sock.settimeout(timeout)
        try:
            if self._out:
                self.sock.sendall(self._out)
                self._out.clear()
            self.sock.sendall(frame(obj))
        finally:
            self.sock.setblocking(self._loop is None or self._loop.is_closed())

    def attach(self, loop, on_message: Callable, on_eof: Callable[[], None]) -> None:
        """Deliver every complete message to `on_message` on the loop's thread; `on_eof` once the peer is gone."""
        self._loop, self._on_message, self._on_eof = loop, on_message, on_eof
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._readable)

    def send(self, obj) -> None:
        """Queue a message; it leaves as fast as the engine reads. Dropped once the peer is gone."""
        if self.closed:
            return
        if self._loop is None or self._loop.is_closed():
            try:
                self.send_blocking(obj)
            except OSError:
                pass
            return
        pending = bool(self._out)
        self._out += frame(obj)
        if not pending:
            self._writable()

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # the engine is gone; the reader reports it
            self._out.clear()
            self._loop.remove_writer(self.sock.fileno())
            return
        del self._out[:sent]
        if self._out:
            self._loop.add_writer(self.sock.fileno(), self._writable)
        else:
            self._loop.remove_writer(self.sock.fileno())

    def _readable(self) -> None:
        try:
            n = self.sock.recv_into(self._read)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:
            self._close()
            return
        self._in += self._read[:n]
        while True:
            msg = self._next()
            if msg is None:
                break
            self._on_message(msg)

    def _next(self):
        """One whole message from the input buffer, or None until more bytes arrive."""
        if len(self._in) < 4:
            return None
        (n,) = struct.unpack("!i", self._in[:4])
        head = 4
        if n == -1:
            if len(self._in) < 12:
                return None
            (n,) = struct.unpack("!Q", self._in[4:12])
            head = 12
        if len(self._in) < head + n:
            return None
        msg = pickle.loads(self._in[head:head + n])
        del self._in[:head + n]
        return msg

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self.sock.fileno())
        self._loop.remove_writer(self.sock.fileno())
        self._on_eof()
