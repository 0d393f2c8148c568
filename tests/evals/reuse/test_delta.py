"""Delta packs: a batch's instances show one base commit's files, then the diff to their own commit."""

from __future__ import annotations

import re
import subprocess

from m3_agent import hostgit
from m3_agent.agent.config import AgentConfig
from m3_agent.agent.context import EstimateCounter
from m3_agent.agent.context.cache import PackCache
from m3_agent.evals.admission import KvAdmit, KvCapacity, Reuse
from m3_agent.evals.reuse import ordering
from m3_agent.evals.reuse.delta import sections_end
from m3_agent.evals.reuse.ordering import Cuts, order_for_commits, stored_run
from m3_agent.evals.reuse.packer import BatchPacker
from m3_agent.evals.tasks import Task
from m3_agent.settings import ReuseConfig
from tests.agent.context.history import commit_file

CUTS = Cuts()  # the batch's cuts as eval run makes them
FILES = {f"pkg/mod{i:02d}.py": "".join(f"def f{i}_{k}():\n    return {k}\n" for k in range(40)) for i in range(20)}


def _history(repo, git) -> tuple:
    """A repository and five commits of a batch: small fixes to a few modules, one added and one removed."""
    source = repo(FILES)
    commits = [git(source, "rev-parse", "HEAD").strip()]
    edits = [("pkg/mod03.py", FILES["pkg/mod03.py"].replace("return 7\n", "return -7\n")),
             ("pkg/new.py", "def added():\n    return 'new'\n"),
             ("pkg/mod11.py", FILES["pkg/mod11.py"] + "def f11_extra():\n    return None\n"),
             ("pkg/mod05.py", None)]
    for n, (path, text) in enumerate(edits):
        commits.append(commit_file(git, source, path, text, f"fix {n}"))
    return source, commits


def _packs(source, commits, tmp_path, batch, *, budget=None, delta=True) -> list:
    """Each commit's tree exported as `eval run` exports it, packed as the agent packs it in `batch`."""
    packs = []
    for n, commit in enumerate(commits):
        tree = hostgit.export_tree(source, commit, tmp_path / f"tree{n}")
        packer = BatchPacker(AgentConfig(), history=str(source), commit=commit, batch=batch,
                             reuse=ReuseConfig(delta=delta), counter=EstimateCounter())
        packs.append(packer.pack(tree, budget=budget))
    return packs


def test_every_instance_of_a_run_shows_the_base_files_byte_for_byte_then_its_diff(repo, git, tmp_path):
    source, commits = _history(repo, git)
    with PackCache(tmp_path / "cache") as cache:
        assert (ordered := order_for_commits(str(source), commits, cache, delta=True, cuts=CUTS)).runs == 1
        base = stored_run(str(source), ordered.batch, commits[0], cache).base
        assert base == commits[2]  # the middle commit of the run: the shortest diffs
        packs = _packs(source, commits, tmp_path, ordered.batch)
    plain = packs[2]
    assert plain.delta_base is None and "\n## Changes to the files above" not in plain.text
    sections = b"".join(plain.parts[: sections_end(plain)])
    for n, pack in enumerate(packs):
        if n == 2:
            continue
        assert pack.delta_base == base
        assert pack.data.startswith(sections)  # the whole base, shared with the base instance's own pack
        tail = pack.text[len(sections.decode()):]
        assert tail.startswith("## Changes to the files above\n")
        assert f"commit {base}" in tail and f"commit {commits[n]}" in tail
        assert len(tail) < 0.2 * len(pack.text)
        assert pack.tokens < len(pack.text)  # counted: the estimate of the whole text, not of the plain pack


def test_the_diff_takes_the_base_files_to_the_instance_commit(repo, git, tmp_path):
    source, commits = _history(repo, git)
    with PackCache(tmp_path / "cache") as cache:
        ordered = order_for_commits(str(source), commits, cache, delta=True, cuts=CUTS)
        packs = _packs(source, commits, tmp_path, ordered.batch)
    for n in (0, 4):  # one older than the base (the diff undoes later fixes), one newer (adds and removes files)
        diff = re.search(r"\n```diff\n(.*?)```\n", packs[n].text, re.S).group(1)
        work = hostgit.export_tree(source, commits[2], tmp_path / f"apply{n}")
        subprocess.run(["git", "-C", str(work), "apply", "-"], input=diff.encode(), check=True)
        want = hostgit.export_tree(source, commits[n], tmp_path / f"want{n}")
        got = {p.relative_to(work).as_posix(): p.read_bytes() for p in work.rglob("*") if p.is_file() and ".git" not in p.parts}
        expected = {p.relative_to(want).as_posix(): p.read_bytes() for p in want.rglob("*") if p.is_file() and ".git" not in p.parts}
        assert got == expected


