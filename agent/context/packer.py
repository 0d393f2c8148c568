"""The packer the agent uses: `pack_repository` with a context config's rules and one token counter.

    packer = RepoPacker.from_config(config.context, counter=ServerCounter(url))
    pack = packer.pack(Path("."), issue=issue_text, budget=200_000)
"""

from __future__ import annotations

from pathlib import Path

from m3_agent.agent.context.outline import DEFAULT_OUTLINE_MAX_TOKENS, DEFAULT_OUTLINE_SHARE
from m3_agent.agent.context.pack import Pack, pack_repository
from m3_agent.agent.context.selection import DEFAULT_MAX_FILE_BYTES
from m3_agent.agent.context.tokens import EstimateCounter, TokenCounter


class RepoPacker:
    """Packs repositories with fixed rules (what to include, the outline tier) and one counter."""

    def __init__(self, *, counter: TokenCounter | None = None, include: tuple[str, ...] = (),
                 exclude: tuple[str, ...] = (), max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 outline_share: float = DEFAULT_OUTLINE_SHARE,
                 outline_max_tokens: int = DEFAULT_OUTLINE_MAX_TOKENS) -> None:
        self.counter = counter or EstimateCounter()
        self.include, self.exclude, self.max_file_bytes = tuple(include), tuple(exclude), max_file_bytes
        self.outline_share, self.outline_max_tokens = outline_share, outline_max_tokens

    @classmethod
    def from_config(cls, context, counter: TokenCounter | None = None) -> RepoPacker:
        """The packer of a `ContextConfig` (the `[context]` section)."""
        return cls(counter=counter, include=tuple(context.include), exclude=tuple(context.exclude),
                   max_file_bytes=context.max_file_bytes, outline_share=context.outline_share,
                   outline_max_tokens=context.outline_max_tokens)

    def pack(self, repo: Path | str, *, issue: str | None = None, budget: int | None = None,
             history: Path | str | None = None, order=None) -> Pack:
        """`repo` packed (`pack_repository`), its files in `order` (default: least changed in `history`'s
        recent commits first, `stability.StableOrder`)."""
        return pack_repository(repo, issue=issue, budget=budget, counter=self.counter, include=self.include,
                               exclude=self.exclude, max_file_bytes=self.max_file_bytes, history=history,
                               order=order, outline_share=self.outline_share,
                               outline_max_tokens=self.outline_max_tokens)
