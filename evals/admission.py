"""KV-aware admission and ordering for `eval run`: keep the running sessions inside the server's KV cache.

    capacity = capacity_from_metrics(base_url)          # vllm:cache_config_info on /metrics, or None
    tasks = order_for_reuse(tasks)                      # a repository's instances back to back
    admit = KvAdmit(capacity, workers=8, repos=repos, window=window)    # the runner's `admit` (RunOptions)
    admit(task, running_tasks)          # may it start? `admits`: expected contexts within the capacity

Why: a whole-repository prompt is hundreds of thousands of tokens. When the sessions running at
once need more KV than the server has, vLLM evicts their cached prefixes between turns and every
turn is prefilled again from scratch; and two instances of one repository share the pack's prefix
only if the second starts while the first's blocks are still cached. So the runner starts a new
instance only while the expected contexts of the running ones and the new one fit the cache, and
runs the instances of one repository one after another, oldest commit first. `--workers` stays an
upper bound: admission only ever lowers concurrency, and one instance always runs even if it alone
exceeds the cache.
"""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from m3_agent.agent.context.cache import PackCache
from m3_agent.agent.context.estimate import EstimatedFile, estimate_tokens
from m3_agent.agent.context.tokens import CHARS_PER_TOKEN, OUTPUT_RESERVE, ServerCounter  # as the pack counts
from m3_agent.agent.endpoint import EndpointClient
from m3_agent.evals.reuse import delta
from m3_agent.evals.reuse.ordering import Run, diff_bytes, stored_run
from m3_agent.errors import M3AgentError, UsageError
from m3_agent.evals.tasks import Task, repo_source

CACHE_CONFIG_INFO = "vllm:cache_config_info"
CALIBRATION_FILES = 16  # files of a tree the endpoint tokenizes to learn its bytes per token
GROWTH = 0.15  # a session's context grows past its first prompt by about this share (tool output, replies)
LEARN_AFTER = 3  # finished instances (or running ones, MIN_REQUESTS in) before their growth replaces the prior
MIN_REQUESTS = 3  # requests a running session has made before its growth is projected to its turn limit
DIFF_SAMPLE_COMMITS = 20  # the patches of this many commits calibrate a repository's bytes per diff token
DIFF_SAMPLE_BYTES = 256 * 1024


class KvCapacity(BaseModel):
    """How many tokens of KV cache the endpoint has, and where the figure came from."""

    tokens: int
    source: str


def parse_capacity(metrics_text: str, source: str = "/metrics") -> KvCapacity | None:
    """The KV capacity in vLLM's Prometheus text: num_gpu_blocks x block_size of vllm:cache_config_info.

    None when the server does not say (SGLang, or a vLLM whose cache is not sized yet).
    """
    try:
        families = list(text_string_to_metric_families(metrics_text))
    except ValueError:
        return None
    blocks = 0
    for family in families:
        for sample in family.samples:
            if sample.name != CACHE_CONFIG_INFO:
                continue
            try:
                # data-parallel engines each export their own pool; the endpoint has their sum
                blocks += int(sample.labels["num_gpu_blocks"])
                size = int(sample.labels["block_size"])
            except (KeyError, ValueError):
                return None
    return KvCapacity(tokens=blocks * size, source=source) if blocks else None


def capacity_from_metrics(base_url: str, *, timeout: float = 10.0) -> KvCapacity | None:
    """The endpoint's KV capacity from its /metrics (beside …/v1); None when it has no such page or does not say."""
    endpoint = EndpointClient(base_url, timeout=timeout)
    text = endpoint.metrics()
    return parse_capacity(text, source=endpoint.root + "/metrics") if text is not None else None


