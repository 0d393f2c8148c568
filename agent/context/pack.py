"""`pack_repository`: a whole repository as one byte-deterministic prompt, within a token budget."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from pathlib import Path
from typing import NamedTuple

from m3_agent.agent.context import layout, outline
from m3_agent.agent.context.cache import PackCache
from m3_agent.agent.context.outline import DEFAULT_OUTLINE_MAX_TOKENS, DEFAULT_OUTLINE_SHARE
from m3_agent.agent.context.reader import Rules, decide, load, read_bytes
from m3_agent.agent.context.relevance import is_test, rank
from m3_agent.agent.context.stability import StableOrder
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
from m3_agent.agent.context.tokens import EstimateCounter, TokenCounter, text_shape
from m3_agent.errors import UsageError

# Exact counts are planned with a calibrated estimate and checked; a plan this much over is re-cut.
TOP_UP_ROUNDS = 2
TREE_SHARE = 0.5  # the tree may take at most this share of a budget before it is shortened
CALIBRATION_SAMPLES = 32  # files counted exactly to scale the estimate that plans a budget
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


class Pack:
    """A packed repository. `text` goes first in the prompt; the issue goes after it, separately.

    The text is kept as UTF-8 byte pieces (`parts`, which `write` saves one after another, without
    joining them), joined into `data` and decoded into `text` on first use.
    """

    def __init__(self, *, files: list[PackedFile] | None = None, skipped: list[SkippedFile] | None = None, tokens: int,
                 counter_kind: str, budget: int | None = None, head: str | None = None, total_files: int = 0,
                 timings: dict[str, float] | None = None, parts: tuple = (), listed=None, counted=None,
                 packed_count: int | None = None, outlined: list[str] | None = None, outline_tokens: int = 0,
                 delta_base: str | None = None) -> None:
        self._files = files
        self._skipped = skipped
        self._listed = listed  # () -> (files, skipped): the lists made on first use
        self._counted = counted  # () -> (packed tokens, {reason: files}): without making the lists
        self.packed_count = len(files) if files is not None else packed_count  # files with their text in the pack
        self.outlined = outlined or []  # files left out by the budget shown as outlines, most relevant first
        self.outline_tokens = outline_tokens  # tokens of the outline tier (part of `tokens`)
        self.delta_base = delta_base  # a delta pack: the commit whose files its sections show
        self.tokens = tokens  # tokens of `text` per the counter
        self.counter_kind = counter_kind  # "server" | "tokenizer.json" | "estimate"
        self.budget = budget
        self.head = head  # the commit packed, when the repository is a git work tree
        self.total_files = total_files
        self.timings = timings if timings is not None else {}
        self.parts = parts
        self._cache: dict = {}

    @property
    def files(self) -> list[PackedFile]:
        """The packed files, in pack order."""
        if self._files is None:
            self._files, self._skipped = self._listed()
        return self._files

    @property
    def skipped(self) -> list[SkippedFile]:
        """The files the tree lists without their text, and why, in tree order."""
        if self._skipped is None:
            self._files, self._skipped = self._listed()
        return self._skipped

    def __repr__(self) -> str:
        return (f"Pack(files={len(self.files)}, skipped={len(self.skipped)}, tokens={self.tokens}, "
                f"counter_kind={self.counter_kind!r}, budget={self.budget})")

    @property
    def data(self) -> bytes:
        """The prompt text as UTF-8 bytes."""
        if "data" not in self._cache:
            self._cache["data"] = b"".join(self.parts)
        return self._cache["data"]

    @property
    def text(self) -> str:
        """The prompt text: header, tree, file sections, footer. Byte-deterministic."""
        if "text" not in self._cache:
            self._cache["text"] = self.data.decode("utf-8", "replace")
        return self._cache["text"]

    def write(self, path: Path | str) -> None:
        """Save the text (UTF-8) to a file."""
        with open(path, "wb") as f:
            self.write_to(f)

    def write_to(self, stream) -> None:
        """Write the text to a binary stream, piece by piece."""
        if "data" in self._cache:
            stream.write(self._cache["data"])
        else:
            stream.writelines(self.parts)

    def skipped_by_reason(self) -> dict[str, int]:
        """How many files each reason left out."""
        if self._skipped is None and self._counted is not None:
            return dict(sorted(self._counted()[1].items()))  # (sorted() copies: the cached counts stay as they are)
        out: dict[str, int] = {}
        for s in self.skipped:
            out[s.reason] = out.get(s.reason, 0) + 1
        return dict(sorted(out.items()))

    def packed_tokens(self) -> int:
        """Tokens of the packed files' texts (without their headings and fences)."""
        if self._files is None and self._counted is not None:
            return self._counted()[0]
        return sum(f.tokens for f in self.files)


