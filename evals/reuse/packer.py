"""The packer `eval run` hands the agent: the core packer, with the order its batch stored, and a
delta pack when the instance's run has another root and the whole repository fits.

    ordered = order_for_commits(source, commits, store, delta=True)          # once, before the instances
    packer = BatchPacker(agent_config, history=source, commit=task.base_commit, batch=ordered.batch)
    Agent(agent_config, packer=packer).run(repo=tree, issue=task.problem_statement)
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from m3_agent.agent.config import AgentConfig
from m3_agent.agent.context import Pack, PackCache, Packer, StableOrder, TokenCounter
from m3_agent.agent.model import ModelClient
from m3_agent.evals.reuse import delta
from m3_agent.evals.reuse.ordering import Run, shared_files, stored_run
from m3_agent.settings import ReuseConfig


class BatchPacker:
    """Packs one instance of a batch (`commit` of the repository `history`, whose orders
    `order_for_commits` stored under `batch`; None: none stored, the plain order stands).

    `counter` counts the pack's tokens; default: the model's own (`ModelClient.token_counter`), asked
    at the first pack, once the loop has found the server up."""

    def __init__(self, agent: AgentConfig, *, history: str, commit: str, batch: str | None,
                 reuse: ReuseConfig | None = None, counter: TokenCounter | None = None) -> None:
        self.agent, self.history, self.commit, self.batch = agent, history, commit, batch
        self.reuse = reuse or ReuseConfig()
        self.counter = counter

    @functools.cached_property
    def core(self) -> Packer:
        """The core packer with the agent's `[context]` rules."""
        if self.counter is None:
            with contextlib.closing(ModelClient(self.agent.model)) as client:
                self.counter = client.token_counter()
        return Packer.from_config(self.agent.context, counter=self.counter)

    def order(self, commit: str, run: Run | None, store: PackCache) -> StableOrder:
        """The order of a pack of `commit`: its run's, with the files its groups have alike for the shared part."""
        alike = shared_files(self.history, self.batch, commit, store) if self.batch else None
        return StableOrder(self.history, store, run.order if run else None, alike=alike,
                           shared_share=self.reuse.shared_share)

    def run(self, commit: str, store: PackCache) -> Run | None:
        """What the batch stored for `commit` (None: no batch, or the commit is not in it)."""
        return stored_run(self.history, self.batch, commit, store) if self.batch else None

    def pack(self, repo: Path | str, *, issue: str | None = None, budget: int | None = None,
             history: str | None = None) -> Pack:
        """The instance's pack (`history` is the batch's: the argument is not used)."""
        with PackCache() as store:
            run = self.run(self.commit, store)
            plain = self.core.pack(repo, issue=issue, budget=budget, history=self.history,
                                   order=self.order(self.commit, run, store), store=store)
            if not self.reuse.delta or run is None or "budget" in plain.skipped_by_reason():
                return plain  # only a whole pack becomes a delta pack: a budgeted one's files depend on the issue

            def pack_at(commit: str):  # a tree packed as the instance at `commit` packs its own
                return lambda tree: self.core.pack(tree, budget=budget, history=self.history, store=store,
                                                   order=self.order(commit, self.run(commit, store), store))

            return delta.from_run(plain, run, history=self.history, commit=self.commit, budget=budget,
                                  counter=self.core.counter, pack_at=pack_at)