def capacity_from_profile(profile: str) -> KvCapacity:
    """The KV pool `m3-agent serve plan --profile` computes for a serving profile's machine."""
    from m3_agent.serving.endpoint import plan_request
    from m3_agent.serving.planner import BLOCK, GB, gpu_memory_for, plan
    from m3_agent.serving.profiles import build_command, get_profile

    p = get_profile(profile)
    result = plan(plan_request(p, build_command(p, "native"), p.gpus, gpu_memory_for(p.gpu)))
    tokens = int(result.kv_pool_gb * GB / result.kv_bytes_per_token) // BLOCK * BLOCK
    return KvCapacity(tokens=tokens, source=f"serve plan --profile {profile}")


def order_for_reuse(tasks: Sequence[Task]) -> list[Task]:
    """Instances of one repository back to back (repositories in first-seen order), oldest first within one.

    Neighbouring commits share the most files, so each instance's pack finds the longest prefix
    of the one before it still cached. Instances without `created_at` keep their given order.
    """
    first_seen: dict[str, int] = {}
    for t in tasks:
        first_seen.setdefault(t.repo, len(first_seen))
    return [t for _, t in sorted(enumerate(tasks), key=lambda it: (first_seen[it[1].repo], it[1].created_at or "", it[0]))]


@functools.lru_cache(maxsize=256)
def _files(source: str, commit: str) -> list[EstimatedFile]:
    """The files a whole pack of `commit` holds, by the packer's own rules (`estimate_tokens`: git,
    no checkout; the pack cache's facts stand in for reading blobs it has seen)."""
    with PackCache() as store:
        return estimate_tokens(source, commit, store=store).files


def _repo_bytes(task: Task, repos: Path | None) -> tuple[str, int | None] | None:
    """(the task's repository, the bytes of its text-looking files at `base_commit`, None when that
    cannot be read locally); None when the task names no repository (the instance reports it)."""
    try:
        source = repo_source(task, repos)
    except UsageError:
        return None
    return source, _tree_bytes(source, task.base_commit) if Path(source).exists() else None


@functools.lru_cache(maxsize=4096)
def _tree_bytes(source: str, commit: str) -> int | None:
    """Total size of the files a whole pack of `commit` holds; None if git cannot tell."""
    try:
        return sum(f.size for f in _files(source, commit))
    except (subprocess.SubprocessError, OSError):
        return None


def bytes_per_token(base_url: str, task: Task, repos: Path | None, *, api_key: str | None = None) -> float:
    """The endpoint's bytes per token on this repository: a sample of its files through /tokenize.

    The sample is the files found at evenly spaced points of the tree's bytes, so the ratio is
    weighted as the tree is. Falls back to the pack's estimate when the server has no /tokenize
    (SGLang) or the tree cannot be read.
    """
    try:
        source = repo_source(task, repos)
        blobs = _files(source, task.base_commit)
        total, chosen, seen = sum(b.size for b in blobs), [], 0
        marks = [total * (i + 0.5) / CALIBRATION_FILES for i in range(CALIBRATION_FILES)]
        for _path, oid, size in blobs:
            if marks and seen + size > marks[0]:
                chosen.append(oid)
                while marks and seen + size > marks[0]:
                    marks.pop(0)
            seen += size
        texts = [subprocess.run(["git", "-C", source, "cat-file", "blob", oid], capture_output=True, timeout=60,
                                check=True).stdout.decode("utf-8", "replace") for oid in chosen]
        tokens = sum(ServerCounter(base_url, api_key=api_key).count_many(texts))
    except (M3AgentError, subprocess.SubprocessError, OSError):  # no /tokenize, no tree: the documented estimate
        return CHARS_PER_TOKEN
    size = sum(len(t.encode()) for t in texts)
    return size / tokens if tokens and size else CHARS_PER_TOKEN