def _tree_order(e: Entry) -> str:
    return layout.sort_key(e.path)


def _flags(e: Entry) -> list[str]:
    return (["symlink"] if e.kind == "symlink" else []) + layout.content_flags(e)


def pack_repository(
    repo: Path | str,
    *,
    issue: str | None = None,
    budget: int | None = None,
    counter: TokenCounter | None = None,
    include: tuple[str, ...] | list[str] = (),
    exclude: tuple[str, ...] | list[str] = (),
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    cache: PackCache | bool = True,
    history: Path | str | None = None,
    order=None,
    outline_share: float = DEFAULT_OUTLINE_SHARE,
    outline_max_tokens: int = DEFAULT_OUTLINE_MAX_TOKENS,
) -> Pack:
    """Pack the repository at `repo` into one prompt text.

    The text is a header, the packed files in `order` (default: `stability.StableOrder`, those least
    changed in the recent commits of `history`, default `repo` itself, first), a tree of every file
    (packed or not, with skip reasons), the commit packed, and a footer. With `budget`,
    `pack.tokens <= budget` per `counter` (default: the estimate); when the repository does not fit,
    files are chosen by relevance to `issue`, after `order.shared_share` of the budget (at most the
    room the header, tree and footer leave; none by default) is filled with the same files whatever
    the issue (`order.alike`, else the least changed source files: a batch's issues then share that
    prefix in the server's cache), and up to `outline_share` of the budget (at most
    `outline_max_tokens`) shows outlines of the most relevant files left out (their definitions,
    after the tree). The issue itself is never part of the text. `cache` (on by default) keeps facts
    and token counts by git blob id under the user's cache directory.
    """
    t0 = time.perf_counter()
    _check(budget, max_file_bytes, order.shared_share if order is not None else 0.0, outline_share,
           outline_max_tokens)
    counter = counter or EstimateCounter()
    root = os.path.abspath(os.path.expanduser(os.fspath(repo)))
    rules = Rules(root, compile_globs(tuple(include), "include"), compile_globs(tuple(exclude), "exclude"),
                  max_file_bytes)
    listing = list_files(root)
    timings = {"list_s": time.perf_counter() - t0}
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(PackCache()) if cache is True else cache or None
        if order is None and (history is not None or listing.git):
            order = StableOrder(os.fspath(history) if history is not None else root, store)
        return _pack(listing, store, rules, issue, budget, counter, timings, t0, order,
                     (outline_share, outline_max_tokens))


def _check(budget: int | None, max_file_bytes: int, shared_share: float, outline_share: float,
           outline_max_tokens: int) -> None:
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


def _pack(listing: Listing, store: PackCache | None, rules: Rules, issue: str | None, budget: int | None,
          counter: TokenCounter, timings: dict[str, float], t0: float, order, outline_room: tuple[float, int]) -> Pack:
    """Decide every entry, count, choose (within `budget`, when there is one), render."""
    t = time.perf_counter()
    entries = sorted(listing.entries, key=_tree_order)
    known, stale = _known_facts(store, listing, entries)
    raw: dict[str, bytes] = {}  # bytes of the files read, kept for relevance
    for e in entries:  # a budgeted pack reads only what no cached facts stand in for; a full pack, all it packs
        decide(e, rules, known.get(e.blob) if e.blob else None, read=budget is None,
               raw=None if budget is None else raw)
    packable = [e for e in entries if e.reason is None]
    if order is not None:
        by_path = order.key(e.path for e in packable)
        packable.sort(key=lambda e: by_path(e.path))
    new_facts = {e.blob: e.facts for e in entries if e.blob and e.facts is not None and e.blob not in known}
    timings["read_s"] = time.perf_counter() - t

    t = time.perf_counter()
    _count_files(packable, counter, store, listing, rules.limit, budget)
    timings["count_s"] = time.perf_counter() - t

    head_text = layout.header()
    source_text = layout.source(git=listing.git, head=listing.head, dirty=any(map(_changed, entries)),
                                total=len(entries))
    tree_text = layout.tree(entries) + source_text
    if budget is None:
        t = time.perf_counter()
        chosen, left_out, outlined = packable, [], []
        parts, tokens = _render(chosen, left_out, entries=entries, head_text=head_text, tree_text=tree_text,
                                counter=counter)
        timings["render_s"] = time.perf_counter() - t
    else:
        chosen, left_out, parts, tokens, outlined = _render_within(
            packable, entries, head_text, tree_text, issue, budget, counter, listing, store, new_facts, raw,
            rules.limit, timings, source_text, (order.shared_share if order else 0.0, *outline_room),
            order.alike if order else None)
    _remember(store, listing, _facts_by_blob(entries), new_facts, stale)
    timings["total_s"] = time.perf_counter() - t0
    return _result(entries, chosen, left_out, parts, tokens, counter, budget, listing, timings, outlined)


