"""One token estimator: how many tokens the file texts of a whole pack hold, by the packer's own rules.

    estimate = estimate_tokens(repo)                      # a work tree, as it is on disk
    estimate = estimate_tokens(repo, commit, counter)     # a commit of a git repository, not checked out
    estimate.tokens, estimate.bytes, estimate.files, estimate.counter

What is left out is what a pack leaves out: the path rules (globs, lockfiles, vendored and generated
trees, minified and source-map names), files over `max_file_bytes`, and the content rules (binary,
generated, minified) from each file's facts: the ones the pack cache holds for its blob, else the
ones found by reading it. Each text counts as the pack's estimate counts it (`EstimateCounter`,
from its characters and extra UTF-8 bytes). With an exact `counter`, the estimate is first scaled to
it on a sample of the files (`EstimateCounter.calibrated`), as a budgeted pack scales the counts it plans with.
`m3-agent pack --counter estimate` and `eval run`'s admission use this; the packer's count step
shares its sample (`sample`) and scale (`tokens.fit_scale`).
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import NamedTuple

from m3_agent.agent.context.cache import PackCache
from m3_agent.agent.context.reader import Rules, decide, read_bytes
from m3_agent.agent.context.selection import (
    DEFAULT_MAX_FILE_BYTES,
    content_reason,
    decode,
    list_files,
    path_reason,
)
from m3_agent.agent.context.tokens import EstimateCounter, TokenCounter

CALIBRATION_SAMPLES = 32  # files counted exactly to scale the estimate


class EstimatedFile(NamedTuple):
    """A file whose text a whole pack holds: its path, git blob id (None when unknown) and size."""

    path: str
    blob: str | None
    size: int


class Estimate(NamedTuple):
    """The texts a whole pack of a tree holds: their `tokens` per `counter` (the estimate, scaled to
    an exact counter when one was given), their `bytes`, and the `files` (in tree order)."""

    tokens: int
    bytes: int
    files: list[EstimatedFile]
    counter: EstimateCounter


def sample(items: list, n: int = CALIBRATION_SAMPLES) -> list:
    """At most `n` items spread evenly over `items` (the first one included)."""
    return items[:: max(1, len(items) // n)][:n]


def estimate_tokens(source: Path | str, commit: str | None = None, counter: TokenCounter | None = None, *,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, store: PackCache | None = None) -> Estimate:
    """The tokens of the file texts a whole pack of `source` holds: its work tree as it is (`commit`
    None), or the tree of `commit` in the git repository `source`, read from git without a checkout.
    `store` (a PackCache) gives the facts of blobs it has seen and keeps the new ones."""
    root = os.path.abspath(os.fspath(source))
    texts = _at_commit(root, commit, max_file_bytes, store) if commit else _in_work_tree(root, max_file_bytes, store)
    estimate = counter or EstimateCounter()
    if not isinstance(estimate, EstimateCounter):  # scaled to the exact counter on a sample of the texts
        estimate = EstimateCounter().calibrated(estimate, [t for t in (read() for _, _, read in sample(texts)) if t])
    files = [f for f, _, _ in texts]
    tokens = sum(estimate.from_shape(facts.chars, facts.extra) for _, facts, _ in texts)
    return Estimate(tokens, sum(f.size for f in files), files, estimate)


def _in_work_tree(root: str, max_file_bytes: int, store: PackCache | None) -> list[tuple]:
    """(file, facts, read text) of each file a pack of the work tree holds, by `reader.decide`."""
    listing = list_files(root)
    entries = sorted(listing.entries, key=lambda e: e.path.replace("/", "\0"))
    known = store.get_facts([e.blob for e in entries if e.blob]) if store is not None else {}
    rules = Rules(root, None, None, max_file_bytes)
    for e in entries:
        decide(e, rules, known.get(e.blob) if e.blob else None, read=False)
    if store is not None:
        store.put_facts({e.blob: e.facts for e in entries if e.blob and e.facts is not None and e.blob not in known})
    return [(EstimatedFile(e.path, e.blob, e.facts.size), e.facts,
             functools.partial(_read_text, os.path.join(root, e.path), max_file_bytes))  # read when sampled
            for e in entries if e.reason is None]


def _read_text(path: str, max_file_bytes: int) -> str:
    """The text a pack shows of the file at `path` ("" when it cannot be read)."""
    try:
        return _text(read_bytes(path, max_file_bytes)[0])
    except OSError:
        return ""


def _at_commit(source: str, commit: str, max_file_bytes: int, store: PackCache | None) -> list[tuple]:
    """(file, facts, read text) of each file a pack of `commit`'s tree holds: path rules by name,
    size from git, content rules from the blob's facts (cached, else read with `git cat-file`)."""
    listed = subprocess.run(["git", "-C", source, "ls-tree", "-r", "-l", "-z", commit], capture_output=True,
                            timeout=120, check=True).stdout
    files = []
    for record in listed.decode("utf-8", "surrogateescape").split("\0"):
        meta, _, path = record.partition("\t")
        fields = meta.split()  # mode, type, object, size ("-" for a submodule)
        if len(fields) == 4 and fields[0] in ("100644", "100755") and fields[3].isdigit():
            size = int(fields[3])
            if path_reason(path) is None and size <= max_file_bytes:
                files.append(EstimatedFile(path, fields[2], size))
    files.sort(key=lambda f: f.path.replace("/", "\0"))
    known = store.get_facts([f.blob for f in files]) if store is not None else {}
    data = _blobs(source, [f.blob for f in files if f.blob not in known])
    new = {blob: decode(raw)[1] for blob, raw in data.items()}
    if store is not None and new:
        store.put_facts(new)
    facts = {**known, **new}
    return [(f, facts[f.blob], lambda blob=f.blob: _text(data.get(blob) or _blobs(source, [blob]).get(blob)))
            for f in files if f.blob in facts and content_reason(f.path, facts[f.blob], max_file_bytes, False) is None]


def _text(raw: bytes | None) -> str:
    """The text a pack shows of these bytes ("" for binary or none)."""
    content = decode(raw)[0] if raw else None
    return content.decode("utf-8", "replace") if content else ""


def _blobs(source: str, blobs: list[str]) -> dict[str, bytes]:
    """The contents of these blobs (one `git cat-file --batch`)."""
    if not blobs:
        return {}
    out = subprocess.run(["git", "-C", source, "cat-file", "--batch"], input="\n".join(blobs).encode() + b"\n",
                         capture_output=True, timeout=600, check=True).stdout
    found, at = {}, 0
    for blob in blobs:
        end = out.index(b"\n", at)
        header = out[at:end].split()
        at = end + 1
        if len(header) == 3:  # "<id> <type> <size>", then the content and a newline; else "<id> missing"
            size = int(header[2])
            found[blob] = out[at:at + size]
            at += size + 1
    return found