def diff_bytes_per_token(base_url: str, task: Task, repos: Path | None, *, api_key: str | None = None) -> float:
    """The endpoint's bytes per token on this repository's diffs: the patches of the last
    DIFF_SAMPLE_COMMITS commits up to `base_commit` (at most DIFF_SAMPLE_BYTES) through /tokenize.

    A delta pack's diff tokenizes denser than the files it changes (a `+`, `-` or space opens every
    line, hunk headers carry numbers): on pytest, 2.6 bytes per token where its files take 3.2.
    Falls back to `bytes_per_token` when the server has no /tokenize or the history cannot be read.
    """
    text = ""
    try:
        source = repo_source(task, repos)
        patch = subprocess.run(["git", "-C", source, "log", "-p", "--no-color", "--no-ext-diff", "--no-renames",
                                "--format=", f"-n{DIFF_SAMPLE_COMMITS}", task.base_commit],
                               capture_output=True, timeout=120, check=True).stdout[:DIFF_SAMPLE_BYTES]
        text = patch[: patch.rfind(b"\n") + 1].decode("utf-8", "replace")
        tokens = ServerCounter(base_url, api_key=api_key).count_many([text])[0] if text else 0
    except (M3AgentError, subprocess.SubprocessError, OSError):
        tokens = 0
    size = len(text.encode()) if tokens else 0
    return size / tokens if size else bytes_per_token(base_url, task, repos, api_key=api_key)


def expected_context(task: Task, repos: Path | None, window: int, *, per_token: float = CHARS_PER_TOKEN,
                     growth: int | None = None, tokens: float | None = None) -> int:
    """Tokens one instance is expected to hold at its largest: its pack plus growth, at most the window.

    The pack is estimated from the repository's size at `base_commit` at `per_token` bytes per token
    (`bytes_per_token` measures it on the endpoint); a repository that cannot be read locally
    counts as a full window (the safe side). `growth`: tokens a session adds to its first prompt
    (tool output, replies), as learned from finished ones; None: GROWTH of the pack plus OUTPUT_RESERVE.
    `tokens`: the pack's tokens when known otherwise (a delta pack: its base's files and the diff).
    """
    if tokens is None:
        found = _repo_bytes(task, repos)
        if found is None or found[1] is None:
            return window
        tokens = found[1] / per_token
    pack = min(tokens, window - OUTPUT_RESERVE)
    return min(window, int(pack) + (int(pack * GROWTH) + OUTPUT_RESERVE if growth is None else growth))


def admits(capacity_tokens: int | None, workers: int, candidate: int, running: Sequence[int]) -> bool:
    """True when an instance expected to hold `candidate` tokens may start beside `running`: while their
    expected contexts and its own fit the KV cache, under the `workers` cap; one always runs.

    `capacity_tokens` None (the server did not say) leaves only the `workers` cap.
    """
    if len(running) >= workers:
        return False
    if not running or capacity_tokens is None:
        return True
    return sum(running) + candidate <= capacity_tokens


def learn_capacity(base_url: str, profile: str | None = None) -> KvCapacity | None:
    """The endpoint's KV capacity: its /metrics first, else `serve plan` for the profile it was launched from."""
    found = capacity_from_metrics(base_url)
    if found is None and profile:
        found = capacity_from_profile(profile)
    return found


class Reuse(NamedTuple):
    """How the packs of a run reuse each other: delta packs (eval.delta), the share of a budgeted pack
    that is the same whatever the issue (eval.shared_share), the batch each repository's orders are
    stored under (`evals.reuse.ordering.batch_ids`), and each repository's bytes per token of diff."""

    delta: bool = False
    shared_share: float = 0.0
    batches: dict[str, str] = {}
    per_diff_token: dict[str, float] = {}


PROGRESS_EVENTS = ("run_start", "reply")  # the trajectory events `Progress` reads


