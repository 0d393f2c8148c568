"""The host end of the exec server's pipe, framed (see `sandbox/server.py`).

Two transports. Direct: a Unix socket this process listens on, shared read-only into the container;
the server connects and proves itself with a one-time token, and frames then flow with no engine in
between. Attach: the container's stdin/stdout through the engine, where Docker wraps a non-TTY
container's output in frames of 8-byte headers (stream 1 stdout, 2 stderr, then a big-endian length).
The attach stream is always open: the server's stderr on it (kept, bounded) explains a crash, and
its closing is how a killed host lets the container die.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterable

RECV = 1 << 20
DIAG_MAX = 8192


class ChannelClosed(Exception):
    """The server's end is gone (container stopped, crashed, or the socket timed out)."""


MOUNT_POINT = "/run/m3-agent"


class SharedSocket:
    """A listening Unix socket in a fresh private directory, to be bind-mounted read-only at MOUNT_POINT."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="m3-agent-")
        os.chmod(self.dir, 0o711)  # the container user may traverse it, nobody may list it
        self.path = os.path.join(self.dir, "s")
        self.token = secrets.token_hex(16)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o666)  # any uid inside may connect; the token tells ours from others
        self.listener.listen(4)

    @property
    def env(self) -> dict[str, str]:
        """What the server needs to find and prove itself."""
        return {"M3_AGENT_SOCKET": f"{MOUNT_POINT}/s", "M3_AGENT_TOKEN": self.token}

    def close(self) -> None:
        """Stop listening and remove the socket and its directory (a connected socket lives on)."""
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Channel:
    """Framed requests and answers with the server, over the shared socket or the attach stream."""

    def __init__(self, attach: socket.socket, direct: socket.socket | None = None) -> None:
        self._attach = attach
        self._sock = direct or attach
        self.transport = "attach" if direct is None else "direct"  # the engine's stream, or the shared Unix socket
        self._raw = bytearray()  # undemultiplexed bytes from the attach stream
        self._out = bytearray()  # the server's answers, not yet consumed
        self._diag = bytearray()  # the server's stderr, last DIAG_MAX bytes

    @classmethod
    def establish(cls, attach: socket.socket, shared: SharedSocket | None, timeout: float) -> Channel:
        """Wait for the server's first word: a token on the shared socket, or a hello on the attach stream.
        The caller closes `shared` once the channel is there (or is not)."""
        stdio = cls(attach)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            watch = [attach] + ([shared.listener] if shared else [])
            ready, _, _ = select.select(watch, [], [], left)
            if shared is not None and shared.listener in ready:
                conn, _ = shared.listener.accept()
                direct = cls(attach, conn)
                direct._raw, direct._diag = stdio._raw, stdio._diag  # stderr seen so far stays readable
                try:
                    header, _ = direct.receive(timeout=5)
                except (ChannelClosed, ValueError):
                    header = {}
                if isinstance(header, dict) and secrets.compare_digest(str(header.get("token")), shared.token):
                    return direct
                conn.close()  # not our server
            if attach in ready:
                try:
                    stdio._pump()
                except ChannelClosed as e:
                    raise ChannelClosed(f"{e}: {stdio.diagnostics[-300:] or 'no output'}") from None
                if len(stdio._out) >= 4:
                    header, _ = stdio.receive(timeout=left)
                    if isinstance(header, dict) and header.get("hello") == "stdio":
                        return stdio
                    raise ChannelClosed(f"unexpected first answer from the sandbox: {str(header)[:200]}")
        raise ChannelClosed(f"the sandbox server did not start within {timeout:.0f} s")

    @property
    def diagnostics(self) -> str:
        """The tail of what the server wrote to stderr (a traceback when it crashed)."""
        if self.transport == "direct":  # the attach stream is not read in direct mode: take what is there now
            with contextlib.suppress(OSError):
                self._attach.settimeout(0.2)
                while self._drain_attach():
                    pass
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
        """Close both sockets; the server sees end of input and exits, which stops the container."""
        for sock in {self._sock, self._attach}:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

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
        """Read from the socket once: answers straight from the shared socket, or demultiplexed."""
        try:
            if self.transport == "direct":
                chunk = self._sock.recv(RECV)
                if chunk:
                    self._out += chunk
                    return
            elif self._drain_attach():
                return
        except socket.timeout:
            raise ChannelClosed("the sandbox stopped answering (timed out)") from None
        except OSError as e:
            raise ChannelClosed(f"cannot read from the sandbox: {e}") from None
        raise ChannelClosed("the sandbox closed its output (the container stopped)")

    def _drain_attach(self) -> bool:
        """One read of the attach stream, split into stdout (answers) and stderr; False at its end."""
        chunk = self._attach.recv(RECV)
        if not chunk:
            return False
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
        return True
