"""The host end of the exec server's pipe: an attached container socket, demultiplexed and framed.

Docker sends a non-TTY container's output in frames of 8-byte headers (stream 1 stdout, 2 stderr,
then a big-endian length). The server's answers arrive on stdout; its stderr is kept (bounded) to
explain a crash. Requests go the other way as plain bytes on stdin. See `sandbox/server.py`.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterable

RECV = 1 << 20
DIAG_MAX = 8192


class ChannelClosed(Exception):
    """The server's end is gone (container stopped, crashed, or the socket timed out)."""


class Channel:
    """Framed requests and answers over an attached container socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._raw = bytearray()  # undemultiplexed bytes from the socket
        self._out = bytearray()  # the server's stdout, demultiplexed
        self._diag = bytearray()  # the server's stderr, last DIAG_MAX bytes

    @property
    def diagnostics(self) -> str:
        """The tail of what the server wrote to stderr (a traceback when it crashed)."""
        return self._diag.decode(errors="replace").strip()

    def send(self, header: dict, chunks: Iterable[bytes] | None = None) -> None:
        """One request: a JSON frame, then (when `chunks` is given) data frames and an empty frame."""
        body = json.dumps(header).encode()
        try:
            self._sock.sendall(struct.pack(">I", len(body)) + body)
            if chunks is not None:
                for chunk in chunks:
                    if chunk:
                        self._sock.sendall(struct.pack(">I", len(chunk)) + chunk)
                self._sock.sendall(struct.pack(">I", 0))
        except OSError as e:
            raise ChannelClosed(f"cannot write to the sandbox: {e}") from None

    def receive(self, timeout: float | None) -> tuple[dict, bytes | None]:
        """One answer: its JSON header and, when it has one, its data frame."""
        self._sock.settimeout(timeout)
        header = json.loads(self._frame())
        data = self._frame() if header.get("data") else None
        return header, data

    def close(self) -> None:
        """Close the socket; the server sees end of input and exits, which stops the container."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _frame(self) -> bytes:
        (n,) = struct.unpack(">I", self._take(4))
        return self._take(n)

    def _take(self, n: int) -> bytes:
        while len(self._out) < n:
            self._pump()
        data = bytes(self._out[:n])
        del self._out[:n]
        return data

    def _pump(self) -> None:
        """Read from the socket once and move complete Docker frames to stdout / stderr buffers."""
        try:
            chunk = self._sock.recv(RECV)
        except socket.timeout:
            raise ChannelClosed("the sandbox stopped answering (timed out)") from None
        except OSError as e:
            raise ChannelClosed(f"cannot read from the sandbox: {e}") from None
        if not chunk:
            raise ChannelClosed("the sandbox closed its output (the container stopped)")
        self._raw += chunk
        raw = self._raw
        pos = 0
        while len(raw) - pos >= 8:
            stream, size = raw[pos], struct.unpack_from(">I", raw, pos + 4)[0]
            if len(raw) - pos - 8 < size:
                break
            payload = raw[pos + 8 : pos + 8 + size]
            if stream == 2:
                self._diag += payload
                del self._diag[:-DIAG_MAX]
            else:
                self._out += payload
            pos += 8 + size
        del raw[:pos]
