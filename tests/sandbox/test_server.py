"""The in-container server's output cap, exercised directly (it is plain Python)."""

from m3_agent.sandbox.server import MARKER, Capped


def test_output_under_the_limit_is_kept_whole():
    c = Capped(100)
    for piece in (b"a" * 30, b"b" * 30, b"c" * 40):
        c.add(piece)
    assert c.value() == (b"a" * 30 + b"b" * 30 + b"c" * 40, False)


def test_output_over_the_limit_keeps_head_and_tail_with_a_marker():
    c = Capped(100)
    data = bytes(range(256)) * 4000  # ~1 MB in uneven pieces
    for i in range(0, len(data), 777):
        c.add(data[i : i + 777])
    out, truncated = c.value()
    assert truncated
    assert out.startswith(data[:50]) and out.endswith(data[-50:])
    assert MARKER % (len(data) - 100) in out
    assert len(out) == 100 + len(MARKER % (len(data) - 100))


def test_memory_stays_bounded():
    c = Capped(1000)
    for _ in range(10_000):
        c.add(b"x" * 4096)
    assert len(c.head) + len(c.tail) < 1000 + 2 * 65536 + 4096
