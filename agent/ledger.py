"""A run's ledger: the tokens it used, the thinking modes it sent, where its time went, what it cost,
and which limit that reaches. `RunResult` is a ledger plus the run's outcome."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from pydantic import BaseModel, Field, PrivateAttr

from m3_agent.agent.config import LimitsConfig
from m3_agent.agent.model import ModelReply, Usage


class Timings(BaseModel):
    """Where a run's wall time went."""

    wall_s: float = 0.0
    pack_s: float = 0.0
    sandbox_start_s: float = 0.0
    model_s: float = 0.0
    tools_s: float = 0.0


class Ledger(BaseModel):
    """Usage and timings of one run, counted from its start (when the ledger is made)."""

    usage: Usage = Field(default_factory=Usage)
    cache_hit_share: float = 0.0
    mode_counts: dict[str, int] = Field(default_factory=dict)
    timings: Timings = Field(default_factory=Timings)
    cost_usd: float | None = None
    first_prompt_tokens: int = 0  # the first request's prompt: what the run started with in the KV cache
    peak_context_tokens: int = 0  # the largest prompt + completion of one request: what it came to hold
    _t0: float = PrivateAttr(default_factory=time.monotonic)

    def account(self, reply: ModelReply, mode: str | None) -> None:
        """Count a reply's usage, and its thinking mode when one was sent."""
        self.usage.add(reply.usage)
        if mode is not None:
            self.mode_counts[mode] = self.mode_counts.get(mode, 0) + 1
        self.first_prompt_tokens = self.first_prompt_tokens or reply.usage.prompt_tokens
        self.peak_context_tokens = max(self.peak_context_tokens, reply.usage.total_tokens)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the time the block takes (raising or not) to the timing `phase` (`model_s`, ...)."""
        t = time.monotonic()
        try:
            yield
        finally:
            setattr(self.timings, phase, getattr(self.timings, phase) + time.monotonic() - t)

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def cost(self, limits: LimitsConfig) -> float | None:
        """USD so far: by token prices, else by GPU hours of wall time; None without a price."""
        u = self.usage
        if limits.usd_per_m_input is not None or limits.usd_per_m_output is not None:
            return (u.prompt_tokens * (limits.usd_per_m_input or 0)
                    + u.completion_tokens * (limits.usd_per_m_output or 0)) / 1e6
        if limits.gpu_usd_per_hour is not None:
            return limits.gpu_usd_per_hour * self.elapsed() / 3600
        return None

    def limit_reached(self, limits: LimitsConfig) -> Literal["token_limit", "time_limit", "cost_limit"] | None:
        """The token, time or cost limit the run has reached, if any."""
        if limits.max_total_tokens is not None and self.usage.total_tokens >= limits.max_total_tokens:
            return "token_limit"
        if limits.max_wall_s is not None and self.elapsed() >= limits.max_wall_s:
            return "time_limit"
        cost = self.cost(limits)
        return "cost_limit" if limits.max_cost_usd is not None and cost is not None and cost >= limits.max_cost_usd else None

    def close(self, limits: LimitsConfig) -> None:
        """The run's totals: cache share, cost and wall time."""
        self.cache_hit_share = round(self.usage.cache_hit_share, 4)
        self.cost_usd = self.cost(limits)
        self.timings.wall_s = self.elapsed()