def _render_within(packable: list[Entry], entries: list[Entry], head_text: str, tree_text: str, issue: str | None,
                   budget: int, counter: TokenCounter, listing: Listing, store: PackCache | None, new_facts: dict,
                   raw: dict[str, bytes], max_file_bytes: int,
                   timings: dict[str, float], source_text: str,
                   shares: tuple[float, float, int], alike: list[list[str]] | None = None,
                   ) -> tuple[list[Entry], list[Entry], list, int, list[outline.Outlined]]:
    """The pack of the files that fit `budget`, the most relevant to `issue` first, then the outline
    tier: outlines of the most relevant files left out. `shares`: of the budget, the shared part's
    and the outline tier's, and the tier's most tokens; `alike`: the files the shared part may hold
    (see `_shared_part`)."""
    shared_share, outline_share, outline_max = shares
    tree_text = _tree_for_budget(entries, head_text, tree_text, budget, counter, source_text)
    t = time.perf_counter()
    room = min(int(budget * outline_share), outline_max)
    chosen, left_out = _fit(packable, entries, head_text, tree_text, issue, budget, counter,
                            listing, store, new_facts, raw, max_file_bytes, shared_share, reserve=room, alike=alike)
    timings["fit_s"] = time.perf_counter() - t

    t = time.perf_counter()
    outlined = _outline_tier(left_out, room, counter, listing, store, raw, max_file_bytes)
    timings["outline_s"] = time.perf_counter() - t

    t = time.perf_counter()
    _prepare(chosen, counter, store, listing, max_file_bytes)
    render = functools.partial(_render, entries=entries, head_text=head_text, tree_text=tree_text, counter=counter,
                               outlined={id(o.entry): o for o in outlined})
    parts, tokens = render(chosen, left_out)
    # pack order, the shared part first in its own order (the same at every commit that shares it)
    place = {id(e): (True, i) for i, e in enumerate(packable)}
    place.update((id(e), (False, i)) for i, e in enumerate(e for e in chosen if e.shared))
    chosen, left_out, parts, tokens = _fit_exactly(
        chosen, left_out, parts, tokens, budget, len(entries), counter, render,
        lambda more: _prepare(more, counter, store, listing, max_file_bytes), lambda e: place[id(e)])
    timings["render_s"] = time.perf_counter() - t
    left_ids = {id(e) for e in left_out}
    return chosen, left_out, parts, tokens, [o for o in outlined if id(o.entry) in left_ids]


def _outline_tier(left_out: list[Entry], room: int, counter: TokenCounter, listing: Listing,
                  store: PackCache | None, raw: dict[str, bytes], max_file_bytes: int) -> list[outline.Outlined]:
    """Outlines of the files left out, most relevant first, planned within `room` tokens."""
    if not left_out or room <= 0:
        return []
    estimate = counter if isinstance(counter, EstimateCounter) else EstimateCounter()
    exact = None if isinstance(counter, EstimateCounter) else (
        lambda chosen: counter.count(layout.outlines([(o.entry.path, o.text) for o in chosen])))
    return outline.plan(left_out, room - estimate.count(layout.OUTLINES_HEAD),
                        functools.partial(_bytes_of, listing=listing, data=raw, max_file_bytes=max_file_bytes), store,
                        lambda e, text: estimate.count(layout.outline_section(e.path, text)), exact)


