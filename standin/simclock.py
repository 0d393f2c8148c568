"""Clocks for the stand-in's performance model: scaled real time, or virtual time for in-process simulations.

    clock = VirtualClock()
    with StandinServer(script, clock=clock) as srv:     # the server's waits are on the virtual clock
        clock.join()                                   # a client session takes part in the simulation
        ...                                            # HTTP requests; clock.sleep(20.0) for tool time
        clock.leave()
    clock.now()                                        # simulated seconds, whatever the CPU did meanwhile

`ScaledClock` (the default) runs `time_scale` simulated seconds per real second: simple, and it
works across processes, but whatever real work the client and the server do in between also counts,
multiplied. `VirtualClock` never counts real work: simulated time stands still while any
participant is busy and jumps to the next wake-up once every participant waits. A participant is a
client session (`join` / `leave`); a request it sends carries it into the server, whose modeled
wait (`sleep_until`) and wait for KV space (`park` / `unpark`) are then the session's waits.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time


class ScaledClock:
    """Real time times `time_scale`, from the moment it is made."""

    def __init__(self, time_scale: float = 1.0) -> None:
        self.time_scale = time_scale
        self.started_at = time.monotonic()

    def now(self) -> float:
        """Simulated seconds since start."""
        return (time.monotonic() - self.started_at) * self.time_scale

    def sleep_until(self, t: float) -> None:
        """Return once simulated time reaches `t`."""
        wait = (t - self.now()) / self.time_scale
        if wait > 0:
            time.sleep(wait)

    def park(self) -> None:
        """A participant starts waiting for another one (nothing to do in real time)."""

    def unpark(self, n: int) -> None:
        """`n` parked participants are woken (nothing to do in real time)."""


class VirtualClock:
    """Simulated time that advances only when every participant waits, straight to the next wake-up."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._now = 0.0
        self._active = 0
        self._sleepers: list[tuple[float, int]] = []  # heap of (wake time, sequence)
        self._seq = itertools.count()

    def now(self) -> float:
        """Simulated seconds since the start."""
        with self._cv:
            return self._now

    def join(self) -> None:
        """One more participant, busy until it waits."""
        with self._cv:
            self._active += 1

    def leave(self) -> None:
        """A participant is done for good."""
        with self._cv:
            self._rest()

    def sleep_until(self, t: float) -> None:
        """Wait (as a participant) until simulated time reaches `t`."""
        with self._cv:
            if t <= self._now:
                return
            heapq.heappush(self._sleepers, (t, next(self._seq)))
            self._rest()
            self._cv.wait_for(lambda: self._now >= t)
            # _rest counted this participant busy again when it moved the clock to `t`

    def sleep(self, seconds: float) -> None:
        """Let `seconds` of simulated time pass for this participant."""
        self.sleep_until(self.now() + seconds)

    def settle(self) -> None:
        """Wait (as a participant) until every other participant waits, without letting time pass.

        What the others do at this instant (a request sent, a session ended) is then done before
        this one goes on, whichever thread the machine ran first.
        """
        with self._cv:
            entry = (self._now, next(self._seq))  # the earliest wake-up: first out once all wait
            heapq.heappush(self._sleepers, entry)
            self._rest()
            self._cv.wait_for(lambda: entry not in self._sleepers)

    # a participant waiting for another one (which calls `unpark`) stops being busy, as one that leaves
    park = leave

    def unpark(self, n: int) -> None:
        """`n` parked participants are about to wake: they count as busy from now on."""
        with self._cv:
            self._active += n

    def _rest(self) -> None:
        # one participant stops being busy; once everyone waits, move to the earliest wake-up and
        # wake all who sleep until then
        self._active -= 1
        if self._active > 0 or not self._sleepers:
            return
        t = self._sleepers[0][0]
        self._now = t
        while self._sleepers and self._sleepers[0][0] <= t:
            heapq.heappop(self._sleepers)
            self._active += 1
        self._cv.notify_all()
