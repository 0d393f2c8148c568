"""The stand-in's performance model: a simulated M3 server's KV cache, prefill lane and clock.

Timing of a test double, calibrated, not a measurement. The wire double (`standin/server.py`) loads
this module only when its script has a `performance` section, and asks it one thing per request:
how long the request takes and how many of its prompt tokens were cached.

    sim = KVSimulator(Performance(), block_size=128, clock=VirtualClock())
    cached = sim.run(block_hashes, prompt_tokens=9000, completion_tokens=300, received=sim.now())

What it models (formulas and their sources: docs/standin.md, "The performance model"):
- a KV cache of `kv_capacity_tokens`, in blocks; a request holds ceil((prompt + completion) / B)
  blocks while it runs and waits when they do not fit (`num_requests_waiting`);
- vLLM's eviction order (`PrefixCache`): a finished request's blocks stay cached, free, until space
  is needed; the least recently freed goes first, tail blocks before the prefix others share;
- one serialized prefill lane for the uncached prompt tokens, decode per sequence beside it;
- a clock (`standin/simclock.py`): real time times `time_scale`, or virtual time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from m3_agent.serving.planner import GB, PlanRequest, plan
from m3_agent.standin.simclock import ScaledClock, VirtualClock

# Seed 000's 8x B200 run (vLLM, 8192 in / 2048 out, 32 concurrent): 8,097.56 tok/s total of which
# 1,619.51 output, so the engine sustained 6,478 prompt tok/s while decoding; mean ITL 19.06 ms.
B200X8_PREFILL_TOK_S = 8_097.56 - 1_619.51
B200X8_DECODE_TOK_S = 1000 / 19.06
# The KV pool of 8x B200 at BF16 with vLLM's default utilization, per the serving planner.
_B200X8 = plan(PlanRequest(gpus=8, gpu_memory_gb=180))
B200X8_KV_TOKENS = int(_B200X8.kv_pool_gb * GB / _B200X8.kv_bytes_per_token)


class Performance(BaseModel):
    """The stand-in's server performance model (a test double's timing, calibrated, not measured).

    Defaults are seed 000's 8x B200 figures (see docs/standin.md for the formulas). `time_scale` is
    simulated seconds per real second: 600 runs an hour in six seconds.
    """

    model_config = ConfigDict(extra="forbid")

    kv_capacity_tokens: int = Field(default=B200X8_KV_TOKENS, gt=0)
    prefill_tokens_per_s: float = Field(default=B200X8_PREFILL_TOK_S, gt=0, description="whole server, serialized")
    decode_tokens_per_s: float = Field(default=B200X8_DECODE_TOK_S, gt=0, description="per running sequence")
    time_scale: float = Field(default=1.0, gt=0)


class PrefixCache:
    """Block-granular prefix cache of `capacity` blocks with vLLM's eviction order.

    Keys are chain hashes of full prompt blocks, each with a reference count (running requests that
    use it). Blocks of running requests are pinned; a free block stays cached until space is needed,
    and the least recently freed goes first. A request frees its blocks tail first, as vLLM does,
    so a prompt's leading blocks (the ones other prompts share) outlive its tail.
    `anonymous` counts blocks in use that no later request can hit (the partial last block, the
    generated tokens).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # hash -> refs; first = next to evict
        self.anonymous = 0
        self.evicted = 0

    @property
    def used(self) -> int:
        """Blocks held: cached (pinned or free) and anonymous."""
        return len(self.blocks) + self.anonymous

    @property
    def pinned(self) -> int:
        """Blocks that running requests hold."""
        return self.anonymous + sum(1 for refs in self.blocks.values() if refs)

    def hits(self, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` that are cached."""
        return next((i for i, h in enumerate(hashes) if h not in self.blocks), len(hashes))

    def allocate(self, hashes: list[bytes], extra: int) -> int | None:
        """Pin the cached prefix, evict what must go, add the rest; the hit count, or None if it cannot fit now."""
        hit = self.hits(hashes)
        new = len(hashes) - hit + extra
        reused_free = sum(1 for h in hashes[:hit] if not self.blocks[h])
        if self.pinned + reused_free + new > self.capacity:
            return None
        for h in hashes[:hit]:
            self.blocks[h] += 1
        while self.used + new > self.capacity:
            del self.blocks[next(h for h, refs in self.blocks.items() if not refs)]  # the least recently freed
            self.evicted += 1
        for h in hashes[hit:]:
            self.blocks[h] = 1
        self.anonymous += extra
        return hit

    def free(self, hashes: list[bytes], extra: int) -> None:
        """Unpin a finished request's blocks, tail first; they stay cached until evicted."""
        self.anonymous -= extra
        for h in reversed(hashes):
            refs = self.blocks.get(h)
            if refs is None:
                continue
            self.blocks[h] = refs - 1
            if refs == 1:
                self.blocks.move_to_end(h)


class KVSimulator:
    """One simulated server: its KV cache, its prefill lane, its clock and the counters vLLM exports.

    Thread-safe: the stand-in's handler threads call `run` concurrently; a request that finds no
    room for its blocks waits until a running one frees some, as vLLM queues it.
    """

    def __init__(self, perf: Performance, block_size: int, clock: ScaledClock | VirtualClock | None = None) -> None:
        self.perf = perf
        self.block_size = block_size
        self.cache = PrefixCache(perf.kv_capacity_tokens // block_size)
        self.clock = clock or ScaledClock(perf.time_scale)
        self.lock = threading.Lock()
        self.kv_freed = threading.Condition(self.lock)
        self.running = self.waiting = self.parked = 0
        self.prefill_free_at = 0.0  # simulated time at which the serialized prefill lane is free
        self.queries = self.hits = 0  # prompt tokens looked up in the prefix cache, and found there

    def now(self) -> float:
        """The simulated time: when a request that arrives now was received."""
        return self.clock.now()

    def run(self, hashes: list[bytes], prompt_tokens: int, completion_tokens: int, received: float) -> int:
        """Hold the request's blocks for as long as it runs on the simulated server; its cached prompt tokens.

        `hashes` are the chain hashes of the prompt's full blocks (the ones a later prompt may share);
        `received` is the clock's time when the request arrived. The request waits while the cache
        has no room for its blocks, then finishes once prefill of its uncached tokens (on the one
        serialized lane) and decode of its completion are done.
        """
        bs = self.block_size
        extra = max(0, -(-(prompt_tokens + completion_tokens) // bs) - len(hashes))
        extra = min(extra, self.cache.capacity - len(hashes))  # a request never needs more than the whole cache
        with self.lock:
            self.waiting += 1
            hit = self.cache.allocate(hashes, extra)
            while hit is None:
                self.parked += 1
                self.clock.park()
                self.kv_freed.wait()
                received = self.clock.now()  # the request starts once it is admitted
                hit = self.cache.allocate(hashes, extra)
            self.waiting -= 1
            self.running += 1
            cached = hit * bs
            self.queries += prompt_tokens
            self.hits += cached
            start = max(received, self.prefill_free_at)
            self.prefill_free_at = start + (prompt_tokens - cached) / self.perf.prefill_tokens_per_s
            finish_at = self.prefill_free_at + completion_tokens / self.perf.decode_tokens_per_s
        try:
            self.clock.sleep_until(finish_at)
        finally:
            with self.lock:  # unpin its blocks and wake requests waiting for KV space
                self.cache.free(hashes, extra)
                self.running -= 1
                # the woken count as busy at once, so a virtual clock cannot jump past their admission
                self.clock.unpark(self.parked)
                self.parked = 0
                self.kv_freed.notify_all()
        return cached

    def metrics(self) -> dict[str, Any]:
        """The engine's side of /metrics, by vLLM's names: prefix-cache counters, KV usage and load, capacity."""
        with self.lock:
            return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                    "kv_cache_usage_perc": self.cache.used / self.cache.capacity,
                    "num_requests_running": self.running, "num_requests_waiting": self.waiting,
                    "num_gpu_blocks": self.cache.capacity}
