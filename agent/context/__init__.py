"""Whole-repository context: pack a repository into one byte-deterministic prompt within a token budget.

    from m3_agent.agent.context import pack_repository, ServerCounter, budget_for_server

    pack = pack_repository(Path("."), issue=issue_text, budget=budget_for_server(url),
                           counter=ServerCounter(url))
    prompt = pack.text + "\\n\\n" + issue_text   # the issue goes after the repository
"""

import importlib

# Name -> module it lives in. Loaded on first use (PEP 562), so `m3-agent pack` can start git
# before the packer's modules load.
_EXPORTS = {
    "PackCache": "cache", "cache_dir": "cache",
    "Pack": "pack", "PackedFile": "pack", "SkippedFile": "pack", "pack_repository": "pack",
    "EstimateCounter": "tokens", "ServerCounter": "tokens", "TokenCounter": "tokens",
    "TokenizerJsonCounter": "tokens", "budget_for_server": "tokens", "budget_for_window": "tokens",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'm3_agent.agent.context' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"m3_agent.agent.context.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