def new_lines(path: Path, offset: int) -> tuple[list[bytes], int] | None:
    """The whole lines written to `path` past `offset`, and the offset after them (a line still being
    written waits for the next read); None when the file cannot be read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except OSError:
        return None
    whole = chunk[: chunk.rfind(b"\n") + 1]
    return whole.splitlines(), offset + len(whole)


class Progress:
    """What the trajectories of running instances say so far (agent.trajectory: one JSON object per
    event, flushed as it happens): per instance, its first prompt, its largest request (prompt +
    completion) and how many requests it made. Each file is read from where the last look stopped."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seen: dict[str, list[int]] = {}  # instance -> [offset, first prompt, peak, requests]

    def of(self, instance_id: str) -> tuple[int, int, int]:
        """(first prompt, peak, requests) of the instance's latest run; zeros before its first reply."""
        state = self.seen.setdefault(instance_id, [0, 0, 0, 0])
        got = new_lines(self.folder / f"{instance_id}.jsonl", state[0])
        if got is None:
            return 0, 0, 0
        lines, state[0] = got
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("kind") == "run_start":  # a retried instance appends a new run
                state[1:] = [0, 0, 0]
            elif event.get("kind") == "reply" and isinstance(event.get("usage"), dict):  # agent.model.Usage
                prompt, completion = event["usage"].get("prompt_tokens") or 0, event["usage"].get("completion_tokens") or 0
                state[1] = state[1] or prompt
                state[2], state[3] = max(state[2], prompt + completion), state[3] + 1
        return state[1], state[2], state[3]


class DeltaSize(NamedTuple):
    """A delta pack's root and run's base, and its tokens: the root's files, those and the diff to
    the base (what the run's packs share), the whole pack."""

    root: str
    base: str
    root_tokens: float
    run_tokens: float
    tokens: float


