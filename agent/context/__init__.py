"""Whole-repository context: pack a repository into one byte-deterministic prompt within a token budget.

    from m3_agent.agent.context import pack_repository, ServerCounter, budget_for_server

    pack = pack_repository(Path("."), issue=issue_text, budget=budget_for_server(url),
                           counter=ServerCounter(url))
    prompt = pack.text + "\\n\\n" + issue_text   # the issue goes after the repository
"""

from m3_agent.agent.context.cache import PackCache, cache_dir
from m3_agent.agent.context.estimate import Estimate, estimate_tokens
from m3_agent.agent.context.pack import Pack, PackedFile, Packer, SkippedFile, pack_repository
from m3_agent.agent.context.stability import PackOrder, StableOrder
from m3_agent.agent.context.tokens import (
    EstimateCounter,
    ServerCounter,
    TokenCounter,
    TokenizerJsonCounter,
    budget_for_server,
    budget_for_window,
)

__all__ = ["Estimate", "EstimateCounter", "Pack", "PackCache", "PackOrder", "PackedFile", "Packer",
           "ServerCounter", "SkippedFile", "StableOrder", "TokenCounter", "TokenizerJsonCounter", "budget_for_server",
           "budget_for_window", "cache_dir", "estimate_tokens", "pack_repository"]
