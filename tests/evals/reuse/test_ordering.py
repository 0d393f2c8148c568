"""A batch's orders (evals.reuse.ordering): runs of neighbouring commits, each with the order its packs share."""

from __future__ import annotations

from m3_agent.agent.config import AgentConfig
from m3_agent.agent.context import EstimateCounter, pack_repository
from m3_agent.agent.context.cache import PackCache
from m3_agent.evals.reuse.ordering import Cuts, order_for_commits
from m3_agent.evals.reuse.packer import BatchPacker
from m3_agent.settings import ReuseConfig
from tests.agent.context.history import FILES, commit_file, section_paths, shared_prefix


def batch_pack(tree, source, commit: str, batch: str, *, issue=None, budget=None, share: float = 0.0, delta=False):
    """`tree` packed as `eval run`'s agent packs the instance at `commit` of `batch`."""
    packer = BatchPacker(AgentConfig(), history=str(source), commit=commit, batch=batch,
                         reuse=ReuseConfig(shared_share=share, delta=delta), counter=EstimateCounter())
    return packer.pack(tree, issue=issue, budget=budget)


def test_a_batch_of_commits_puts_the_files_they_all_share_first(repo, git, tmp_path):
    source = repo({**FILES, "CHANGES.txt": "start\n"})
    commits = [git(source, "rev-parse", "HEAD").strip()]
    for n in range(3):  # CHANGES.txt and mod03 differ between the batch's commits; the rest never do
        commit_file(git, source, "CHANGES.txt", f"release {n}\n", f"release {n}")
        commit_file(git, source, "pkg/mod03.py", f"X = {n}\n", f"fix {n}")
        if n == 1:  # a release-note fragment only the middle commit has
            (source / "changelog").mkdir()
            commit_file(git, source, "changelog/12.bugfix", "Fixed f3.\n", "fragment")
        if n == 2:
            git(source, "rm", "-q", "changelog/12.bugfix")
            git(source, "commit", "-qm", "release: fold fragments")
        commits.append(git(source, "rev-parse", "HEAD").strip())
    checkouts = []
    for n, commit in enumerate(commits[1:]):
        checkouts.append(tmp_path / f"checkout{n}")
        git(tmp_path, "clone", "-q", str(source), str(checkouts[-1]))
        git(checkouts[-1], "checkout", "-q", commit)
    with PackCache(tmp_path / "cache") as cache:
        ordered = order_for_commits(str(source), commits[1:], cache)
        assert ordered.runs == 1  # one run: the commits share most bytes
    packs = [batch_pack(c, source, commit, ordered.batch).text for c, commit in zip(checkouts, commits[1:])]
    assert section_paths(packs[0])[-2:] == ["CHANGES.txt", "pkg/mod03.py"]  # 3 versions each; then by changes, path
    assert section_paths(packs[1])[-1] == "changelog/12.bugfix"  # not at every commit: after all the others
    for a, b in zip(packs, packs[1:]):
        assert shared_prefix(a, b) > a.index("### CHANGES.txt")  # everything the commits share comes first


def test_a_batch_is_cut_into_runs_of_neighbours_each_with_its_own_order(repo, git, tmp_path):
    source = repo(FILES)
    commits = []
    for era in range(2):  # two eras: every module is rewritten between them, then small fixes within each
        for i in range(20):
            commit_file(git, source, f"pkg/mod{i:02d}.py", f"def f{i}():\n    return {era} + {i}\n" * 20,
                        f"era {era} {i}")
        for n in range(3):
            commit_file(git, source, f"pkg/mod{n:02d}.py", f"def f{n}():\n    return {era}, {n}\n" * 20, f"fix {n}")
            commits.append(git(source, "rev-parse", "HEAD").strip())
    with PackCache(tmp_path / "cache") as cache:
        ordered = order_for_commits(str(source), commits, cache)
    assert ordered.runs == 2
    packs = []
    for n, commit in enumerate(commits):
        checkout = tmp_path / f"c{n}"
        git(tmp_path, "clone", "-q", str(source), str(checkout))
        git(checkout, "checkout", "-q", commit)
        packs.append(batch_pack(checkout, source, commit, ordered.batch).text)
    for a, b in zip(packs[3:], packs[4:]):  # within the second era: all but the fixed modules are shared
        assert shared_prefix(a, b) >= 0.8 * len(b)


def _checkouts(git, source, commits: list[str], tmp_path) -> list:
    out = []
    for n, commit in enumerate(commits):
        out.append(tmp_path / f"checkout{n}")
        git(tmp_path, "clone", "-q", str(source), str(out[-1]))
        git(out[-1], "checkout", "-q", commit)
    return out


def _budgeted_batch(git, source, commits: list[str], tmp_path, issues: list[str], share: float,
                    cuts: Cuts = Cuts()) -> tuple:
    """Budgeted packs (60% of the whole) of a batch's commits, ordered as `eval run` orders them."""
    checkouts = _checkouts(git, source, commits, tmp_path)
    with PackCache(tmp_path / "cache") as cache:
        ordered = order_for_commits(str(source), commits, cache, cuts=cuts)
        budget = int(pack_repository(checkouts[0], cache=cache).tokens * 0.6)
    packs = [batch_pack(c, source, commit, ordered.batch, issue=issue, budget=budget, share=share)
             for c, commit, issue in zip(checkouts, commits, issues)]
    assert all("budget" in p.skipped_by_reason() for p in packs)
    return ordered.runs, packs