class KvAdmit:
    """The runner's `admit` callable: may `task` start beside the `running` ones? Their expected
    contexts, less what their packs share, must fit the KV capacity (`admits`).

    `per_token` maps a repository to its bytes per token (default: the pack's estimate); `reuse`:
    with `delta` the packs are delta packs (eval.delta), so instances of one run share their base's
    files, each diff at the repository's `per_diff_token` (default: `per_token`'s); `shared_share`
    (eval.shared_share): the share of a budgeted pack that is the same whatever the issue, the most
    two budgeted packs are credited with sharing; the orders are those stored under `batches`.

    Two things are learned from the instances that finished (`observe`, which `run_eval` calls with
    each result's first prompt and peak context), once LEARN_AFTER have:
    - a session's growth past its first prompt, which depends on the agent's limits and the tasks,
      not on the pack: until then GROWTH of the pack plus OUTPUT_RESERVE, then the largest growth
      a finished one showed. Before that, once LEARN_AFTER running instances have made
      MIN_REQUESTS requests each (their trajectories, `watch`), the largest of their growths so far
      projected to the turn limit: growth x `max_turns` / requests made;
    - per repository, how far the estimate of a first prompt fell short of the prompt sent (the
      system prompt, tool schemas, the pack's headers and tree, the issue; a sample's ratio): every
      pack estimate of the repository is then scaled by the largest shortfall seen, never below 1.
    """

    def __init__(self, capacity: KvCapacity | None, workers: int, *, repos: Path | None, window: int,
                 per_token: dict[str, float] | None = None, reuse: Reuse = Reuse(),
                 max_turns: int | None = None) -> None:
        self.capacity, self.workers = capacity.tokens if capacity else None, workers
        self.repos, self.window, self.ratios = repos, window, per_token or {}
        self.reuse, self.max_turns = reuse, max_turns
        self.grown: list[int] = []  # tokens each finished session added to its first prompt
        self.short: dict[str, list[float]] = {}  # repository -> each finished first prompt over its estimate
        self.progress: Progress | None = None
        self.projected: dict[str, int] = {}  # running instance -> its growth so far, projected to max_turns

    def watch(self, trajectories: Path) -> None:
        """Read running instances' progress from their trajectories in this folder (needs `max_turns`)."""
        self.progress = Progress(trajectories)

    def _look(self, running: list[Task]) -> None:
        """Project the growth of each running instance that made MIN_REQUESTS requests; forget the rest."""
        if self.progress is None or not self.max_turns:
            return
        self.projected = {}
        for t in running:
            first, peak, requests = self.progress.of(t.instance_id)
            if requests >= MIN_REQUESTS and peak >= first > 0:
                self.projected[t.instance_id] = (peak - first) * max(self.max_turns, requests) // requests

    def observe(self, first_prompt_tokens: int, peak_context_tokens: int, task: Task | None = None) -> None:
        """A finished instance's first prompt and largest request (prompt + completion); ignored when
        it sent none. With its `task`, the first prompt also measures the estimate of its pack."""
        if first_prompt_tokens <= 0 or peak_context_tokens < first_prompt_tokens:
            return
        self.grown.append(peak_context_tokens - first_prompt_tokens)
        estimate = self._first_prompt(task) if task is not None else None
        if estimate:
            self.short.setdefault(task.repo, []).append(first_prompt_tokens / estimate)

    @property
    def growth(self) -> int | None:
        """The growth admission charges a session: learned from the finished, else projected from the
        running; None (the prior) before LEARN_AFTER of either."""
        if len(self.grown) >= LEARN_AFTER:
            return max(self.grown)
        return max(self.projected.values()) if len(self.projected) >= LEARN_AFTER else None

    def scale(self, repo: str) -> float:
        """What the repository's pack estimates are multiplied by (1 before LEARN_AFTER of it finished)."""
        seen = self.short.get(repo, [])
        return max(1.0, *seen) if len(seen) >= LEARN_AFTER else 1.0

    def _batch(self, t: Task) -> str:
        """The batch `t`'s orders are stored under ("": none known)."""
        return self.reuse.batches.get(t.repo, "")

    def _ratio(self, repo: str) -> float:
        return self.ratios.get(repo, CHARS_PER_TOKEN)

    def _first_prompt(self, t: Task) -> float | None:
        """The unscaled estimate of `t`'s pack (its first prompt); None for a budgeted or unreadable one."""
        found = _repo_bytes(t, self.repos)
        if found is None or found[1] is None or found[1] / self._ratio(t.repo) > self.window - OUTPUT_RESERVE:
            return None
        source, size = found
        mine = self.delta_size(source, t, 1.0)
        return mine.tokens if mine is not None else size / self._ratio(t.repo)

    def expected(self, t: Task) -> int:
        return expected_context(t, self.repos, self.window, per_token=self._ratio(t.repo) / self.scale(t.repo),
                                growth=self.growth)

    def delta_size(self, source: str, t: Task, scale: float | None = None) -> DeltaSize | None:
        """The sizes of `t`'s delta pack when it gets one, laid out as the batch packer lays it out
        (`delta.choose_layout`), measured from git: the files of the chain's first commit, then each
        diff along it, at its own bytes per token; None: the plain pack. Scaled by `scale` (default: learned)."""
        run = _run(source, self._batch(t), t.base_commit) if self.reuse.delta else None
        if run is None:
            return None
        scale = self.scale(t.repo) if scale is None else scale
        per_diff = self.reuse.per_diff_token.get(t.repo, self._ratio(t.repo)) / scale

        def lay(chain: list[str]) -> DeltaSize | None:
            root_bytes = _tree_bytes(source, chain[0]) or 0
            diffs = [diff_bytes(source, a, b) for a, b in zip(chain, chain[1:])]
            if None in diffs or not delta.diffs_fit(root_bytes, diffs):
                return None
            files = root_bytes / self._ratio(t.repo) * scale
            run_diff = diffs[0] if run.base != chain[0] else 0  # the diff from the root to the base
            return DeltaSize(chain[0], run.base, files, files + run_diff / per_diff, files + sum(diffs) / per_diff)

        return delta.choose_layout(run, t.base_commit, lay)

    def need(self, t: Task, before: list[Task]) -> int:
        """What `t` adds to the cache beside `before`: its context less the prefix its pack shares with
        the pack of one of them (their common blocks are held once)."""
        found = _repo_bytes(t, self.repos)
        if found is None:  # the instance itself reports a missing repository
            return self.expected(t)
        source, size = found
        ratio, room = self._ratio(t.repo) / self.scale(t.repo), self.window - OUTPUT_RESERVE
        if size is None or size / ratio > room:  # a budgeted pack: its files, past the shared part, follow the issue
            # (their shared part is files alike at all the commits of a group: a run's are, at most)
            shared = max((_shared_bytes(source, self._batch(t), t.base_commit, u.base_commit, self.reuse.delta)
                          for u in before if u.repo == t.repo), default=0) / ratio
            return max(0, self.expected(t) - int(min(shared, self.reuse.shared_share * room)))
        mine = self.delta_size(source, t)
        if mine is None:  # a plain pack: the head its files share with a running one's
            shared = max((_shared_bytes(source, self._batch(t), t.base_commit, u.base_commit)
                          for u in before if u.repo == t.repo and self.delta_size(source, u) is None), default=0)
            return max(0, self.expected(t) - int(shared / ratio))
        # a delta pack: what its run shows before its own diff is held once for the whole run, its
        # root's files once for every run under the root, and another root shares the head of files
        # the two roots have alike (stability._chain_order)
        others = [d for u in before if u.repo == t.repo and (d := self.delta_size(source, u)) is not None]
        if any((d.root, d.base) == (mine.root, mine.base) for d in others):
            shared = mine.run_tokens
        elif any(d.root == mine.root for d in others):
            shared = mine.root_tokens
        else:
            shared = max((_common_head(source, self._batch(t), mine.root, d.root) for d in others), default=0) / ratio
        return max(0, expected_context(t, self.repos, self.window, growth=self.growth, tokens=mine.tokens)
                   - int(shared))

    def __call__(self, task: Task, running: list[Task]) -> bool:
        self._look(running)
        needs = [self.need(t, running[:i]) for i, t in enumerate(running)]
        return admits(self.capacity, self.workers, self.need(task, running), needs)


