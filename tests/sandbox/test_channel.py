"""The host end of the exec server pipe: Docker's stream demultiplexing and the request framing."""

import json
import socket
import struct
import threading

import pytest

from m3_agent.sandbox.channel import Channel, ChannelClosed


def docker_frame(stream: int, payload: bytes) -> bytes:
    return bytes([stream, 0, 0, 0]) + struct.pack(">I", len(payload)) + payload


def answer(header: dict, data: bytes | None = None) -> bytes:
    if data is not None:
        header = {**header, "data": True}
    body = json.dumps(header).encode()
    out = struct.pack(">I", len(body)) + body
    if data is not None:
        out += struct.pack(">I", len(data)) + data
    return out


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield Channel(a), b
    a.close()
    b.close()


def test_answer_split_across_docker_frames_and_interleaved_stderr(pair):
    chan, peer = pair
    wire = answer({"exit_code": 0}, b"\x00binary\xff" * 1000)
    frames = [docker_frame(1, wire[:7]), docker_frame(2, b"a warning\n"), docker_frame(1, wire[7:5000]),
              docker_frame(1, wire[5000:])]
    blob = b"".join(frames)

    def dribble():
        for i in range(0, len(blob), 3):  # worst case: headers cut in pieces
            peer.sendall(blob[i : i + 3])

    t = threading.Thread(target=dribble)
    t.start()
    header, data = chan.receive(timeout=5)
    t.join()
    assert header["exit_code"] == 0
    assert data == b"\x00binary\xff" * 1000
    assert chan.diagnostics == "a warning"


def test_request_framing_with_data_chunks(pair):
    chan, peer = pair
    chan.send({"op": "write"}, [b"abc", b"", b"de"])
    got = peer.recv(1 << 16)
    n = struct.unpack(">I", got[:4])[0]
    assert json.loads(got[4 : 4 + n]) == {"op": "write"}
    rest = got[4 + n :]
    assert rest == struct.pack(">I", 3) + b"abc" + struct.pack(">I", 2) + b"de" + struct.pack(">I", 0)


def test_closed_peer_is_reported(pair):
    chan, peer = pair
    peer.sendall(docker_frame(1, struct.pack(">I", 10) + b"{"))
    peer.close()
    with pytest.raises(ChannelClosed, match="closed"):
        chan.receive(timeout=5)


def test_silence_is_a_timeout(pair):
    chan, _ = pair
    with pytest.raises(ChannelClosed, match="timed out"):
        chan.receive(timeout=0.2)
