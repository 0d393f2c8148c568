"""`Packer`: a whole repository as one byte-deterministic prompt, within a token budget.

A packer holds the rules (include, exclude, max_file_bytes, the outline tier's share), the token
counter and the cache. `Packer.pack` lists the files, then runs one method per step: `decide` each
one's fate, `count` their tokens, `choose` what fits a budget, `render` the text. What one pack
plans for its files (token counts, section costs, relevance ranks, the shared part) and the cache
store it uses are kept in that pack's `Plan`; the entries of the listing only carry their fate and facts.
`pack_repository` is the same as one call of a packer made for it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from m3_agent.agent.context import layout, outline, reader
from m3_agent.agent.context.cache import PackCache
from m3_agent.agent.context.estimate import CALIBRATION_SAMPLES, sample
from m3_agent.agent.context.outline import DEFAULT_OUTLINE_MAX_TOKENS, DEFAULT_OUTLINE_SHARE
from m3_agent.agent.context.reader import Rules, load, read_bytes
from m3_agent.agent.context.relevance import is_test, rank
from m3_agent.agent.context.selection import (
    DEFAULT_MAX_FILE_BYTES,
    Entry,
    Listing,
    compile_globs,
    definitions,
    is_code,
    list_files,
    subword_terms,
)
from m3_agent.agent.context.stability import PackOrder, StableOrder
from m3_agent.agent.context.tokens import EstimateCounter, TokenCounter, fit_scale, text_shape
from m3_agent.errors import UsageError

# Exact counts are planned with a calibrated estimate and checked; a plan this much over is re-cut.
TOP_UP_ROUNDS = 2
TREE_SHARE = 0.5  # the tree may take at most this share of a budget before it is shortened
PLAN_MARGIN = 1.1  # planned counts of files not yet counted exactly err this much high


class PackedFile(NamedTuple):
    """A file whose text is in the pack: `path`, `tokens` of its text (without its heading and
    fences), `bytes`, and `flags` (a list: "non-utf8", "no-final-newline", "symlink", ...)."""

    path: str
    tokens: int
    bytes: int
    flags: list[str]


class SkippedFile(NamedTuple):
    """A file listed in the tree but not packed: `path`, `reason` (binary, too-large, lockfile,
    minified, source-map, vendored, generated, excluded, not-included, symlink-outside, budget, ...)
    and `detail` (e.g. a symlink's target)."""

    path: str
    reason: str
    detail: str = ""


class PackInfo(NamedTuple):
    """What a pack says about itself besides its text: the counter's kind ("server" |
    "tokenizer.json" | "estimate"), the budget, the commit packed (`head`, in a git work tree),
    the files in the tree and those with their text in the pack, the files left out by the budget
    shown as outlines (most relevant first) and the outline tier's tokens, and for a delta pack the
    commit whose files its sections show."""

    counter_kind: str
    budget: int | None = None
    head: str | None = None
    total_files: int = 0
    packed_count: int = 0
    outlined: list[str] = []
    outline_tokens: int = 0
    delta_base: str | None = None


class Pack:
    """A packed repository. `text` goes first in the prompt; the issue goes after it, separately.

    The text is kept as UTF-8 byte pieces (`parts`, which `write` saves one after another, without
    joining them), joined into `data` and decoded into `text` on first use. The lists of packed and
    skipped files are given, or made on first use by `lists` (a `Fates`).
    """

    def __init__(self, parts: layout.Rendered | tuple, tokens: int, info: PackInfo, *,
                 files: list[PackedFile] | None = None, skipped: list[SkippedFile] | None = None,
                 lists: Fates | None = None, timings: dict[str, float] | None = None) -> None:
        # The pieces by name (head, file sections, tail) when the packer rendered them; a delta
        # pack's are put together from other packs' pieces (`parts` only).
        self.rendered = parts if isinstance(parts, layout.Rendered) else None
        self.parts = tuple(parts.parts) if self.rendered is not None else tuple(parts)
        self.tokens = tokens  # tokens of `text` per the counter
        self.info = info
        self._files, self._skipped, self._lists = files, skipped, lists
        self.counter_kind, self.budget, self.head = info.counter_kind, info.budget, info.head
        self.total_files = info.total_files
        self.packed_count = len(files) if files is not None else info.packed_count  # files with their text in the pack
        self.outlined = list(info.outlined)  # files left out by the budget shown as outlines, most relevant first
        self.outline_tokens = info.outline_tokens  # tokens of the outline tier (part of `tokens`)
        self.delta_base = info.delta_base  # a delta pack: the commit whose files its sections show
        self.timings = timings if timings is not None else {}

    @property
    def files(self) -> list[PackedFile]:
        """The packed files, in tree order."""
        if self._files is None:
            self._files, self._skipped = self._lists.listed()
        return self._files

    @property
    def skipped(self) -> list[SkippedFile]:
        """The files the tree lists without their text, and why, in tree order."""
        if self._skipped is None:
            self._files, self._skipped = self._lists.listed()
        return self._skipped

    def __repr__(self) -> str:
        return (f"Pack(files={len(self.files)}, skipped={len(self.skipped)}, tokens={self.tokens}, "
                f"counter_kind={self.counter_kind!r}, budget={self.budget})")

    @functools.cached_property
    def data(self) -> bytes:
        """The prompt text as UTF-8 bytes."""
        return b"".join(self.parts)

    @functools.cached_property
    def text(self) -> str:
        """The prompt text: header, tree, file sections, footer. Byte-deterministic."""
        return self.data.decode("utf-8", "replace")

    def write(self, path: Path | str) -> None:
        """Save the text (UTF-8) to a file."""
        with open(path, "wb") as f:
            self.write_to(f)

    def write_to(self, stream) -> None:
        """Write the text to a binary stream, piece by piece."""
        if "data" in self.__dict__:  # joined already
            stream.write(self.data)
        else:
            stream.writelines(self.parts)

    def skipped_by_reason(self) -> dict[str, int]:
        """How many files each reason left out."""
        if self._skipped is None and self._lists is not None:
            return dict(sorted(self._lists.counted[1].items()))  # (sorted() copies: the cached counts stay as they are)
        return dict(sorted(Counter(s.reason for s in self.skipped).items()))

    def packed_tokens(self) -> int:
        """Tokens of the packed files' texts (without their headings and fences)."""
        if self._files is None and self._lists is not None:
            return self._lists.counted[0]
        return sum(f.tokens for f in self.files)


class Fates:
    """Each entry of a pack with why it has no text there (None when it has): the pack's lists of
    packed and skipped files, made when first asked for. Holds the entries and counts only."""

    def __init__(self, entries: list[Entry], chosen: list[Entry], left_out: list[Entry],
                 tokens: dict[Entry, int]) -> None:
        self.entries, self.chosen, self.left_out, self.tokens = entries, chosen, left_out, tokens

    @functools.cached_property
    def fates(self) -> list[tuple[Entry, str | None]]:
        chosen, left = set(self.chosen), set(self.left_out)
        return [(e, None if e in chosen else "budget" if e in left else e.reason or "unknown") for e in self.entries]

    def listed(self) -> tuple[list[PackedFile], list[SkippedFile]]:
        """The packed files, and the skipped ones with their reasons, in tree order."""
        files, skipped = [], []
        for e, reason in self.fates:
            if reason is None:
                files.append(PackedFile(e.path, self.tokens.get(e, 0), e.size or 0, _flags(e)))
            else:
                skipped.append(SkippedFile(e.path, reason, e.detail))
        return files, skipped

    @functools.cached_property  # (asked twice by a summary: the tokens, then the reasons)
    def counted(self) -> tuple[int, dict[str, int]]:
        """(tokens of the packed texts, {reason: files}), without making the lists."""
        packed_tokens = sum(self.tokens.get(e, 0) for e, reason in self.fates if reason is None)
        return packed_tokens, Counter(reason for _, reason in self.fates if reason is not None)


def _flags(e: Entry) -> list[str]:
    return (["symlink"] if e.kind == "symlink" else []) + layout.content_flags(e)


def pack_repository(repo: Path | str, *, issue: str | None = None, budget: int | None = None,
                    counter: TokenCounter | None = None, cache: PackCache | bool = True,
                    history: Path | str | None = None, order: PackOrder | None = None, **rules) -> Pack:
    """Pack the repository at `repo` with a `Packer` made for this one pack (see `Packer.pack`).

    `rules` are the packer's (include, exclude, max_file_bytes, outline_share, outline_max_tokens);
    `cache` (on by default) keeps facts and token counts by git blob id under the user's cache
    directory.
    """
    return Packer(counter=counter, store=cache, **rules).pack(repo, issue=issue, budget=budget, history=history,
                                                               order=order)


class Plan:
    """One pack in the making: the listing and its rules, the issue and budget, the order, the
    entries in tree order and the packable ones in pack order, and what this pack planned for each
    file. Everything per entry lives in tables keyed by the entry, never on the entry."""

    def __init__(self, listing: Listing, rules: Rules, *, issue: str | None, budget: int | None,
                 order: PackOrder | None, store: PackCache | None) -> None:
        self.listing, self.rules, self.issue, self.budget, self.order = listing, rules, issue, budget, order
        self.store = store  # the cache this pack reads and writes (None: none)
        self.entries = sorted(listing.entries, key=lambda e: layout.sort_key(e.path))
        self.packable: list[Entry] = []
        self.known: dict = {}  # cached facts by blob
        self.stale = False  # the index's snapshot of facts is missing (it is written after the pack)
        self.raw: dict[str, bytes] = {}  # bytes of the files read, kept for relevance
        self.new_facts: dict = {}  # facts learned by this pack, by blob: cached after it
        self.tokens: dict[Entry, int] = {}  # tokens of a file's text
        self.inexact: set[Entry] = set()  # files whose `tokens` is a calibrated estimate, not yet an exact count
        self.cost: dict[Entry, int] = {}  # planned tokens of a file's section around its text (heading, fences)
        self.rank: dict[Entry, int] = {}  # position in relevance order (0 = most relevant), when a budget applies
        self.shared: set[Entry] = set()  # files in the budget's shared part, the same for every issue
        self.outlines: dict[Entry, outline.Outlined] = {}  # the outline tier planned, by file
        self.head_text = self.tree_text = self.source_text = ""
        self.timings: dict[str, float] = {}

    def bytes_of(self, e: Entry) -> bytes | None:
        """A file's bytes: those read while deciding, else from the disk (None when unreadable)."""
        raw = self.raw.get(e.path) if self.raw else None
        if raw is None:
            try:
                raw, _ = read_bytes(os.path.join(self.listing.root, e.path), self.rules.limit)
            except OSError:
                return None
        return raw

    def load(self, entries: list[Entry]) -> None:
        """Read the texts of these files that are not read yet."""
        for e in entries:
            if e.content is None:
                load(str(self.listing.root), e, self.rules.limit)

    def ensure_definitions(self) -> None:
        """Fill in the names each code file defines and their words (cached with its facts), for relevance."""
        for e in self.packable:
            facts = e.facts
            if facts.defs is not None and facts.terms is not None:
                continue
            if facts.defs is None:
                raw = self.bytes_of(e) if is_code(e.path) else None
                facts.defs = definitions(e.path, raw) if raw else ""
            facts.terms = subword_terms(facts.defs)
            self.new_facts[e.blob] = facts

    def planned(self, e: Entry, estimate: EstimateCounter) -> int:
        """Planned tokens of a file's whole section: its text and the frame around it."""
        return self.tokens.get(e, 0) + (self.cost.get(e) or section_cost(e, estimate))


def section_cost(e: Entry, estimate: EstimateCounter) -> int:
    """Planned tokens of a file's section around its text (heading, fences, language tag): the
    estimate of a frame at least as long as the real one, without building it."""
    path = e.path
    chars = len(path) + 2 * len(path.rsplit("/", 1)[-1]) // 3 + 24  # heading, fences, language tag, quoting
    if e.flags or (e.facts is not None and (e.facts.encoding != "utf-8" or not e.facts.final_newline)):
        chars += 80
    extra = 0 if path.isascii() else len(path.encode("utf-8", "surrogateescape")) - len(path)
    return estimate.from_shape(chars, 2 * extra)


class Packer:
    """Packs repositories with one set of rules, one token counter and one cache store.

    `include` / `exclude`: globs (gitignore syntax); `max_file_bytes`: larger files are listed, not
    packed; `outline_share` of a budget (at most `outline_max_tokens`) shows outlines of the most
    relevant files the budget left out; `counter` (default: the estimate) counts tokens; `store`
    keeps facts, counts, outlines and orders by git blob id: a PackCache, True (the user's cache,
    opened for each pack: the default) or None.

        packer = Packer.from_config(config.context, counter=ServerCounter(url))
        pack = packer.pack(Path("."), issue=issue_text, budget=200_000)
    """

    def __init__(self, *, counter: TokenCounter | None = None, store: PackCache | bool | None = True,
                 include: tuple[str, ...] | list[str] = (), exclude: tuple[str, ...] | list[str] = (),
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, outline_share: float = DEFAULT_OUTLINE_SHARE,
                 outline_max_tokens: int = DEFAULT_OUTLINE_MAX_TOKENS) -> None:
        check(None, max_file_bytes, 0.0, outline_share, outline_max_tokens)
        self.counter = counter or EstimateCounter()
        # What plans: the counter itself when it is the estimate, else the default estimate.
        self.estimating = isinstance(self.counter, EstimateCounter)
        self.estimate = self.counter if self.estimating else EstimateCounter()
        self.cache = store  # a PackCache, True (open the user's for each pack) or None
        self.include = compile_globs(tuple(include), "include")
        self.exclude = compile_globs(tuple(exclude), "exclude")
        self.max_file_bytes = max_file_bytes
        self.outline_share, self.outline_max_tokens = outline_share, outline_max_tokens

    @classmethod
    def from_config(cls, context, counter: TokenCounter | None = None) -> Packer:
        """The packer of a `ContextConfig` (the `[context]` section), on the user's cache."""
        return cls(counter=counter, include=tuple(context.include), exclude=tuple(context.exclude),
                   max_file_bytes=context.max_file_bytes, outline_share=context.outline_share,
                   outline_max_tokens=context.outline_max_tokens)

    def pack(self, repo: Path | str, *, issue: str | None = None, budget: int | None = None,
             history: Path | str | None = None, order: PackOrder | None = None,
             store: PackCache | None = None) -> Pack:
        """Pack the repository at `repo` into one prompt text: a header, the packed files in `order`
        (default: least changed in the recent commits of `history`, or of `repo` when it is a git
        work tree), a tree of every file (packed or not, with skip reasons), the commit packed, and
        a footer. With `budget`, `pack.tokens <= budget` per the counter: when the repository does
        not fit, the order's `shared_share` of the budget is filled with the same files whatever the
        issue, then files are chosen by relevance to `issue`, and the outline tier shows the most
        relevant files left out. The issue itself is never part of the text. `store`: an open cache
        for this pack (default: the packer's)."""
        if store is None and isinstance(self.cache, PackCache):
            store = self.cache
        with PackCache() if store is None and self.cache is True else contextlib.nullcontext(store) as store:
            t0 = time.perf_counter()
            check(budget, self.max_file_bytes, order.shared_share if order is not None else 0.0,
                  self.outline_share, self.outline_max_tokens)
            root = os.path.abspath(os.path.expanduser(os.fspath(repo)))
            listing = list_files(root)
            if order is None and (history is not None or listing.git):  # least changed first, in `history` or `repo`
                order = StableOrder(os.fspath(history if history is not None else listing.root), store)
            plan = Plan(listing, Rules(root, self.include, self.exclude, self.max_file_bytes), issue=issue,
                        budget=budget, order=order, store=store)
            plan.timings["list_s"] = time.perf_counter() - t0
            t = time.perf_counter()
            self.decide(plan)
            plan.timings["read_s"] = time.perf_counter() - t
            t = time.perf_counter()
            self.count(plan)
            plan.timings["count_s"] = time.perf_counter() - t
            self.frame(plan)
            if budget is None:
                t = time.perf_counter()
                chosen = Chosen(plan.packable, [], [])
                parts, tokens = self.render(plan, chosen.files, [])
                plan.timings["render_s"] = time.perf_counter() - t
            else:
                chosen, parts, tokens = self.within_budget(plan)
            self.remember(plan)
            plan.timings["total_s"] = time.perf_counter() - t0
            return self.result(plan, chosen, parts, tokens)

    def decide(self, plan: Plan) -> None:
        """Each entry's fate (`reader.decide`), from cached facts where there are some; then the
        packable files in pack order. A budgeted pack reads only what no cached facts stand in for;
        a full pack reads all it packs."""
        plan.known, plan.stale = self.known_facts(plan)
        full = plan.budget is None
        for e in plan.entries:
            reader.decide(e, plan.rules, plan.known.get(e.blob) if e.blob else None, read=full,
                          raw=None if full else plan.raw)
        packable = [e for e in plan.entries if e.reason is None]
        if plan.order is not None:
            by_path = plan.order.key(e.path for e in packable)
            packable.sort(key=lambda e: by_path(e.path))
        plan.packable = packable
        plan.new_facts = {e.blob: e.facts for e in plan.entries
                          if e.blob and e.facts is not None and e.blob not in plan.known}

    def known_facts(self, plan: Plan) -> tuple[dict, bool]:
        """Cached facts of the plan's blobs: the index's snapshot (one read), else a lookup of each
        blob; and whether the snapshot is missing (it is then written)."""
        if plan.store is None:
            return {}, False
        index_key = plan.listing.index_key
        known = plan.store.get_snapshot(index_key) if index_key else {}
        if known:
            return known, False
        return plan.store.get_facts([e.blob for e in plan.entries if e.blob]), index_key is not None

    def remember(self, plan: Plan) -> None:
        """Keep the new facts, and the index's snapshot of all of them when it changed."""
        if plan.store is None:
            return
        if plan.new_facts:
            plan.store.put_facts(plan.new_facts)
        if plan.listing.index_key and (plan.new_facts or plan.stale):
            facts = {e.blob: e.facts for e in plan.entries if e.blob and e.facts is not None}
            plan.store.put_snapshot(plan.listing.index_key, facts)

    def count(self, plan: Plan) -> None:
        """Token counts of file texts: the estimate from facts, exact counts from the cache or the counter.

        With a budget, an exact counter is asked only about files a plan may choose: the others get a
        calibrated estimate (scaled to the exact counts known) until `count_exact` replaces it.
        """
        packable = plan.packable
        shape = self.estimate.from_shape
        if self.estimating:
            plan.tokens.update((e, shape(e.facts.chars, e.facts.extra)) for e in packable)
            return
        cached = plan.store.get_counts(self.counter.id, [e.blob for e in packable]) if plan.store else {}
        plan.tokens.update((e, cached[e.blob]) for e in packable if e.blob in cached)
        missing = [e for e in packable if e.blob not in cached]
        if plan.budget is None or len(missing) <= CALIBRATION_SAMPLES:
            self.count_exact(plan, missing)
            return
        known = [e for e in packable if e.blob in cached]
        if len(known) < CALIBRATION_SAMPLES:
            spread = sample(missing, CALIBRATION_SAMPLES)
            self.count_exact(plan, spread)
            known += spread
        scale = fit_scale(sum(shape(e.facts.chars, e.facts.extra) for e in known), sum(plan.tokens[e] for e in known))
        for e in missing:
            if e not in plan.tokens:
                plan.tokens[e] = math.ceil(shape(e.facts.chars, e.facts.extra) * scale * PLAN_MARGIN)
                plan.inexact.add(e)

    def count_exact(self, plan: Plan, entries: list[Entry]) -> None:
        """Count these files with the exact counter (one batch) and remember the counts."""
        todo = [e for e in entries if e not in plan.tokens or e in plan.inexact]
        if not todo:
            return
        plan.load(todo)
        counts = self.counter.count_many([str(e.content or b"", "utf-8") for e in todo])
        for e, n in zip(todo, counts):
            plan.tokens[e] = n
            plan.inexact.discard(e)
        if plan.store is not None:
            plan.store.put_counts(self.counter.id, {e.blob: plan.tokens[e] for e in todo})

    def prepare(self, plan: Plan, entries: list[Entry]) -> None:
        """Make chosen files ready to render: exact counts and contents."""
        self.count_exact(plan, entries)
        plan.load(entries)

    def frame(self, plan: Plan) -> None:
        """The text around the file sections: the header, the tree of every entry and the commit."""
        entries = plan.entries
        listing = plan.listing
        plan.head_text = layout.header()
        plan.source_text = layout.source(git=listing.git, head=listing.head, dirty=any(map(_changed, entries)),
                                         total=len(entries))
        plan.tree_text = layout.tree(entries) + plan.source_text

    def within_budget(self, plan: Plan) -> tuple[Chosen, layout.Rendered, int]:
        """The pack of the files that fit the budget, the most relevant to the issue first, then the
        outline tier: outlines of the most relevant files left out, within the tier's room."""
        plan.tree_text = self.tree_for_budget(plan)
        t = time.perf_counter()
        room = min(int(plan.budget * self.outline_share), self.outline_max_tokens)
        chosen, left_out = self.choose(plan, reserve=room)
        plan.timings["fit_s"] = time.perf_counter() - t

        t = time.perf_counter()
        outlined = self.outline_tier(plan, left_out, room)
        plan.timings["outline_s"] = time.perf_counter() - t

        t = time.perf_counter()
        self.prepare(plan, chosen)
        plan.outlines = {o.entry: o for o in outlined}
        parts, tokens = self.render(plan, chosen, left_out)
        # pack order, the shared part first in its own order (the same at every commit that shares it)
        place = {e: (True, i) for i, e in enumerate(plan.packable)}
        place.update((e, (False, i)) for i, e in enumerate(e for e in chosen if e in plan.shared))
        chosen, left_out, parts, tokens = self.fit_exactly(plan, chosen, left_out, (parts, tokens), place.__getitem__)
        plan.timings["render_s"] = time.perf_counter() - t
        left = set(left_out)
        return Chosen(chosen, left_out, [o for o in outlined if o.entry in left]), parts, tokens

    def tree_for_budget(self, plan: Plan) -> str:
        """The full tree, or when it would take over TREE_SHARE of the budget, the deepest shortened one that fits."""
        limit = plan.budget * TREE_SHARE
        if self.counter.count(plan.head_text + plan.tree_text) <= limit:
            return plan.tree_text
        deepest = max((e.path.count("/") for e in plan.entries), default=0)
        for depth in range(deepest - 1, -1, -1):
            shorter = layout.tree(plan.entries, max_depth=depth) + plan.source_text
            if self.counter.count(plan.head_text + shorter) <= limit:
                return shorter
        return plan.tree_text  # nothing fits: `fit_exactly` reports that the budget cannot hold the header and tree

    def choose(self, plan: Plan, reserve: int = 0) -> tuple[list[Entry], list[Entry]]:
        """Choose the files that fit the budget: all when they do, else the order's `shared_share` of
        the budget (of the pack, so that share of a batch's first requests is shared) filled by
        `shared_part`, then the most relevant first within the budget less `reserve` (the outline
        tier's room). Sets the plan's section costs, ranks and shared part."""
        packable, budget, estimate = plan.packable, plan.budget, self.estimate
        fixed = self.counter.count(plan.head_text + plan.tree_text + "## Files\n\n")
        for e in packable:
            plan.cost[e] = section_cost(e, estimate)
        costs = {e: plan.tokens.get(e, 0) + plan.cost[e] for e in packable}
        foot_all = estimate.count(layout.footer(packed=len(packable), total=len(plan.entries), budget_left=[]))
        if fixed + foot_all + sum(costs.values()) <= budget:
            for i, (_, e) in enumerate(rank(packable, None, tokens=plan.tokens)):
                plan.rank[e] = i  # in case the exact count of the whole text still calls for a trim
            return packable, []

        if plan.issue:
            plan.ensure_definitions()
        ranked = [e for _, e in rank(packable, plan.issue, plan.bytes_of, plan.store, tokens=plan.tokens)]
        foot = estimate.count(layout.footer(packed=len(packable), total=len(plan.entries),
                                            budget_left=ranked[:25])) + 8
        room = budget - fixed - foot - reserve
        alike, share = (plan.order.alike, plan.order.shared_share) if plan.order is not None else (None, 0.0)
        shared = shared_part(packable, costs, min(room, int(budget * share)), alike)
        plan.shared = set(shared)
        room -= sum(costs[e] for e in shared)
        taken = set(shared)
        for e in ranked:
            c = costs[e]
            if c <= room and e not in taken:
                taken.add(e)
                room -= c
        for i, e in enumerate(ranked):
            plan.rank[e] = i - len(ranked) if e in plan.shared else i  # the shared part is trimmed last
        chosen = shared + [e for e in packable if e in taken and e not in plan.shared]
        return chosen, [e for e in ranked if e not in taken]

    def outline_tier(self, plan: Plan, left_out: list[Entry], room: int) -> list[outline.Outlined]:
        """Outlines of the files left out, most relevant first, planned within `room` tokens."""
        if not left_out or room <= 0:
            return []
        estimate = self.estimate
        exact = None if self.estimating else (
            lambda chosen: self.counter.count(layout.outlines([(o.entry.path, o.text) for o in chosen])))
        return outline.plan(left_out, room - estimate.count(layout.OUTLINES_HEAD), plan.bytes_of, plan.store,
                            lambda e, text: estimate.count(layout.outline_section(e.path, text)), exact)

    def render(self, plan: Plan, chosen: list[Entry], left_out: list[Entry]) -> tuple[layout.Rendered, int]:
        """The pack's byte pieces (named: head, sections, tail) and the token count of their text;
        the outlines planned of files still left out are shown, in `left_out`'s order."""
        outlines = plan.outlines
        shown = [outlines[e] for e in left_out if e in outlines] if outlines else []
        foot = layout.footer(packed=len(chosen), total=len(plan.entries), budget_left=left_out, outlined=len(shown))
        pieces = layout.render(plan.head_text, plan.tree_text, chosen, foot,
                               layout.outlines([(o.entry.path, o.text) for o in shown]))
        if self.estimating:
            # The estimate depends on characters and extra UTF-8 bytes only, which add up over parts.
            chars, extra = text_shape(pieces.frame)
            for e in chosen:
                chars += e.facts.chars
                extra += e.facts.extra
            return pieces._replace(frame=""), self.counter.from_shape(chars, extra)
        return pieces._replace(frame=""), self.counter.count(b"".join(pieces.parts).decode("utf-8", "replace"))

    def fit_exactly(self, plan: Plan, chosen: list[Entry], left_out: list[Entry], rendered: tuple[layout.Rendered, int],
                    order) -> tuple[list[Entry], list[Entry], layout.Rendered, int]:
        """Hold the plan to the exact count of the text (`rendered`: its pieces and count): drop the
        least relevant files while over the budget, then fill the slack a cautious plan leaves with
        the most relevant of the rest; `order` is the sort key of the pack order."""
        data, tokens = rendered
        budget = plan.budget
        while tokens > budget:
            if not chosen:
                raise UsageError(f"a budget of {budget} tokens cannot hold even the header and tree of this "
                                 f"repository ({tokens} tokens): raise --budget or exclude paths")
            chosen, left_out = self.trim(plan, chosen, left_out, tokens - budget)
            data, tokens = self.render(plan, chosen, left_out)
        generous = True  # first count on the footer's list of left-out files to shrink too, then not
        for _ in range(TOP_UP_ROUNDS):
            if not left_out:
                break
            slack = budget - tokens
            if generous:  # a try only: the exact count of the grown text decides
                slack += self.footer_saving(plan, chosen, left_out) + max(16, slack // 50)
            more = self.top_up(plan, left_out, slack)
            if not more:
                break
            self.prepare(plan, more)
            added = set(more)
            grown = sorted(chosen + more, key=order)
            rest = [e for e in left_out if e not in added]
            grown_data, grown_tokens = self.render(plan, grown, rest)
            if grown_tokens > budget:
                if not generous:
                    break
                generous = False
                continue
            chosen, left_out, data, tokens = grown, rest, grown_data, grown_tokens
        return chosen, left_out, data, tokens

    def footer_saving(self, plan: Plan, chosen: list[Entry], left_out: list[Entry]) -> int:
        """Tokens the footer's list of left-out files costs now (it goes when they all fit)."""
        total = len(plan.entries)
        now = layout.footer(packed=len(chosen), total=total, budget_left=left_out)
        return max(0, self.estimate.count(now) - self.estimate.count(layout.footer(packed=total, total=total,
                                                                                   budget_left=[])))

    def top_up(self, plan: Plan, left_out: list[Entry], slack: int) -> list[Entry]:
        """Left-out files, most relevant first, whose planned cost fits in `slack` tokens."""
        more = []
        for e in left_out:
            cost = plan.planned(e, self.estimate)
            if cost <= slack:
                more.append(e)
                slack -= cost
        return more

    def trim(self, plan: Plan, chosen: list[Entry], left_out: list[Entry],
             over: int) -> tuple[list[Entry], list[Entry]]:
        """Drop the least relevant chosen files until about `over` tokens (plus a margin) are gone."""
        by_rank = sorted(chosen, key=lambda e: -plan.rank.get(e, 0))
        target = over + max(8, over // 20)
        dropped, freed = [], 0
        for e in by_rank:
            if freed >= target:
                break
            dropped.append(e)
            freed += plan.planned(e, self.estimate)
        gone = set(dropped)
        return [e for e in chosen if e not in gone], sorted(left_out + dropped, key=lambda e: plan.rank.get(e, 0))

    def result(self, plan: Plan, chosen: Chosen, parts: layout.Rendered, tokens: int) -> Pack:
        """The pack; its lists of packed and skipped files are made when first asked for."""
        outlined = chosen.outlined
        outline_tokens = (self.counter.count(layout.outlines([(o.entry.path, o.text) for o in outlined]))
                          if outlined else 0)  # the tier's text, its heading and note included
        info = PackInfo(self.counter.kind, plan.budget, plan.listing.head, len(plan.entries), len(chosen.files),
                        [o.entry.path for o in outlined], outline_tokens)
        return Pack(parts, tokens, info, lists=Fates(plan.entries, chosen.files, chosen.left_out, plan.tokens),
                    timings=plan.timings)


class Chosen(NamedTuple):
    """What a pack holds: the files with their text (in pack order), the files the budget left out
    (most relevant first) and the outlines shown of them."""

    files: list[Entry]
    left_out: list[Entry]
    outlined: list[outline.Outlined]


def shared_part(packable: list[Entry], costs: dict[Entry, int], room: int,
                alike: list[list[str]] | None = None) -> list[Entry]:
    """The budget's part that is the same whatever the issue, in its layout order.

    With `alike` (per group of a batch's commits this one is in, the files alike at all of them, in
    the order the batch stored), files of one group that fit `room`, in that order: the same bytes
    at each of the group's commits. Without, source files (not tests) in pack order, least changed
    first, up to the first that does not fit, so it is a prefix of that order for every issue and,
    until those files change, every commit."""
    if alike is not None:
        return _shared_alike(packable, costs, room, alike)
    shared: list[Entry] = []
    for e in packable:
        if not is_code(e.path) or is_test(e.path):
            continue
        if costs[e] > room:
            break
        shared.append(e)
        room -= costs[e]
    return shared


def _shared_alike(packable: list[Entry], costs: dict[Entry, int], room: int,
                  groups: list[list[str]]) -> list[Entry]:
    """The files of one of `groups` (lists of files alike at every commit of a group, the lowest
    threshold's first: see `m3_agent.evals.reuse.ordering.shared_files`) that are packable and fit `room`, in its order
    (see `shared_part`): the first group whose files fill the room, else the one with the most.
    (Alike files cost the same at every commit of their group, so each commit of it chooses alike.)"""
    by_path = {e.path: e for e in packable}
    weight = [sum(costs[by_path[p]] for p in g if p in by_path) for g in groups]
    best = next((n for n, w in enumerate(weight) if w >= room), max(range(len(groups)), key=weight.__getitem__))
    shared: list[Entry] = []
    for path in groups[best]:
        e = by_path.get(path)
        if e is None or costs[e] > room:
            continue
        shared.append(e)
        room -= costs[e]
    return shared


def _changed(e: Entry) -> bool:
    """Whether the working tree differs from the commit at this entry (untracked, or modified)."""
    return e.untracked or (e.index_blob is not None and e.blob != e.index_blob)


def check(budget: int | None, max_file_bytes: int, shared_share: float, outline_share: float,
          outline_max_tokens: int) -> None:
    """Refuse settings a pack cannot be made with (UsageError, naming the setting)."""
    if budget is not None and budget <= 0:
        raise UsageError(f"the token budget must be positive, got {budget}")
    if max_file_bytes <= 0:
        raise UsageError(f"max_file_bytes must be positive, got {max_file_bytes}")
    if not 0.0 <= shared_share < 1.0:
        raise UsageError(f"shared_share must be at least 0 and below 1, got {shared_share}")
    if not 0 <= outline_share <= 0.5:
        raise UsageError(f"the outline share must be between 0 and 0.5 of the budget, got {outline_share}")
    if outline_max_tokens < 0:
        raise UsageError(f"outline_max_tokens must be at least 0, got {outline_max_tokens}")