def _changed(e: Entry) -> bool:
    """Whether the working tree differs from the commit at this entry (untracked, or modified)."""
    return e.untracked or (e.index_blob is not None and e.blob != e.index_blob)


def _known_facts(store: PackCache | None, listing: Listing, entries: list[Entry]) -> tuple[dict, bool]:
    """Cached facts of these entries' blobs: the index's snapshot (one read), else a lookup of each
    blob; and whether the snapshot is missing (it is then written)."""
    if store is None:
        return {}, False
    known = store.get_snapshot(listing.index_key) if listing.index_key else {}
    if known:
        return known, False
    return store.get_facts([e.blob for e in entries if e.blob]), listing.index_key is not None


def _facts_by_blob(entries: list[Entry]) -> dict:
    return {e.blob: e.facts for e in entries if e.blob and e.facts is not None}


def _remember(store: PackCache | None, listing: Listing, facts: dict, new: dict, stale: bool) -> None:
    """Keep the new facts, and the index's snapshot of all of them when it changed."""
    if store is None:
        return
    if new:
        store.put_facts(new)
    if listing.index_key and (new or stale):
        store.put_snapshot(listing.index_key, facts)


def _result(entries: list[Entry], chosen: list[Entry], left_out: list[Entry], parts: list, tokens: int,
            counter: TokenCounter, budget: int | None, listing: Listing, timings: dict[str, float],
            outlined: list[outline.Outlined]) -> Pack:
    """The pack; its lists of packed and skipped files are made when first asked for."""

    @functools.cache
    def fates() -> list[tuple[Entry, str | None]]:
        """Each entry with why it has no text in the pack (None when it has)."""
        chosen_ids = {id(e) for e in chosen}
        left_ids = {id(e) for e in left_out}
        return [(e, None if id(e) in chosen_ids else "budget" if id(e) in left_ids else e.reason or "unknown")
                for e in entries]

    def listed() -> tuple[list[PackedFile], list[SkippedFile]]:
        files, skipped = [], []
        for e, reason in fates():
            if reason is None:
                files.append(PackedFile(e.path, e.tokens or 0, e.size or 0, _flags(e)))
            else:
                skipped.append(SkippedFile(e.path, reason, e.detail))
        return files, skipped

    @functools.cache  # (asked twice by a summary: the tokens, then the reasons)
    def counted() -> tuple[int, dict[str, int]]:
        packed_tokens, by_reason = 0, {}
        for e, reason in fates():
            if reason is None:
                packed_tokens += e.tokens or 0
            else:
                by_reason[reason] = by_reason.get(reason, 0) + 1
        return packed_tokens, by_reason

    return Pack(tokens=tokens, counter_kind=counter.kind, budget=budget, head=listing.head, total_files=len(entries),
                timings=timings, parts=tuple(parts), listed=listed, counted=counted, packed_count=len(chosen),
                outlined=[o.entry.path for o in outlined], outline_tokens=_outline_tokens(outlined, counter))


def _outline_tokens(outlined: list[outline.Outlined], counter: TokenCounter) -> int:
    """Tokens of the outline tier's text (its heading and note included), per the pack's counter."""
    if not outlined:
        return 0
    return counter.count(layout.outlines([(o.entry.path, o.text) for o in outlined]))


def _prepare(entries: list[Entry], counter: TokenCounter, store: PackCache | None, listing: Listing,
             max_file_bytes: int) -> None:
    """Make chosen files ready to render: exact counts and contents."""
    _count_exact(entries, counter, store, listing, max_file_bytes)
    for e in entries:
        if e.content is None:
            load(str(listing.root), e, max_file_bytes)