def test_a_batch_shares_its_budgeted_part_though_a_source_file_changes_in_it(repo, git, tmp_path):
    modules = {f"pkg/mod{i}.py": f"def f{i}():\n    return {i}\n" * 20 for i in range(10)}
    tests = {f"tests/test_mod{i}.py": f"def test_{i}():\n    assert f{i}() == {i}\n" * 60 for i in range(10)}
    source = repo({**modules, **tests})
    commits = []
    for n in range(3):  # mod3 differs at every commit of the batch: it cannot be in the shared part
        commit_file(git, source, "pkg/mod3.py", f"def f3():\n    return {n}\n" * 20, f"fix {n}")
        commits.append(git(source, "rev-parse", "HEAD").strip())
    issues = ["f3 returns the wrong value", "test_7 fails on f7", "f5 is slow"]
    _, packs = _budgeted_batch(git, source, commits, tmp_path, issues, 0.5)
    for a, b in zip(packs, packs[1:]):
        shared = shared_prefix(a.text, b.text)
        assert shared >= 0.45 * len(b.text)  # half the budget, less the header and tree that follow
        assert "### pkg/mod3.py" not in b.text[:shared]


def test_budgeted_packs_share_their_part_across_the_cut_of_a_batch_into_runs(repo, git, tmp_path):
    tests = {f"tests/test_mod{i:02d}.py": f"def test_{i}():\n    assert f{i}() == {i}\n" * 80 for i in range(10)}
    source = repo({**FILES, **tests})
    commits = []
    for era in range(2):  # every module is rewritten between the eras; the tests (most bytes) never change
        for i in range(20):
            commit_file(git, source, f"pkg/mod{i:02d}.py", f"def f{i}():\n    return {era} + {i}\n" * 20,
                        f"era {era} {i}")
        for n in range(3):
            commit_file(git, source, f"pkg/mod{n:02d}.py", f"def f{n}():\n    return {era}, {n}\n" * 20, f"fix {n}")
            commits.append(git(source, "rev-parse", "HEAD").strip())
    issues = [f"f{n} returns the wrong value" for n in (4, 9, 13, 17, 6, 11)]
    # runs cut where a tenth of the bytes differ
    runs, packs = _budgeted_batch(git, source, commits, tmp_path, issues, 0.5, Cuts(cluster_thresholds=(0.9,)))
    assert runs == 2  # an order per era
    for a, b in zip(packs, packs[1:]):  # budgeted ones share their part across the eras too
        assert shared_prefix(a.text, b.text) >= 0.45 * len(b.text)


def test_two_overlapping_batches_ordered_at_once_on_one_cache_folder_each_keep_their_own(repo, git, tmp_path,
                                                                                          monkeypatch):
    import threading

    from m3_agent import hostgit
    from m3_agent.evals.reuse.ordering import stored_run
    from tests.evals.reuse.test_delta import _history

    source, commits = _history(repo, git)
    batches = {"a": commits[0:3], "b": commits[2:5]}  # commits[2] is in both: each batch's run has its own base
    trees = {c: hostgit.export_tree(source, c, tmp_path / f"tree-{c[:8]}") for c in commits}

    def order_and_pack(name: str, barrier: threading.Barrier | None, out: dict) -> None:
        with PackCache() as store:
            if barrier:
                barrier.wait()
            ordered = order_for_commits(str(source), batches[name], store, delta=True)
            if barrier:
                barrier.wait()  # both batches are stored before either packs
            runs = {c: stored_run(str(source), ordered.batch, c, store) for c in batches[name]}
        packs = {c: batch_pack(trees[c], source, c, ordered.batch, delta=True) for c in batches[name]}
        out[name] = ({c: (r.base, r.root, r.order) for c, r in runs.items()}, {c: p.data for c, p in packs.items()})

    alone: dict = {}
    for name in batches:  # each batch alone, in a cache folder of its own
        monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / f"alone-{name}"))
        order_and_pack(name, None, alone)
    assert alone["a"][0][commits[2]][0] != alone["b"][0][commits[2]][0]  # the shared commit's bases differ
    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / "shared"))
    together: dict = {}
    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=order_and_pack, args=(name, barrier, together)) for name in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone  # each instance got its own batch's order, base, root and pack


def test_plain_fix_and_library_use_never_load_the_batch_modules(tmp_path):
    import subprocess
    import sys

    script = """
import subprocess, sys
from pathlib import Path
import m3_agent.api, m3_agent.fix.flow, m3_agent.fix.cli
from m3_agent.agent.config import AgentConfig
from m3_agent.agent.context import EstimateCounter
from m3_agent.agent.loop import Agent
from m3_agent.agent.model import ModelReply, ToolCall
from m3_agent.sandbox import LocalEnvironment

class Done:
    model = "scripted"
    def max_model_len(self): return None
    def token_counter(self): return EstimateCounter()
    def complete(self, messages, *, tools=None, thinking_mode=None, tool_choice="auto", max_tokens=None):
        return ModelReply(tool_calls=[ToolCall(id="1", name="submit", arguments='{"summary": "ok"}')],
                          finish_reason="tool_calls")

repo = Path(sys.argv[1])
repo.mkdir()
(repo / "a.py").write_text("x = 1\\n")
subprocess.run(["git", "init", "-q", str(repo)], check=True)
Agent(AgentConfig(), model=Done(), env_factory=LocalEnvironment).run(repo, "nothing")
print(sorted(m for m in sys.modules if m.startswith("m3_agent.evals")))
"""
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "repo")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.strip()
    assert loaded.startswith("[") and "m3_agent.evals.reuse" not in loaded  # (fix loads evals.runner, not these)