@functools.lru_cache(maxsize=256)
def _tree(source: str, commit: str) -> dict[str, tuple[str, int]]:
    """path -> (object id, size) of the text-looking files at `commit`."""
    try:
        return {path: (oid, size) for path, oid, size in _files(source, commit)}
    except (subprocess.SubprocessError, OSError):
        return {}


def _shared_bytes(source: str, batch: str, a: str, b: str, same_run: bool = False) -> int:
    """Bytes at the head of `a`'s plain pack that `b`'s has too: the files, in the orders
    `order_for_commits` stored for the two commits, up to the first that differs (0 without them);
    with `same_run`, the base's files when the two are of one run."""
    run_a, run_b = _run(source, batch, a), _run(source, batch, b)
    if run_a is None or run_b is None:
        return 0
    if same_run and run_a.root == run_b.root:  # (budgeted packs are never delta packs: the bytes are a bound)
        return _tree_bytes(source, run_a.root) or 0
    return _common_head(source, batch, a, b)


def _run(source: str, batch: str, commit: str) -> Run | None:
    """The order, base and root stored for a commit's run, read from the pack cache once it is
    there (admission asks for every pair of running instances at each decision)."""
    try:
        return _stored_run(source, batch, commit) if batch else None
    except LookupError:
        return None


@functools.lru_cache(maxsize=4096)
def _stored_run(source: str, batch: str, commit: str) -> Run:
    # raises when nothing is stored yet: lru_cache keeps no exception, so a later look reads the store again
    with PackCache() as store:
        run = stored_run(source, batch, commit, store)
    if not (run and run.order):
        raise LookupError(commit)
    return run


@functools.lru_cache(maxsize=4096)
def _common_head(source: str, batch: str, a: str, b: str) -> int:
    tree_a, tree_b = _tree(source, a), _tree(source, b)
    shared = 0
    order_a, order_b = _run(source, batch, a).order, _run(source, batch, b).order
    for x, y in zip((p for p in order_a if p in tree_a), (p for p in order_b if p in tree_b)):
        if x != y or tree_a[x][0] != tree_b[y][0]:
            break
        shared += tree_a[x][1]
    return shared
