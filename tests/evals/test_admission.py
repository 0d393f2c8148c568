"""KV-aware admission and ordering: capacity from a live stand-in's /metrics or a profile's plan, the gate, the order."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from m3_agent.evals.admission import (
    CHARS_PER_TOKEN,
    GROWTH,
    LEARN_AFTER,
    OUTPUT_RESERVE,
    KvAdmit,
    KvCapacity,
    Reuse,
    bytes_per_token,
    capacity_from_metrics,
    capacity_from_profile,
    admits,
    expected_context,
    learn_capacity,
    order_for_reuse,
    parse_capacity,
)
from m3_agent.evals.reuse.ordering import batch_id
from m3_agent.evals.runner import EvalConfig, RunOptions, run_eval
from m3_agent.evals.tasks import Task
from m3_agent.serving.planner import GB, plan
from m3_agent.standin.kvsim import B200X8_KV_TOKENS
from m3_agent.standin.server import TOKEN_RE, StandinServer


def _task(iid: str, repo: str = "o/r", created_at: str = "", base_commit: str = "0" * 40, **kw) -> Task:
    return Task(instance_id=iid, repo=repo, base_commit=base_commit, created_at=created_at, **kw)


def test_capacity_comes_from_the_cache_config_info_of_metrics():
    with StandinServer({"performance": {}}) as srv:
        cap = capacity_from_metrics(srv.base_url)
    assert cap is not None
    assert cap.tokens == B200X8_KV_TOKENS // 128 * 128 and cap.source.endswith("/metrics")


def test_no_capacity_when_the_server_does_not_say_or_does_not_answer():
    with StandinServer([]) as srv:  # no performance model: num_gpu_blocks="None", as vLLM before profiling
        assert capacity_from_metrics(srv.base_url) is None
    assert capacity_from_metrics("http://127.0.0.1:9/v1") is None
    assert parse_capacity("not prometheus {{{") is None


def test_data_parallel_engines_add_up():
    text = ('vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="100"} 1.0\n'
            'vllm:cache_config_info{block_size="128",engine="1",num_gpu_blocks="100"} 1.0\n')
    assert parse_capacity(text).tokens == 200 * 128


def test_a_profile_gives_the_kv_pool_of_its_plan():
    cap = capacity_from_profile("h200-tp8")
    from m3_agent.serving.endpoint import plan_request
    from m3_agent.serving.planner import gpu_memory_for
    from m3_agent.serving.profiles import build_command, get_profile

    p = get_profile("h200-tp8")
    expect = plan(plan_request(p, build_command(p, "native"), p.gpus, gpu_memory_for(p.gpu)))
    assert cap.tokens == pytest.approx(expect.kv_pool_gb * GB / expect.kv_bytes_per_token, abs=128)
    assert cap.tokens % 128 == 0 and "h200-tp8" in cap.source
    with StandinServer([]) as srv:  # /metrics does not say: the profile's plan is the fallback
        assert learn_capacity(srv.base_url, "h200-tp8") == cap
        assert learn_capacity(srv.base_url, None) is None


def test_instances_of_a_repository_run_back_to_back_oldest_first():
    tasks = [_task("a-3", "o/a", "2021"), _task("b-1", "o/b", "2019"), _task("a-1", "o/a", "2019"),
             _task("b-2", "o/b"), _task("a-2", "o/a", "2020")]
    assert [t.instance_id for t in order_for_reuse(tasks)] == ["a-1", "a-2", "a-3", "b-2", "b-1"]


def test_the_gate_caps_at_workers_fits_the_cache_and_always_runs_one():
    assert admits(1_000_000, 3, 2_000_000, [])  # alone it may exceed the cache: one instance always runs
    assert admits(1_000_000, 3, 400_000, [500_000])
    assert not admits(1_000_000, 3, 600_000, [500_000])
    assert not admits(1_000_000, 3, 1, [1, 1, 1])  # --workers still caps
    assert admits(None, 2, 10**9, [10**9]) and not admits(None, 2, 1, [1, 1])


@pytest.fixture
def one_commit(tmp_path) -> Task:
    repo = tmp_path / "o__r"
    repo.mkdir()
    (repo / "a.py").write_text("x = 1\n" * 16_000)  # 96,000 bytes
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    return _task("r-1", base_commit=head)


def test_expected_context_follows_the_tree_size_and_caps_at_the_window(tmp_path, one_commit):
    assert expected_context(one_commit, tmp_path, 1_048_576) == int(96_000 / 3.2 * (1 + GROWTH)) + OUTPUT_RESERVE
    assert expected_context(one_commit, tmp_path, 1_048_576, per_token=6.0) == int(16_000 * (1 + GROWTH)) + OUTPUT_RESERVE
    assert expected_context(one_commit, tmp_path, 50_000) == 50_000
    assert expected_context(_task("r-2", repo="o/missing"), tmp_path, 70_000) == 70_000


def test_a_tree_counts_only_the_files_a_pack_holds(tmp_path):
    """Admission sizes a commit by the packer's own rules (agent.context.estimate): lockfiles,
    vendored trees and binary files are left out as the pack leaves them out, whatever their suffix
    (a list of binary suffixes of its own counted all three)."""
    from m3_agent.agent.context import pack_repository
    from m3_agent.evals.admission import _tree_bytes

    repo = tmp_path / "o__r"
    repo.mkdir()
    (repo / "a.py").write_text("x = 1\n" * 16_000)  # 96,000 bytes
    (repo / "poetry.lock").write_text("[[package]]\n" * 4_000)
    (repo / "node_modules" / "x").mkdir(parents=True)
    (repo / "node_modules" / "x" / "index.js").write_text("module.exports = 1;\n" * 1_000)
    (repo / "model.bin").write_bytes(bytes(range(256)) * 100)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert _tree_bytes(str(repo), head) == sum(f.bytes for f in pack_repository(repo).files) == 96_000
    task = _task("r-1", base_commit=head)
    assert expected_context(task, tmp_path, 1_048_576) == int(96_000 / CHARS_PER_TOKEN * (1 + GROWTH)) + OUTPUT_RESERVE


def test_admission_learns_how_far_sessions_grow_from_the_finished_ones(tmp_path, one_commit):
    pack = int(96_000 / CHARS_PER_TOKEN)
    second = one_commit.model_copy(update={"instance_id": "r-2", "repo": "o/other"})  # nothing shared
    (tmp_path / "o__other").symlink_to(tmp_path / "o__r")
    # room for two packs with 5,000 tokens of growth each, not for two with the prior's growth
    admit = KvAdmit(KvCapacity(tokens=2 * (pack + 5_000), source="test"), 4, repos=tmp_path,
                     window=1_048_576)
    assert admit.growth is None and not admit(second, [one_commit])
    for grown in range(LEARN_AFTER - 1):
        admit.observe(pack, pack + 1_000 + grown)
    admit.observe(0, 0)  # an instance that sent no request teaches nothing
    admit.observe(pack, pack - 10)  # nor one whose figures make no sense
    assert admit.growth is None and not admit(second, [one_commit])  # too few finished yet
    admit.observe(pack, pack + 4_000)
    assert admit.growth == 4_000  # the largest growth seen
    assert expected_context(one_commit, tmp_path, 1_048_576, growth=admit.growth) == pack + 4_000
    assert admit(second, [one_commit])
    admit.observe(pack, pack + 9_000)  # one that grew more than the room: the gate closes again
    assert not admit(second, [one_commit])


def test_before_any_finished_the_gate_projects_the_running_sessions_growth_from_their_trajectories(
        tmp_path, one_commit):
    from m3_agent.agent.events import AgentEvent
    from m3_agent.agent.model import Usage
    from m3_agent.agent.trajectory import TrajectoryWriter
    from m3_agent.evals.admission import MIN_REQUESTS

    pack = int(96_000 / CHARS_PER_TOKEN)
    others = [one_commit.model_copy(update={"instance_id": f"r-{n}", "repo": f"o/r{n}"}) for n in range(2, 6)]
    for t in others:  # nothing shared between them
        (tmp_path / t.repo.replace("/", "__")).symlink_to(tmp_path / "o__r")
    running, candidate = [one_commit, *others[:2]], others[2]
    # room for four packs with 6,000 tokens of growth each, not for four with the prior's
    admit = KvAdmit(KvCapacity(tokens=4 * (pack + 6_000), source="test"), 8, repos=tmp_path,
                     window=1_048_576, max_turns=40)
    folder = tmp_path / "trajectories"
    folder.mkdir()
    admit.watch(folder)

    def replies(t: Task, n: int, per_request: int, torn: bool = False) -> None:
        """A trajectory as the agent's writer leaves it: a run's start, then `n` replies with their usage."""
        path = folder / f"{t.instance_id}.jsonl"
        path.unlink(missing_ok=True)
        writer = TrajectoryWriter(path)
        writer(AgentEvent(kind="run_start", data={"config": {}}))
        for k in range(n):
            usage = Usage(requests=1, prompt_tokens=pack + k * per_request, completion_tokens=50)
            writer(AgentEvent(kind="reply", turn=k + 1, data={"usage": usage.model_dump()}))
        writer.close()
        if torn:  # a line still being written is not read
            with open(path, "a") as fh:
                fh.write('{"kind": "reply", "usage": {"prompt_tokens": 9')

    for t in running:
        replies(t, MIN_REQUESTS - 1, 100)
    assert not admit(candidate, running) and admit.growth is None  # too few requests yet: the prior
    for t in running:
        replies(t, MIN_REQUESTS + 1, 100, torn=True)  # 4 requests, 350 tokens grown: 3,500 at 40 turns
    assert admit(candidate, running) and admit.growth == 350 * 40 // 4
    replies(running[0], 8, 1_000)  # one that grows faster: 7,050 at 8 requests, 35,250 projected
    assert not admit(candidate, running) and admit.growth == 7_050 * 40 // 8
    replies(others[3], MIN_REQUESTS + 1, 100)
    # a session that is no longer running is no longer projected
    assert admit(candidate, [*running[1:], others[3]]) and admit.growth == 350 * 40 // 4
    for t in others[:LEARN_AFTER]:  # once enough have finished, what they grew to is what counts
        admit.observe(pack, pack + 2_000, t)
    assert admit(candidate, running) and admit.growth == 2_000


def test_the_runner_tells_the_gate_what_each_finished_instance_grew_to(tmp_path):
    from m3_agent.evals.grading import InstanceReport
    from m3_agent.evals.instance import AgentStats, InstanceResult

    tasks = [_task(f"r-{i}") for i in range(3)]
    seen = []

    class Gate:
        def __call__(self, task, running):
            return True

        def observe(self, first, peak, task):
            seen.append((first, peak, task.instance_id))

        def watch(self, folder):  # where the agent writes the trajectories of the instances as they run
            seen.append(folder)

    def executor(pending, predictions, config, workers, on_event, admit):
        for t in pending:
            i = int(t.instance_id[-1])
            stats = None if i == 1 else AgentStats(status="submitted", first_prompt_tokens=100 * (i + 1),
                                                   peak_context_tokens=150 * (i + 1))
            yield InstanceResult(instance_id=t.instance_id, model_name_or_path="m", model_patch=None,
                                 report=InstanceReport(), agent=stats)

    run_eval(tasks[:2], None, EvalConfig(output_dir=tmp_path / "out"), RunOptions(admit=Gate(), executor=executor))
    assert seen == [tmp_path / "out" / "trajectories", (100, 150, "r-0")]  # no agent run: not counted
    seen.clear()  # resumed: the gate learns from the instance already done before the next starts
    run_eval(tasks, None, EvalConfig(output_dir=tmp_path / "out"), RunOptions(admit=Gate(), executor=executor))
    assert seen == [(100, 150, "r-0"), tmp_path / "out" / "trajectories", (300, 450, "r-2")]


def test_the_endpoint_tokenizes_a_sample_to_give_its_bytes_per_token(tmp_path, one_commit):
    with StandinServer([]) as srv:
        ratio = bytes_per_token(srv.base_url, one_commit, tmp_path)
    assert ratio == pytest.approx(96_000 / len(TOKEN_RE.findall("x = 1\n" * 16_000)))  # the stand-in's toy tokens
    assert bytes_per_token("http://127.0.0.1:9/v1", one_commit, tmp_path) == CHARS_PER_TOKEN  # no server: the estimate


def test_the_endpoint_tokenizes_the_repositorys_own_patches_to_give_its_bytes_per_diff_token(tmp_path):
    from m3_agent.evals.admission import diff_bytes_per_token

    repo = tmp_path / "o__r"
    repo.mkdir()
    commits = _history(repo, [{"a.py": "value = compute(1)\n" * 2_000}, {"a.py": "value = compute(2)\n" * 2_000}])
    task = _task("r-1", base_commit=commits[1])
    patch = subprocess.run(["git", "-C", str(repo), "log", "-p", "--no-color", "--no-renames", "--format=", commits[1]],
                           capture_output=True, text=True, check=True).stdout
    with StandinServer([]) as srv:
        files, diffs = bytes_per_token(srv.base_url, task, tmp_path), diff_bytes_per_token(srv.base_url, task, tmp_path)
    assert diffs == pytest.approx(len(patch.encode()) / len(TOKEN_RE.findall(patch)))  # both commits' patches, as sent
    assert diffs < files  # each line's mark is a token more
    # no server: the files' figure, which falls back to the documented estimate
    assert diff_bytes_per_token("http://127.0.0.1:9/v1", task, tmp_path) == CHARS_PER_TOKEN


def test_the_runner_starts_instances_only_when_admitted(tmp_path):
    # repositories that do not exist: each instance ends at once with an error, no model or sandbox needed
    tasks = [_task(f"r-{i}", repo=str(tmp_path / "absent")) for i in range(4)]
    asked, running, peak = [], set(), [0]

    def on_event(kind, info):
        if kind == "start":
            running.add(info["instance_id"])
            peak[0] = max(peak[0], len(running))
        elif kind == "finish":
            running.discard(info["result"].instance_id)

    class Never:  # an Admission that learns nothing: never another beside a running one
        def __call__(self, task, busy):
            asked.append((task.instance_id, [t.instance_id for t in busy]))
            return False

        def observe(self, first, peak, task=None):
            pass

        def watch(self, folder):
            pass

    results = run_eval(tasks, None, EvalConfig(output_dir=tmp_path / "out"), RunOptions(workers=4, admit=Never()),
                       on_event=on_event)
    assert [r.instance_id for r in results] == [t.instance_id for t in tasks]
    assert all(r.error for r in results)
    assert peak[0] == 1  # admission lowered concurrency below --workers 4
    assert asked and all(len(busy) == 1 for _, busy in asked)  # only asked while one runs


def _history(repo, versions: list[dict[str, str]]) -> list[str]:
    """A repository at `repo` with one commit per dict of files written; its commit ids."""
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    commits = []
    for n, files in enumerate(versions):
        for name, text in files.items():
            (repo / name).write_text(text)
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", f"c{n}"], check=True)
        commits.append(subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
    return commits


def _two_contexts_do_not_fit(tmp_path, commits):
    """The first two tasks at `commits` and a KV capacity of 1.6 of their contexts."""
    from m3_agent.evals.admission import KvCapacity

    first, second = (_task(f"r-{n}", base_commit=c) for n, c in enumerate(commits[:2]))
    alone = expected_context(first, tmp_path, 1_048_576)
    return first, second, KvCapacity(tokens=alone + alone * 6 // 10, source="test")


def _reuse(commits: list[str], *, delta: bool = False, share: float = 0.0, per_diff: dict | None = None) -> Reuse:
    """What `eval run` tells admission of the batch of these commits of `o/r` (`batch_ids`)."""
    return Reuse(delta, share, {"o/r": batch_id(commits, delta=delta)}, per_diff or {})


def test_instances_of_one_repository_are_charged_once_for_the_prefix_their_packs_share(tmp_path, monkeypatch):
    from m3_agent.agent.context.cache import PackCache
    from m3_agent.evals.reuse.ordering import order_for_commits
    from m3_agent.evals.admission import KvAdmit

    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "o__r"
    repo.mkdir()
    # 96,000 bytes of core.py both commits share
    commits = _history(repo, [{"core.py": "x = 1\n" * 16_000, "fix.py": "y = 0\n"}, {"fix.py": "y = 1\n"}])
    first, second, capacity = _two_contexts_do_not_fit(tmp_path, commits)
    admit = KvAdmit(capacity, 4, repos=tmp_path, window=1_048_576, reuse=_reuse(commits))
    assert not admit(second, [first])  # no stored orders: nothing known to be shared, two full contexts
    with PackCache() as store:
        assert order_for_commits(str(repo), commits, store).runs == 1
    assert KvAdmit(capacity, 4, repos=tmp_path, window=1_048_576, reuse=_reuse(commits))(second, [first])  # core.py is held once


def test_delta_packs_of_one_run_are_charged_once_for_their_base_even_where_files_changed(tmp_path, monkeypatch):
    from m3_agent.agent.context.cache import PackCache
    from m3_agent.evals.reuse.ordering import order_for_commits
    from m3_agent.evals.admission import KvAdmit

    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "o__r"
    repo.mkdir()
    # one big file, a line of it fixed at each commit: plain packs share nothing of it
    commits = _history(repo, [{"core.py": f"x = {n}\n" + "x = 1\n" * 16_000} for n in range(3)])
    first, second, capacity = _two_contexts_do_not_fit(tmp_path, commits)
    with PackCache() as store:
        assert order_for_commits(str(repo), commits, store, delta=True).runs == 1
    assert not KvAdmit(capacity, 4, repos=tmp_path, window=1_048_576, reuse=_reuse(commits))(second, [first])  # plain: core.py differs
    assert KvAdmit(capacity, 4, repos=tmp_path, window=1_048_576, reuse=_reuse(commits, delta=True))(second, [first])  # one base


def test_a_repository_larger_than_the_window_is_credited_no_more_than_its_shared_part(tmp_path, monkeypatch):
    from m3_agent.agent.context.cache import PackCache
    from m3_agent.evals.reuse.ordering import order_for_commits
    from m3_agent.evals.admission import OUTPUT_RESERVE, KvAdmit, KvCapacity

    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "o__r"
    repo.mkdir()
    commits = _history(repo, [{"core.py": f"x = {n}\n" + "x = 1\n" * 16_000} for n in range(3)])
    window = OUTPUT_RESERVE + 8_000  # the tree (about 96 kB) is far over the 8,000 tokens a pack may hold
    first, second = (_task(f"r-{n}", base_commit=c) for n, c in enumerate(commits[:2]))
    alone = expected_context(first, tmp_path, window)
    capacity = KvCapacity(tokens=2 * alone - 2_000, source="test")  # short of two by 2,000 tokens
    with PackCache() as store:
        order_for_commits(str(repo), commits, store, delta=True)
    # budgeted packs are never delta packs: the base is not credited, only the shared part when there is one
    assert not KvAdmit(capacity, 4, repos=tmp_path, window=window, reuse=_reuse(commits, delta=True))(second, [first])
    assert KvAdmit(capacity, 4, repos=tmp_path, window=window, reuse=_reuse(commits, delta=True, share=0.5))(second, [first])
    assert not KvAdmit(capacity, 4, repos=tmp_path, window=window, reuse=_reuse(commits, delta=True, share=0.2))(second, [first])


def test_a_delta_pack_of_another_run_is_credited_the_head_its_base_shares_with_a_running_base(tmp_path, monkeypatch):
    from m3_agent.agent.context.cache import PackCache
    from m3_agent.evals.reuse.ordering import Cuts, order_for_commits, stored_run

    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "o__r"
    repo.mkdir()
    core = "x = 1\n" * 16_000  # 96,000 bytes no commit changes
    # two runs: other.py rewritten between them; small.py fixed at every commit
    commits = _history(repo, [{"core.py": core, "other.py": f"y = {n // 3}\n" * 8_000, "small.py": f"s = {n}\n"}
                              for n in range(6)])
    with PackCache() as store:
        assert order_for_commits(str(repo), commits, store, delta=True).runs == 2
        batch = _reuse(commits, delta=True).batches["o/r"]
        assert [stored_run(str(repo), batch, c, store).base for c in commits] == [commits[1]] * 3 + [commits[4]] * 3
    earlier, later = _task("r-0", base_commit=commits[0]), _task("r-5", base_commit=commits[5])
    admit = KvAdmit(None, 4, repos=tmp_path, window=1_048_576, reuse=_reuse(commits, delta=True))
    # the two bases' packs start with core.py alike (other.py differs): that much is held once
    assert admit.need(later, [earlier]) == admit.need(later, []) - int(len(core) / CHARS_PER_TOKEN)


def test_delta_packs_under_one_root_are_credited_its_files_and_within_a_run_the_diff_to_its_base(tmp_path,
                                                                                                    monkeypatch):
    from m3_agent.agent.context.cache import PackCache
    from m3_agent.evals.reuse.ordering import Cuts, diff_bytes, order_for_commits, stored_run
    from m3_agent.evals.admission import _tree_bytes

    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "o__r"
    repo.mkdir()
    # three runs: era.py (6 kB) rewritten between them, small.py fixed at every commit; the diff
    # from the middle run's base to either other base (12 kB) stays under the root's share of 102 kB
    commits = _history(repo, [{"core.py": "x = 1\n" * 16_000, "era.py": f"y = {n // 3}\n" * 1_000,
                               "small.py": f"s = {n}\n"} for n in range(9)])
    with PackCache() as store:
        assert order_for_commits(str(repo), commits, store, delta=True, cuts=Cuts(root_diff_share=0.2)).runs == 3
        runs = [stored_run(str(repo), _reuse(commits, delta=True).batches["o/r"], c, store) for c in commits]
    root, base = commits[4], commits[1]
    assert {r.root for r in runs} == {root} and runs[0].base == base
    tasks = [_task(f"r-{n}", base_commit=c) for n, c in enumerate(commits)]
    admit = KvAdmit(None, 4, repos=tmp_path, window=1_048_576, reuse=_reuse(commits, delta=True))
    files = _tree_bytes(str(repo), root) / CHARS_PER_TOKEN
    to_base, to_own = diff_bytes(str(repo), root, base), diff_bytes(str(repo), base, commits[0])
    alone = admit.need(tasks[0], [])
    assert alone == expected_context(tasks[0], tmp_path, 1_048_576, tokens=files + (to_base + to_own) / CHARS_PER_TOKEN)
    assert admit.need(tasks[0], [tasks[2]]) == alone - int(files + to_base / CHARS_PER_TOKEN)  # its run's
    assert admit.need(tasks[0], [tasks[8]]) == alone - int(files)  # another run of its root: the root's files


@pytest.fixture
def one_run(tmp_path, monkeypatch) -> tuple[Path, list[str]]:
    """Three commits that make one delta run, their orders stored: core.py stays, extra.py (2 kB) is
    rewritten at each; the middle commit is the base."""
    from m3_agent.agent.context.cache import PackCache
    from m3_agent.evals.reuse.ordering import order_for_commits

    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "o__r"
    repo.mkdir()
    commits = _history(repo, [{"core.py": "x = 1\n" * 16_000, "extra.py": f"z = {n}\n" * 400} for n in range(3)])
    with PackCache() as store:
        assert order_for_commits(str(repo), commits, store, delta=True).runs == 1
    return repo, commits


def test_a_delta_pack_is_charged_its_base_once_per_run_and_its_own_diff(tmp_path, one_run):
    from m3_agent.evals.reuse.ordering import diff_bytes
    from m3_agent.evals.admission import _tree_bytes

    repo, commits = one_run
    first, last = _task("r-0", base_commit=commits[0]), _task("r-2", base_commit=commits[2])
    # its diff at the repository's bytes per diff token, which a diff's line marks make denser
    admit = KvAdmit(None, 4, repos=tmp_path, window=1_048_576, reuse=_reuse(commits, delta=True, per_diff={"o/r": 2.5}))
    base, diff = _tree_bytes(str(repo), commits[1]), diff_bytes(str(repo), commits[1], commits[2])
    assert diff > 2 * 2_000  # the old file's lines and the new one's

    def context(tokens: float) -> int:
        return expected_context(last, tmp_path, 1_048_576, tokens=tokens)

    assert admit.need(last, []) == context(base / CHARS_PER_TOKEN + diff / 2.5)  # the first of its run: all of it
    # beside an instance of its run: the base is held once, the diff is its own
    assert admit.need(last, [first]) == context(base / CHARS_PER_TOKEN + diff / 2.5) - int(base / CHARS_PER_TOKEN)
    assert admit.need(last, [first]) > admit.expected(last) - int(_tree_bytes(str(repo), commits[2]) / CHARS_PER_TOKEN)
    plain_ratio = KvAdmit(None, 4, repos=tmp_path, window=1_048_576, reuse=_reuse(commits, delta=True)).need(last, [first])
    assert plain_ratio == context(base / CHARS_PER_TOKEN + diff / CHARS_PER_TOKEN) - int(base / CHARS_PER_TOKEN)


def test_admission_learns_how_far_its_estimate_of_a_repository_falls_short(tmp_path, one_run):
    from m3_agent.evals.admission import _tree_bytes

    repo, commits = one_run
    tasks = [_task(f"r-{n}", base_commit=c) for n, c in enumerate(commits)]
    base = _tree_bytes(str(repo), commits[1]) / CHARS_PER_TOKEN
    admit = KvAdmit(None, 4, repos=tmp_path, window=1_048_576, reuse=_reuse(commits, delta=True))
    before = admit.need(tasks[1], [])  # the run's base: its files, and the prior's growth
    first = {t.instance_id: admit._first_prompt(t) for t in tasks}
    assert first["r-1"] == pytest.approx(base)
    for n, short in enumerate((1.02, 1.08, 1.05)):  # each finished one's first prompt over its estimate
        assert admit.scale("o/r") == 1.0  # not before LEARN_AFTER of the repository finished
        t = tasks[n]
        admit.observe(int(first[t.instance_id] * short), int(first[t.instance_id] * short) + 500, t)
    assert admit.scale("o/r") == pytest.approx(1.08, rel=1e-3) and admit.scale("o/other") == 1.0
    assert admit.need(tasks[1], []) == pytest.approx(int(base * 1.08) + 500, abs=2)  # scaled; learned growth
    assert admit.need(tasks[1], []) > before - int(base * 0.15) - 32_768  # the scale, not the growth, raised it
    admit.observe(int(first["r-0"] * 0.7), int(first["r-0"] * 0.7) + 10, tasks[0])  # an estimate that erred high
    assert admit.scale("o/r") == pytest.approx(1.08, rel=1e-3)  # lowers nothing
    unsure = KvAdmit(None, 4, repos=tmp_path, window=1_048_576, reuse=_reuse(commits, delta=True))
    for t in tasks:
        unsure.observe(int(first[t.instance_id] * 0.9), int(first[t.instance_id] * 0.9) + 10, t)
    assert unsure.scale("o/r") == 1.0  # never below 1: the estimate stays on the safe side
