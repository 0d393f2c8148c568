"""Whole-repository context: pack a repository into one byte-deterministic prompt within a token budget.

    from m3_agent.agent.context import pack_repository, ServerCounter, budget_for_server

    pack = pack_repository(Path("."), issue=issue_text, budget=budget_for_server(url),
                           counter=ServerCounter(url))
    prompt = pack.text + "\\n\\n" + issue_text   # the issue goes after the repository
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from m3_agent.agent.context.cache import PackCache, cache_dir
    from m3_agent.agent.context.estimate import Estimate, estimate_tokens
    from m3_agent.agent.context.pack import Pack, PackedFile, Packer, SkippedFile, pack_repository
    from m3_agent.agent.context.stability import PackOrder, StableOrder
    from m3_agent.agent.context.tokens import (EstimateCounter, ServerCounter, TokenCounter, TokenizerJsonCounter,
                                               budget_for_server, budget_for_window)

# Each name from the module that defines it, on first use: a module that needs one constant of the packer's (the
# settings' defaults) does not load the packer, its cache and its relevance signals.
_FROM = {
    "PackCache": "cache", "cache_dir": "cache", "Estimate": "estimate", "estimate_tokens": "estimate",
    "Pack": "pack", "PackedFile": "pack", "Packer": "pack", "SkippedFile": "pack", "pack_repository": "pack",
    "PackOrder": "stability", "StableOrder": "stability",
    **dict.fromkeys(["EstimateCounter", "ServerCounter", "TokenCounter", "TokenizerJsonCounter", "budget_for_server",
                     "budget_for_window"], "tokens"),
}
__all__ = sorted(_FROM)


def __getattr__(name: str) -> Any:
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_FROM[name]}"), name)
