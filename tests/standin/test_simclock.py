"""The virtual clock: time stands still while a participant is busy and jumps when all of them wait."""

from __future__ import annotations

import threading
import time

from m3_agent.standin.simclock import VirtualClock


def test_time_jumps_to_the_next_wake_up_when_everyone_waits():
    clock = VirtualClock()
    woke: list[tuple[str, float]] = []

    def sleeper(name: str, seconds: float) -> None:
        clock.sleep(seconds)
        woke.append((name, clock.now()))
        clock.leave()

    for _ in range(2):
        clock.join()
    threads = [threading.Thread(target=sleeper, args=(n, s)) for n, s in (("long", 3600.0), ("short", 60.0))]
    t = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert woke == [("short", 60.0), ("long", 3600.0)]
    assert time.monotonic() - t < 5  # an hour of simulated time, no real waiting


def test_a_busy_participant_holds_time_still():
    clock = VirtualClock()
    clock.join()
    clock.join()
    done = threading.Event()

    def sleeper() -> None:
        clock.sleep(10.0)
        done.set()
        clock.leave()

    threading.Thread(target=sleeper).start()
    time.sleep(0.2)
    assert clock.now() == 0.0 and not done.is_set()  # the other participant is still working
    clock.leave()
    assert done.wait(5) and clock.now() == 10.0


def test_a_parked_participant_lets_time_pass_until_unparked():
    clock = VirtualClock()
    clock.join()
    clock.join()
    released = threading.Event()

    def releaser() -> None:
        clock.sleep(5.0)
        clock.unpark(1)  # the parked participant is busy again before this one leaves
        released.set()
        clock.leave()

    threading.Thread(target=releaser).start()
    clock.park()  # waiting for the releaser, as a request waits for KV space
    assert released.wait(5) and clock.now() == 5.0
    clock.sleep(1.0)
    assert clock.now() == 6.0
    clock.leave()


def test_settle_returns_once_the_others_wait_again_at_the_same_instant():
    clock = VirtualClock()
    clock.join()
    clock.join()
    seen: list[str] = []

    def other() -> None:
        clock.sleep(5.0)
        time.sleep(0.3)  # real work at t=5, slower than the settling thread's wake-up
        seen.append("other at 5")
        clock.sleep(5.0)
        seen.append("other at 10")
        clock.leave()

    threading.Thread(target=other).start()
    clock.sleep(5.0)
    clock.settle()
    assert seen == ["other at 5"] and clock.now() == 5.0  # its work at this instant done, no time passed
    clock.settle()  # alone with a sleeper: still no time passes
    assert clock.now() == 5.0
    clock.leave()
    deadline = time.monotonic() + 5
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == ["other at 5", "other at 10"] and clock.now() == 10.0
