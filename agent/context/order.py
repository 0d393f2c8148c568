"""The order a pack lays its file sections out in, and the budget's share that is the same for every issue.

`Packer.pack(..., order=)` takes any `PackOrder`. The core's default is `stability.StableOrder`: the
files least changed in the repository's recent commits first, no shared part. `eval run` supplies
one built from the orders it stored for a batch (`m3_agent.evals.reuse`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol


class PackOrder(Protocol):
    """What a pack needs to know of the order of its files.

    `key(paths)` -> a sort key for each path (the pack order of the packable files, `paths`);
    `alike`: groups of files the budget's shared part may hold, each in its order (None: the
    source files, not tests, in pack order); `shared_share`: the share of a budgeted pack filled
    with the same files whatever the issue (0: none)."""

    alike: list[list[str]] | None
    shared_share: float

    def key(self, paths: Iterable[str]) -> Callable[[str], Any]:
        """A sort key of paths, made knowing the packable ones."""
        ...