def test_a_budgeted_pack_a_lone_commit_or_delta_off_stay_plain(repo, git, tmp_path):
    source, commits = _history(repo, git)
    with PackCache(tmp_path / "cache") as cache:
        lone = _packs(source, commits[:1], tmp_path / "lone", None)[0]  # no batch ordered: no base
        ordered = order_for_commits(str(source), commits, cache, delta=True, cuts=CUTS)
        off = _packs(source, commits[:1], tmp_path / "off", ordered.batch, delta=False)[0]
        whole = _packs(source, commits[:1], tmp_path / "whole", ordered.batch)[0]
        budgeted = _packs(source, commits[:1], tmp_path / "budgeted", ordered.batch, budget=whole.tokens // 2)[0]
    assert whole.delta_base == commits[2]
    assert lone.delta_base is None and off.delta_base is None
    assert budgeted.delta_base is None and "budget" in budgeted.skipped_by_reason()
    assert budgeted.tokens <= whole.tokens // 2


def test_a_diff_larger_than_its_share_of_the_base_leaves_the_pack_plain(repo, git, tmp_path):
    source = repo(FILES)
    commits = [git(source, "rev-parse", "HEAD").strip()]
    for n in range(2):  # each commit rewrites every module: the diffs are as large as the files
        for path, text in FILES.items():
            (source / path).write_text(text.replace("return", f"return {n} +"))
        git(source, "commit", "-qam", f"rewrite {n}")
        commits.append(git(source, "rev-parse", "HEAD").strip())
    with PackCache(tmp_path / "cache") as cache:
        ordered = order_for_commits(str(source), commits, cache, delta=True, cuts=CUTS)
        bases = {stored_run(str(source), ordered.batch, c, cache).base for c in commits}
        packs = _packs(source, commits, tmp_path, ordered.batch)
    assert all(p.delta_base is None for p in packs)
    assert bases - {None}  # a base was named, and the size rule alone kept the packs plain


def test_a_batch_is_cut_into_delta_runs_where_the_diff_from_the_run_start_grows_large(repo, git, tmp_path):
    source = repo(FILES)
    commits = []
    for era in range(2):  # every module rewritten between the eras, then small fixes within each
        for path, text in FILES.items():
            (source / path).write_text(text.replace("return", f"return {era} +"))
        git(source, "commit", "-qam", f"era {era}")
        for n in range(3):
            path = f"pkg/mod{n:02d}.py"
            (source / path).write_text((source / path).read_text().replace("return", "return -", 1))
            git(source, "commit", "-qam", f"fix {era} {n}")
            commits.append(git(source, "rev-parse", "HEAD").strip())
    with PackCache(tmp_path / "cache") as cache:
        assert (ordered := order_for_commits(str(source), commits, cache, delta=True, cuts=CUTS)).runs == 2
        bases = [stored_run(str(source), ordered.batch, c, cache).base for c in commits]
    assert bases == [commits[1]] * 3 + [commits[4]] * 3  # each era's middle commit


def test_a_diff_git_cannot_size_cuts_the_run_instead_of_failing_the_batch(repo, git, tmp_path, monkeypatch):
    source, commits = _history(repo, git)
    real = ordering.diff_bytes

    def failing(history, a, b):  # git cannot diff across the third commit
        return None if commits[2] in (a, b) else real(history, a, b)

    monkeypatch.setattr(ordering, "diff_bytes", failing)
    with PackCache(tmp_path / "cache") as cache:
        assert (ordered := order_for_commits(str(source), commits, cache, delta=True, cuts=CUTS)).runs == 3
        bases = [stored_run(str(source), ordered.batch, c, cache).base for c in commits]
    # the third commit runs alone (no diff to or from it); the others keep their runs' middles
    assert bases == [commits[0]] * 2 + [commits[2]] + [commits[3]] * 2


def test_neighbouring_roots_share_the_files_alike_between_them_as_a_head(repo, git, tmp_path):
    cuts = Cuts(root_diff_share=0.0)  # every run its own root
    source = repo(FILES)
    commits = []
    # three eras: modules 0-6 are rewritten entering the second, modules 7-9 entering the third;
    # small fixes within every era go to module 19; modules 10-18 never change
    for era, rewritten in enumerate([[], range(0, 7), range(7, 10)]):
        for i in rewritten:
            path = f"pkg/mod{i:02d}.py"
            (source / path).write_text((source / path).read_text().replace("return", f"return {era} +"))
        if rewritten:
            git(source, "commit", "-qam", f"era {era}")
        for n in range(3):
            path, k = "pkg/mod19.py", 3 * era + n
            (source / path).write_text((source / path).read_text().replace(f"return {k}\n", f"return -{k}\n"))
            git(source, "commit", "-qam", f"fix {era} {n}")
            commits.append(git(source, "rev-parse", "HEAD").strip())
    with PackCache(tmp_path / "cache") as cache:
        assert (ordered := order_for_commits(str(source), commits, cache, delta=True, cuts=cuts)).runs == 3
        bases = [stored_run(str(source), ordered.batch, c, cache).base for c in commits[1::3]]
        packs = _packs(source, bases, tmp_path, ordered.batch)
    assert bases == commits[1::3]

    def head(a, b) -> set[str]:  # the files whose whole sections two packs start with alike
        n = next((k for k, (x, y) in enumerate(zip(a.parts, b.parts)) if x != y), 0)
        return set(re.findall(r"^### (\S+)$", b"".join(a.parts[2: 2 + 3 * ((n - 2) // 3)]).decode(), re.M))

    def modules(numbers) -> set[str]:
        return {f"pkg/mod{i:02d}.py" for i in numbers}

    # modules 10-18 are alike at every base and lead; closing the first change frees modules 0-6,
    # more bytes than the second change's 7-9 (module 19 changes at both), so they come next: the
    # first two bases share modules 10-18, the last two 0-6 as well
    first, second = head(packs[0], packs[1]), head(packs[1], packs[2])
    assert first == modules(range(10, 19))
    assert second == modules(range(0, 7)) | modules(range(10, 19))


def _three_runs(repo, git, eras: int = 3) -> tuple:
    """A batch of three commits per era, each era a run: one module rewritten between eras, small
    fixes to module 19 within each. The diff between neighbouring runs' bases passes the run's
    share of the bytes (made small here)."""
    source = repo(FILES)
    commits = []
    for era in range(eras):
        if era:
            path = f"pkg/mod{era - 1:02d}.py"
            (source / path).write_text(FILES[path].replace("return", "return 100 +"))
            git(source, "commit", "-qam", f"era {era}")
        for n in range(3):
            k = 3 * era + n
            (source / "pkg/mod19.py").write_text((source / "pkg/mod19.py").read_text()
                                                 .replace(f"return {k}\n", f"return -{k}\n"))
            git(source, "commit", "-qam", f"fix {era} {n}")
            commits.append(git(source, "rev-parse", "HEAD").strip())
    return source, commits


def _tree_after(work, diffs: list[str]) -> dict[str, bytes]:
    for diff in diffs:
        subprocess.run(["git", "-C", str(work), "apply", "-"], input=diff.encode(), check=True)
    return _files(work)


def _files(tree) -> dict[str, bytes]:
    return {p.relative_to(tree).as_posix(): p.read_bytes() for p in tree.rglob("*") if p.is_file() and ".git" not in p.parts}


def test_runs_under_one_root_show_its_files_then_the_diff_to_their_base_alike(repo, git, tmp_path):
    # a module's rewrite starts a run, fixes do not; and the root is one rewrite from either base
    cuts = Cuts(delta_run_share=0.05, root_diff_share=0.2)
    source, commits = _three_runs(repo, git)
    with PackCache(tmp_path / "cache") as cache:
        assert (ordered := order_for_commits(str(source), commits, cache, delta=True, cuts=cuts)).runs == 3
        runs = [stored_run(str(source), ordered.batch, c, cache) for c in commits]
        packs = _packs(source, commits, tmp_path, ordered.batch)
    bases = commits[1::3]
    assert [r.base for r in runs] == [b for b in bases for _ in range(3)]
    root = bases[1]  # the middle run's base is every run's root
    assert {r.root for r in runs} == {root}
    sections = b"".join(packs[4].parts[: sections_end(packs[4])])
    assert packs[4].delta_base is None  # the root's own pack is plain
    for era in (0, 2):
        own = packs[3 * era + 1]  # the run's base: the root's files and the diff to the base, nothing more
        head = own.text[: own.text.index("Your checkout holds")]
        assert head.count("```diff\n") == 1 and f"`git diff {root} {bases[era]}`" in head
        for n in range(3 * era, 3 * era + 3):
            assert packs[n].delta_base == root and packs[n].data.startswith(sections)
            assert packs[n].text.startswith(head)  # the whole run shares the diff to its base as well
            diffs = re.findall(r"\n```diff\n(.*?)```\n", packs[n].text, re.S)
            assert len(diffs) == (1 if n == 3 * era + 1 else 2)
            got = _tree_after(hostgit.export_tree(source, root, tmp_path / f"apply{n}"), diffs)
            want = hostgit.export_tree(source, commits[n], tmp_path / f"want{n}")
            assert got == _files(want)
    # the other runs of the root: its files, then each its own diff
    assert packs[0].text[len(sections):].split("```diff\n")[1] != packs[6].text[len(sections):].split("```diff\n")[1]


def test_diffs_from_the_root_too_large_fall_back_to_the_runs_own_base(repo, git, tmp_path, monkeypatch):
    from m3_agent.evals.reuse import delta

    cuts = Cuts(delta_run_share=0.05, root_diff_share=0.2)
    source, commits = _three_runs(repo, git)
    with PackCache(tmp_path / "cache") as cache:
        ordered = order_for_commits(str(source), commits, cache, delta=True, cuts=cuts)
        monkeypatch.setattr(delta, "MAX_DIFF_SHARE", 0.03)  # a fix's diff fits, a module's rewrite does not
        packs = _packs(source, commits[:3], tmp_path, ordered.batch)
    assert [p.delta_base for p in packs] == [commits[1], None, commits[1]]
    for n in (0, 2):
        assert packs[n].text.count("```diff\n") == 1 and packs[n].data.startswith(b"".join(packs[1].parts[:sections_end(packs[1])]))
    # admission lays each pack out as the packer did: the base's files first (the base's own plain pack is those)
    assert [d.root for d in _admission_layouts(source, commits[:3], ordered.batch)] == [commits[1]] * 3
    monkeypatch.setattr(delta, "MAX_DIFF_SHARE", 0.5)  # now the diffs from the root fit: both take the root
    packs = _packs(source, commits[:3], tmp_path / "again", ordered.batch)
    roots = [d.root for d in _admission_layouts(source, commits[:3], ordered.batch)]
    assert [p.delta_base for p in packs] == roots and commits[1] not in roots


def _admission_layouts(source, commits, batch) -> list:
    """The delta pack sizes admission reckons with for tasks at `commits` (`KvAdmit.delta_size`)."""
    admit = KvAdmit(KvCapacity(tokens=10**7, source="test"), 4, repos=None, window=1_048_576,
                    reuse=Reuse(True, 0.0, {"o/r": batch}, {}))
    return [admit.delta_size(str(source), Task(instance_id=f"o__r-{n}", repo="o/r", base_commit=c, repo_source=str(source)))
            for n, c in enumerate(commits)]

def test_a_root_holds_the_runs_whose_bases_lie_within_its_share_of_it(repo, git, tmp_path):
    cuts = Cuts(delta_run_share=0.05, root_diff_share=0.15)  # one module's rewrite apart, not two
    source, commits = _three_runs(repo, git, eras=4)
    with PackCache(tmp_path / "cache") as cache:
        assert (ordered := order_for_commits(str(source), commits, cache, delta=True, cuts=cuts)).runs == 4
        runs = [stored_run(str(source), ordered.batch, c, cache) for c in commits]
    bases = commits[1::3]
    # the first three runs' bases lie one rewrite from the second's; the fourth two from it
    assert [r.root for r in runs] == [bases[1]] * 9 + [bases[3]] * 3