def _fit_exactly(chosen: list[Entry], left_out: list[Entry], data: list, tokens: int, budget: int, total: int,
                 counter: TokenCounter, render, prepare, order) -> tuple[list[Entry], list[Entry], list, int]:
    """Hold the plan to the exact count of the text: drop the least relevant files while over the
    budget, then fill the slack a cautious plan leaves with the most relevant of the rest."""
    while tokens > budget:
        if not chosen:
            raise UsageError(f"a budget of {budget} tokens cannot hold even the header and tree of this "
                             f"repository ({tokens} tokens): raise --budget or exclude paths")
        chosen, left_out = _trim(chosen, left_out, tokens - budget, counter)
        data, tokens = render(chosen, left_out)
    generous = True  # first count on the footer's list of left-out files to shrink too, then not
    for _ in range(TOP_UP_ROUNDS):
        if not left_out:
            break
        slack = budget - tokens
        if generous:  # a try only: the exact count of the grown text decides
            slack += _footer_saving(chosen, left_out, total, counter) + max(16, slack // 50)
        more = _top_up(left_out, slack, counter)
        if not more:
            break
        prepare(more)
        added = {id(e) for e in more}
        grown = sorted(chosen + more, key=order)
        rest = [e for e in left_out if id(e) not in added]
        grown_data, grown_tokens = render(grown, rest)
        if grown_tokens > budget:
            if not generous:
                break
            generous = False
            continue
        chosen, left_out, data, tokens = grown, rest, grown_data, grown_tokens
    return chosen, left_out, data, tokens


def _tree_for_budget(entries: list[Entry], head_text: str, tree_text: str, budget: int, counter: TokenCounter,
                     source_text: str) -> str:
    """The full tree, or when it would take over TREE_SHARE of the budget, the deepest shortened one that fits."""
    limit = budget * TREE_SHARE
    if counter.count(head_text + tree_text) <= limit:
        return tree_text
    deepest = max((e.path.count("/") for e in entries), default=0)
    for depth in range(deepest - 1, -1, -1):
        shorter = layout.tree(entries, max_depth=depth) + source_text
        if counter.count(head_text + shorter) <= limit:
            return shorter
    return tree_text  # nothing fits: the caller reports that the budget cannot hold the header and tree


def _count_files(packable: list[Entry], counter: TokenCounter, store: PackCache | None,
                 listing: Listing, max_file_bytes: int, budget: int | None) -> None:
    """Token counts of file texts: the estimate from facts, exact counts from the cache or the counter.

    With a budget, an exact counter is asked only about files a plan may choose: the others get a
    calibrated estimate (scaled to the exact counts known) until `_count_exact` replaces it.
    """
    if isinstance(counter, EstimateCounter):
        shape = counter.from_shape
        for e in packable:
            facts = e.facts
            e.tokens = shape(facts.chars, facts.extra)
        return
    cached = store.get_counts(counter.id, [e.blob for e in packable]) if store else {}
    missing = []
    for e in packable:
        if e.blob in cached:
            e.tokens = cached[e.blob]
        else:
            missing.append(e)
    if budget is None or len(missing) <= CALIBRATION_SAMPLES:
        _count_exact(missing, counter, store, listing, max_file_bytes)
        return
    known = [e for e in packable if e.blob in cached]
    if len(known) < CALIBRATION_SAMPLES:
        sample = missing[:: max(1, len(missing) // CALIBRATION_SAMPLES)][:CALIBRATION_SAMPLES]
        _count_exact(sample, counter, store, listing, max_file_bytes)
        known += sample
    base = EstimateCounter()
    estimated = sum(base.from_shape(e.facts.chars, e.facts.extra) for e in known)
    scale = min(4.0, max(0.25, sum(e.tokens for e in known) / estimated)) if estimated else 1.0
    for e in missing:
        if e.tokens is None:
            e.tokens = math.ceil(base.from_shape(e.facts.chars, e.facts.extra) * scale * PLAN_MARGIN)
            e.exact = False


def _count_exact(entries: list[Entry], counter: TokenCounter, store: PackCache | None, listing: Listing,
                 max_file_bytes: int) -> None:
    """Count these files with the exact counter (one batch) and remember the counts."""
    todo = [e for e in entries if e.tokens is None or not e.exact]
    if not todo:
        return
    for e in todo:
        if e.content is None:
            load(str(listing.root), e, max_file_bytes)
    counts = counter.count_many([str(e.content or b"", "utf-8") for e in todo])
    for e, n in zip(todo, counts):
        e.tokens, e.exact = n, True
    if store is not None:
        store.put_counts(counter.id, {e.blob: e.tokens for e in todo})


def _section_cost(e: Entry, estimate: EstimateCounter) -> int:
    """Planned tokens of a file's section around its text (heading, fences, language tag): the
    estimate of a frame at least as long as the real one, without building it."""
    path = e.path
    chars = len(path) + 2 * len(path.rsplit("/", 1)[-1]) // 3 + 24  # heading, fences, language tag, quoting
    if e.flags or (e.facts is not None and (e.facts.encoding != "utf-8" or not e.facts.final_newline)):
        chars += 80
    extra = 0 if path.isascii() else len(path.encode("utf-8", "surrogateescape")) - len(path)
    return estimate.from_shape(chars, 2 * extra)


def _fit(packable: list[Entry], entries: list[Entry], head_text: str, tree_text: str, issue: str | None,
         budget: int, counter: TokenCounter, listing: Listing, store: PackCache | None, new_facts: dict,
         data: dict[str, bytes] | None, max_file_bytes: int, shared_share: float,
         reserve: int = 0, alike: list[list[str]] | None = None) -> tuple[list[Entry], list[Entry]]:
    """Choose the files that fit the budget: all when they do, else `shared_share` of the budget
    (of the pack, so that share of a batch's first requests is shared) filled by `_shared_part`
    (from `alike`, when given), then the most relevant first within the budget less `reserve` (the
    outline tier's room)."""
    estimate = counter if isinstance(counter, EstimateCounter) else EstimateCounter()
    fixed = counter.count(head_text + tree_text + "## Files\n\n")
    for e in packable:
        e.cost = _section_cost(e, estimate)
    costs = {id(e): (e.tokens or 0) + e.cost for e in packable}
    foot_all = estimate.count(layout.footer(packed=len(packable), total=len(entries), budget_left=[]))
    if fixed + foot_all + sum(costs.values()) <= budget:
        for i, (_, e) in enumerate(rank(packable, None)):
            e.rank = i  # in case the exact count of the whole text still calls for a trim
        return packable, []

    if issue:
        _ensure_definitions(packable, listing, store, new_facts, data, max_file_bytes)
    read = functools.partial(_bytes_of, listing=listing, data=data, max_file_bytes=max_file_bytes)
    ranked = [e for _, e in rank(packable, issue, read, store)]
    foot = estimate.count(layout.footer(packed=len(packable), total=len(entries), budget_left=ranked[:25])) + 8
    room = budget - fixed - foot - reserve
    shared = _shared_part(packable, costs, min(room, int(budget * shared_share)), alike)
    room -= sum(costs[id(e)] for e in shared)
    chosen_ids = {id(e) for e in shared}
    for e in ranked:
        c = costs[id(e)]
        if c <= room and id(e) not in chosen_ids:
            chosen_ids.add(id(e))
            room -= c
    for i, e in enumerate(ranked):
        e.rank = i - len(ranked) if e.shared else i  # the shared part is trimmed last
    chosen = shared + [e for e in packable if id(e) in chosen_ids and not e.shared]
    left_out = [e for e in ranked if id(e) not in chosen_ids]
    return chosen, left_out


def _shared_part(packable: list[Entry], costs: dict[int, int], room: int,
                 alike: list[list[str]] | None = None) -> list[Entry]:
    """The budget's part that is the same whatever the issue, in its layout order.

    With `alike` (per group of a batch's commits this one is in, the files alike at all of them, in
    the order `m3_agent.evals.reuse.ordering.order_for_commits` stored), files of one group that fit `room`, in that
    order: the same bytes at each of the group's commits. Without, source files (not tests) in pack
    order, least changed first, up to the first that does not fit, so it is a prefix of that order
    for every issue and, until those files change, every commit."""
    if alike is not None:
        return _shared_alike(packable, costs, room, alike)
    shared: list[Entry] = []
    for e in packable:
        if not is_code(e.path) or is_test(e.path):
            continue
        if costs[id(e)] > room:
            break
        e.shared = True
        shared.append(e)
        room -= costs[id(e)]
    return shared


def _shared_alike(packable: list[Entry], costs: dict[int, int], room: int,
                  groups: list[list[str]]) -> list[Entry]:
    """The files of one of `groups` (lists of files alike at every commit of a group, the lowest
    threshold's first: see `m3_agent.evals.reuse.ordering.shared_files`) that are packable and fit `room`, in its order
    (see `_shared_part`): the first group whose files fill the room, else the one with the most.
    (Alike files cost the same at every commit of their group, so each commit of it chooses alike.)"""
    by_path = {e.path: e for e in packable}
    weight = [sum(costs[id(by_path[p])] for p in g if p in by_path) for g in groups]
    best = next((n for n, w in enumerate(weight) if w >= room), max(range(len(groups)), key=weight.__getitem__))
    shared: list[Entry] = []
    for path in groups[best]:
        e = by_path.get(path)
        if e is None or costs[id(e)] > room:
            continue
        e.shared = True
        shared.append(e)
        room -= costs[id(e)]
    return shared


def _ensure_definitions(packable: list[Entry], listing: Listing, store: PackCache | None, new_facts: dict,
                        data: dict[str, bytes] | None, max_file_bytes: int) -> None:
    """Fill in the names each code file defines and their words (cached with its facts), for relevance."""
    for e in packable:
        if e.facts.defs is not None and e.facts.terms is not None:
            continue
        if e.facts.defs is None:
            e.facts.defs = _definitions_of(e, listing, data, max_file_bytes)
        e.facts.terms = subword_terms(e.facts.defs)
        new_facts[e.blob] = e.facts


def _definitions_of(e: Entry, listing: Listing, data: dict[str, bytes] | None, max_file_bytes: int) -> str:
    if not is_code(e.path):
        return ""
    raw = _bytes_of(e, listing=listing, data=data, max_file_bytes=max_file_bytes)
    return definitions(e.path, raw) if raw else ""


def _bytes_of(e: Entry, *, listing: Listing, data: dict[str, bytes] | None, max_file_bytes: int) -> bytes | None:
    """A file's bytes: those read while deciding, else from the disk (None when unreadable)."""
    raw = data.get(e.path) if data else None
    if raw is None:
        try:
            raw, _ = read_bytes(os.path.join(listing.root, e.path), max_file_bytes)
        except OSError:
            return None
    return raw


def _render(chosen: list[Entry], left_out: list[Entry], *, entries: list[Entry], head_text: str, tree_text: str,
            counter: TokenCounter, outlined: dict[int, outline.Outlined] | None = None) -> tuple[list, int]:
    """The pack's byte pieces and the token count of their text; `outlined` (by entry id) are the
    outlines planned, of which those of files still left out are shown, in `left_out`'s order."""
    shown = [outlined[id(e)] for e in left_out if id(e) in outlined] if outlined else []
    foot = layout.footer(packed=len(chosen), total=len(entries), budget_left=left_out, outlined=len(shown))
    parts, frame = layout.render(head_text, tree_text, chosen, foot,
                                 layout.outlines([(o.entry.path, o.text) for o in shown]))
    if isinstance(counter, EstimateCounter):
        # The estimate depends on characters and extra UTF-8 bytes only, which add up over parts.
        chars, extra = text_shape(frame)
        for e in chosen:
            chars += e.facts.chars
            extra += e.facts.extra
        return parts, counter.from_shape(chars, extra)
    return parts, counter.count(b"".join(parts).decode("utf-8", "replace"))


def _footer_saving(chosen: list[Entry], left_out: list[Entry], total: int, counter: TokenCounter) -> int:
    """Tokens the footer's list of left-out files costs now (it goes when they all fit)."""
    estimate = counter if isinstance(counter, EstimateCounter) else EstimateCounter()
    now = layout.footer(packed=len(chosen), total=total, budget_left=left_out)
    return max(0, estimate.count(now) - estimate.count(layout.footer(packed=total, total=total, budget_left=[])))


def _top_up(left_out: list[Entry], slack: int, counter: TokenCounter) -> list[Entry]:
    """Left-out files, most relevant first, whose planned cost fits in `slack` tokens."""
    estimate = counter if isinstance(counter, EstimateCounter) else EstimateCounter()
    more = []
    for e in left_out:
        cost = (e.tokens or 0) + (e.cost or _section_cost(e, estimate))
        if cost <= slack:
            more.append(e)
            slack -= cost
    return more


def _trim(chosen: list[Entry], left_out: list[Entry], over: int, counter: TokenCounter) -> tuple[list[Entry], list[Entry]]:
    """Drop the least relevant chosen files until about `over` tokens (plus a margin) are gone."""
    estimate = counter if isinstance(counter, EstimateCounter) else EstimateCounter()
    by_rank = sorted(chosen, key=lambda e: -e.rank)
    target = over + max(8, over // 20)
    dropped, freed = [], 0
    for e in by_rank:
        if freed >= target:
            break
        dropped.append(e)
        freed += (e.tokens or 0) + (e.cost or _section_cost(e, estimate))
    gone = {id(e) for e in dropped}
    return [e for e in chosen if id(e) not in gone], sorted(left_out + dropped, key=lambda e: e.rank)
