"""Benchmark: does the budgeted pack hold the files a real fix changed? Ours vs BM25, in one run.

Instances are real bug fixes from the git history of public repositories (see docs/pack_recall.md
for how to obtain the clones and the exact selection rule). For each fix, the tree packed is the
fix's parent commit, the issue text is the fix's commit message, and the gold files are the
non-test, non-doc files the fix modified. At each budget (1M / 200k / 50k tokens):

  ours   `m3-agent pack --repo TREE --budget B --issue ISSUE --no-cache`, the files whose sections
         the pack holds, the files it shows only as outlines, and the characters of file content
         and of outlines it used
  bm25   bm25s over the same candidate files (those the pack's tree lists as packable), documents
         "path\\ncontent", filled highest score first up to the characters ours used (contents and
         outlines together)

Metrics: all-gold recall (share of instances whose pack holds every gold file in full), file-level
recall (gold files held in full / gold files, over all instances), the same counting a file seen
as an outline (`ours_seen_*`: reported beside, never in place of, the full-file figures) and pack
time. A budget counts an instance only where the repository's candidate files hold at least twice the
characters ours packed (`MIN_REPO_TO_PACK`): a pack of more than half the repository holds nearly
everything whatever the ranking. Those instances are reported apart (`near_fit_<budget>`).
`min_margin_points` is the smallest lead of ours over BM25 in all-gold recall over the repositories
and budgets measured, and `target_met` whether it is at least 5 points.

    python benchmarks/pack_recall.py --repo sympy=PATH --repo PATH ... [--limit 20] [--cache-dir DIR]

BM25 is bm25s, which m3-agent itself depends on (its ranker's content signal); outside the project's
environment, `pip install -r benchmarks/requirements-pack-recall.txt`.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _recall_pack import PackView, read_pack  # noqa: E402

BUDGETS = {"1m": 1_000_000, "200k": 200_000, "50k": 50_000}
MAX_FILE_BYTES = 1_048_576  # the packer's default: a bigger gold file could never be packed
SCAN_COMMITS = 6000  # non-merge commits looked at per repository, newest first
# A budget is a ranking test only where the repository is at least this many times what the pack holds:
# a pack holding more than half of it holds nearly everything whatever the ranking (docs/pack_recall.md).
MIN_REPO_TO_PACK = 2.0
TARGET_POINTS = 5.0  # the issue's target: ours at least this many points above BM25 in every measured cell

# A subject that reads like a bug fix, and subjects that fix something other than behaviour.
FIX_RE = re.compile(r"\b(fix(es|ed|ing)?|bug(fix)?|regression|crash(es|ed)?|incorrect(ly)?|wrong)\b", re.I)
NOT_BEHAVIOUR_RE = re.compile(
    r"\b(typos?|docs?|docstrings?|documentation|changelog|readme|lint(ing)?|flake8|mypy|pyright|ruff|pylint|"
    r"pre-commit|ci|spelling|whitespace|formatting|style|cleanups?|refactor(ing)?|unused imports?|typing|type hints?|"
    r"annotations?|duplicated words?)\b|^(MNT|DOC|TST|CI|STY):", re.I)
MERGE_LINE_RE = re.compile(r"^Merge pull request #\d+ from \S+\s*")  # a linearized merge: its body is the PR title
NOT_SOURCE = frozenset({"AUTHORS", "AUTHORS.rst", "CONTRIBUTORS", "CONTRIBUTORS.txt", ".mailmap"})
TRAILER_RE = re.compile(r"^(co-authored-by|signed-off-by|reviewed-by|cc):.*$", re.I | re.M)
TEST_DIRS = frozenset({"test", "tests", "testing"})
DOC_DIRS = frozenset({"doc", "docs", "changelog", "changes"})
DOC_EXTS = (".rst", ".md", ".txt")


@dataclass
class Instance:
    """One real fix: the parent tree to pack, the issue text, and the files the fix changed."""

    repo: str
    sha: str
    parent: str
    issue: str
    gold: tuple[str, ...]

    @property
    def subject(self) -> str:
        return self.issue.splitlines()[0]


@dataclass
class Outcome:
    """What one packer held of one instance at one budget."""

    held: list[str]
    chars: int
    seconds: float
    ranks: dict[str, int | None] = field(default_factory=dict)  # gold file -> rank from 1 (ours: among the left-out)
    outlined: list[str] = field(default_factory=list)  # ours: files shown only as outlines


def git(git_dir: str | Path, *args: str) -> str:
    """Output of a git command run in `git_dir` (a bare repository or a work tree)."""
    out = subprocess.run(["git", "-C", str(git_dir), *args], capture_output=True, check=True)
    return out.stdout.decode("utf-8", "replace")


def is_test_path(path: str) -> bool:
    """A test file: under a test directory, or named like a test module or pytest's conftest."""
    parts = path.split("/")
    name = parts[-1]
    return (any(p in TEST_DIRS for p in parts[:-1]) or name.startswith("test_") or name.endswith("_test.py")
            or name == "conftest.py")


def is_doc_path(path: str) -> bool:
    """Documentation, a changelog entry or a list of authors: not where a fix's behaviour lives."""
    return path.split("/")[0] in DOC_DIRS or path.lower().endswith(DOC_EXTS) or path in NOT_SOURCE


def issue_text(message: str) -> str:
    """The commit message without its trailers (nor a merge line), as the issue the fix answers."""
    text = MERGE_LINE_RE.sub("", message.strip())
    return re.sub(r"\n{3,}", "\n\n", TRAILER_RE.sub("", text)).strip() + "\n"


def gold_files(git_dir: str | Path, parent: str, sha: str, max_files: int, max_lines: int) -> tuple[str, ...] | None:
    """The non-test, non-doc text files the fix modified in place, or None when the commit is not a
    usable instance (too big, binary, nothing but tests and docs, a gold file too large to pack)."""
    numstat = git(git_dir, "diff-tree", "-r", "--no-renames", "--numstat", parent, sha).splitlines()
    status = dict(line.split("\t", 1)[::-1] for line in
                  git(git_dir, "diff-tree", "-r", "--no-renames", "--name-status", parent, sha).splitlines())
    if not numstat or len(numstat) > max_files:
        return None
    lines, gold = 0, []
    for row in numstat:
        added, deleted, path = row.split("\t", 2)
        if added == "-":  # binary
            return None
        lines += int(added) + int(deleted)
        if status.get(path) == "M" and not is_test_path(path) and not is_doc_path(path):
            gold.append(path)
    if lines > max_lines or not gold or len(gold) > 6:
        return None
    for path in gold:
        if int(git(git_dir, "cat-file", "-s", f"{parent}:{path}")) > MAX_FILE_BYTES:
            return None
    return tuple(sorted(gold))


def select_instances(git_dir: str | Path, name: str, count: int, rev: str = "HEAD", max_files: int = 12,
                     max_lines: int = 400) -> list[Instance]:
    """The `count` most recent fixes reachable from `rev` that pass the rule in docs/pack_recall.md."""
    log = git(git_dir, "log", "--no-merges", f"-n{SCAN_COMMITS}", "--format=%H%x00%P%x00%B%x01", rev)
    found: list[Instance] = []
    subjects: set[str] = set()
    for record in log.split("\x01"):
        if len(found) >= count:
            break
        fields = record.strip("\n").split("\x00")
        if len(fields) != 3:
            continue
        sha, parents, message = fields
        issue = issue_text(message)
        subject = issue.splitlines()[0]
        if (" " in parents or not FIX_RE.search(subject) or NOT_BEHAVIOUR_RE.search(subject)
                or len(issue.split()) < 4 or subject in subjects):
            continue
        gold = gold_files(git_dir, parents, sha, max_files, max_lines)
        if gold:
            subjects.add(subject)
            found.append(Instance(name, sha, parents, issue, gold))
    return found


class Checkout:
    """A work tree of one repository, moved from commit to commit: a `git clone --shared` of the
    user's clone under the cache (the user's clone is never written to)."""

    def __init__(self, source: str | Path, cache: Path, name: str) -> None:
        self.tree = cache / "trees" / name
        if not (self.tree / ".git").exists():
            shutil.rmtree(self.tree, ignore_errors=True)
            self.tree.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(source), str(self.tree)], check=True)

    def at(self, sha: str) -> Path:
        """The work tree with exactly commit `sha` checked out, nothing untracked left over."""
        git(self.tree, "-c", "advice.detachedHead=false", "checkout", "-q", "-f", "--detach", sha)
        git(self.tree, "clean", "-qffdx")
        return self.tree

    def blobs(self) -> dict[str, str]:
        """Path -> blob id of every tracked file at the checked-out commit."""
        out = {}
        for line in git(self.tree, "ls-files", "-s", "-z").split("\0"):
            if line:
                meta, path = line.split("\t", 1)
                out[path] = meta.split()[1]
        return out


def run_ours(exe: str, tree: Path, issue_file: Path, budget: int, out: Path) -> tuple[PackView, float]:
    """Our pack of `tree` at `budget` made by the installed command, and its wall time."""
    started = time.perf_counter()
    done = subprocess.run([exe, "pack", "--repo", str(tree), "--budget", str(budget), "--issue", str(issue_file),
                           "--no-cache", "-o", str(out)], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"m3-agent pack failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return read_pack(out.read_bytes()), seconds


class Bm25Ranker:
    """BM25 (the bm25s library) over a commit's candidate files; tokens cached by blob across commits."""

    def __init__(self) -> None:
        import bm25s  # noqa: F401  (fail early with the install hint)

        self.tokens: dict[str, list[str]] = {}

    def rank(self, tree: Path, candidates: list[str], blobs: dict[str, str],
             issue: str) -> tuple[list[tuple[str, int]], float]:
        """Candidates as (path, characters), highest score first (ties: path order), and seconds taken."""
        import bm25s

        started = time.perf_counter()
        chars, new = {}, []
        for path in candidates:
            text = (tree / path).read_bytes().decode("utf-8", "replace")
            chars[path] = len(text)
            key = blobs.get(path, path)
            if key not in self.tokens:
                new.append((key, f"{path}\n{text}"))
        if new:
            made = bm25s.tokenize([doc for _, doc in new], return_ids=False, stopwords="en", show_progress=False)
            self.tokens.update(zip((k for k, _ in new), made))
        retriever = bm25s.BM25()
        retriever.index([self.tokens[blobs.get(p, p)] for p in candidates], show_progress=False)
        query = bm25s.tokenize([issue], return_ids=False, stopwords="en", show_progress=False)[0]
        scores = retriever.get_scores(query) if query else [0.0] * len(candidates)
        order = sorted(range(len(candidates)), key=lambda i: (-float(scores[i]), candidates[i]))
        return [(candidates[i], chars[candidates[i]]) for i in order], time.perf_counter() - started


def fill(ranked: list[tuple[str, int]], limit: int) -> list[str]:
    """Files taken in rank order while their characters fit in `limit` (one that does not fit is passed over)."""
    held, used = [], 0
    for path, chars in ranked:
        if used + chars <= limit:
            held.append(path)
            used += chars
    return held


def run_instance(inst: Instance, checkout: Checkout, ranker: Bm25Ranker, exe: str, work: Path,
                 budgets: dict[str, int]) -> dict:
    """Both packers on one instance at every budget: a record of what each held."""
    tree = checkout.at(inst.parent)
    issue_file = work / "issue.txt"
    issue_file.write_text(inst.issue, encoding="utf-8")
    ours: dict[str, Outcome] = {}
    candidates: list[str] | None = None
    for key, budget in sorted(budgets.items(), key=lambda kv: -kv[1]):
        view, seconds = run_ours(exe, tree, issue_file, budget, work / "pack.md")
        if candidates is None and not view.tree_shortened:  # the largest budget's whole tree, normally 1M's
            candidates = view.candidates
        ours[key] = Outcome(view.files, view.content_chars + view.outline_chars, seconds,
                            {g: view.left_out.index(g) + 1 if g in view.left_out else None for g in inst.gold},
                            view.outlined)
    if not candidates:
        raise RuntimeError(f"{inst.repo} {inst.sha[:10]}: the pack's tree was shortened at every budget")
    ranked, bm25_s = ranker.rank(tree, candidates, checkout.blobs(), inst.issue)
    position = {p: i for i, (p, _) in enumerate(ranked)}
    bm25 = {key: Outcome(fill(ranked, ours[key].chars), ours[key].chars, bm25_s,
                         {g: position[g] + 1 if g in position else None for g in inst.gold}) for key in budgets}
    sizes = {p: c for p, c in ranked if p in inst.gold}
    return {"repo": inst.repo, "sha": inst.sha, "subject": inst.subject, "gold": list(inst.gold),
            "gold_chars": sizes, "reachable": all(g in position for g in inst.gold), "candidates": len(candidates),
            "repo_chars": sum(c for _, c in ranked),
            "ours": {k: _outcome_record(o, inst.gold) for k, o in ours.items()},
            "bm25": {k: _outcome_record(o, inst.gold) for k, o in bm25.items()}}


def _outcome_record(o: Outcome, gold: tuple[str, ...]) -> dict:
    held, outlined = set(o.held), set(o.outlined)
    return {"found": [g for g in gold if g in held], "outlined": [g for g in gold if g in outlined],
            "files": len(o.held), "outlines": len(o.outlined), "chars": o.chars,
            "seconds": round(o.seconds, 3), "gold_ranks": o.ranks}


def measured(record: dict, key: str) -> bool:
    """Whether this instance tests ranking at budget `key`: its repository is at least MIN_REPO_TO_PACK
    times the characters ours packed there (records written before `repo_chars` count as measured)."""
    return record.get("repo_chars", float("inf")) >= MIN_REPO_TO_PACK * record["ours"][key]["chars"]


def all_gold(rows: list[dict], who: str, key: str) -> float:
    """Share of `rows` whose pack by `who` at `key` holds every gold file in full."""
    return round(sum(len(r[who][key]["found"]) == len(r["gold"]) for r in rows) / max(1, len(rows)), 4)


def summarize(records: list[dict], budgets: dict[str, int]) -> dict:
    """All-gold recall, file-level recall and times, overall and per repository; the target's verdict.

    Each budget's figures count the instances it measures (`measured`); the others are reported
    apart, under `near_fit_<budget>`, never mixed in."""
    def block(rows: list[dict]) -> dict:
        out: dict = {"instances": len(rows)}
        for key in budgets:
            near = [r for r in rows if not measured(r, key)]
            if near:
                out[f"near_fit_{key}"] = {"instances": len(near), "ours_all": all_gold(near, "ours", key),
                                          "bm25_all": all_gold(near, "bm25", key)}
            part = [r for r in rows if measured(r, key)]
            out[f"instances_{key}"] = len(part)
            gold = sum(len(r["gold"]) for r in part)
            for who in ("ours", "bm25"):
                out[f"{who}_all_{key}"] = all_gold(part, who, key)
                out[f"{who}_file_recall_{key}"] = round(sum(len(r[who][key]["found"]) for r in part) / max(1, gold), 4)
            seen = [len(r["ours"][key]["found"]) + len(r["ours"][key].get("outlined", [])) for r in part]
            out[f"ours_seen_all_{key}"] = round(sum(n == len(r["gold"]) for n, r in zip(seen, part)) / max(1, len(part)), 4)
            out[f"ours_seen_file_recall_{key}"] = round(sum(seen) / max(1, gold), 4)
            times = [r["ours"][key]["seconds"] for r in rows]
            out[f"ours_pack_s_median_{key}"] = round(statistics.median(times), 3) if times else None
            out[f"ours_pack_s_max_{key}"] = round(max(times), 3) if times else None
        bm25_times = [r["bm25"][next(iter(budgets))]["seconds"] for r in rows]
        out["bm25_rank_s_median"] = round(statistics.median(bm25_times), 3) if bm25_times else None
        out["unreachable_instances"] = sum(not r["reachable"] for r in rows)
        return out

    result = block(records)
    result["per_repo"] = {name: block([r for r in records if r["repo"] == name])
                          for name in sorted({r["repo"] for r in records})}
    margins = [100 * (s[f"ours_all_{key}"] - s[f"bm25_all_{key}"])
               for s in result["per_repo"].values() for key in budgets if s[f"instances_{key}"]]
    result["min_margin_points"] = round(min(margins), 1) if margins else None
    result["target_met"] = bool(margins) and round(min(margins), 1) >= TARGET_POINTS
    return result


def print_table(summary: dict, budgets: dict[str, int]) -> None:
    """The human-readable table: all-gold and file-level recall, ours vs BM25, per repository and budget."""
    print(f"{'repository':<12} {'n':>3} {'budget':>6}  {'ours all':>8} {'bm25 all':>8}  {'ours file':>9} "
          f"{'bm25 file':>9}  {'ours seen':>9}  {'ours s (med/max)':>16}")
    rows = [*summary["per_repo"].items(), ("ALL", summary)]
    for name, s in rows:
        for key in budgets:
            near = s.get(f"near_fit_{key}")
            if near:
                print(f"{name:<12} {near['instances']:>3} {key:>6}  {near['ours_all']:>8.0%} {near['bm25_all']:>8.0%}  "
                      f"near fit: the pack held over 1/{MIN_REPO_TO_PACK:g} of the repository, not counted")
            if not s[f"instances_{key}"]:
                continue
            print(f"{name:<12} {s[f'instances_{key}']:>3} {key:>6}  "
                  f"{s[f'ours_all_{key}']:>8.0%} {s[f'bm25_all_{key}']:>8.0%}  "
                  f"{s[f'ours_file_recall_{key}']:>9.0%} {s[f'bm25_file_recall_{key}']:>9.0%}  "
                  f"{s[f'ours_seen_all_{key}']:>9.0%}  "
                  f"{s[f'ours_pack_s_median_{key}']:>7.2f}/{s[f'ours_pack_s_max_{key}']:<7.2f}")


def print_misses(records: list[dict], budgets: dict[str, int]) -> None:
    """Every gold file ours left out, with its size and where ours and BM25 ranked it."""
    print("\ngold files ours left out (ours: rank from 1 in the footer's left-out list, '-' past its first 25; "
          "bm25: rank from 1 among all candidates)")
    for r in records:
        for key in budgets:
            missing = [g for g in r["gold"] if g not in r["ours"][key]["found"]]
            for g in missing:
                bm25_has = "held" if g in r["bm25"][key]["found"] else "missed"
                outlined = " (outlined)" if g in r["ours"][key].get("outlined", []) else ""
                ours_rank = r["ours"][key]["gold_ranks"].get(g)
                print(f"  {r['repo']} {r['sha'][:10]} {key:>4} {g}{outlined} ({r['gold_chars'].get(g, 0):,} chars) "
                      f"ours rank {'-' if ours_rank is None else ours_rank}, bm25 rank "
                      f"{r['bm25'][key]['gold_ranks'].get(g)} ({bm25_has})  | {r['subject'][:70]}")


def parse_repos(values: list[str], repos_dir: str | None) -> list[tuple[str, Path]]:
    """`--repo [NAME=]PATH` values and the git repositories directly under `--repos-dir`, as (name, path)."""
    out = []
    for value in values:
        name, _, path = value.rpartition("=") if "=" in value else ("", "", value)
        out.append((name or Path(path).name.removesuffix(".git"), Path(path)))
    if repos_dir:
        for child in sorted(Path(repos_dir).iterdir()):
            if (child / ".git").exists() or (child / "HEAD").is_file():
                out.append((child.name.removesuffix(".git"), child))
    for name, path in out:
        if subprocess.run(["git", "-C", str(path), "rev-parse", "--git-dir"], capture_output=True).returncode != 0:
            fail(f"pack_recall: not a git repository: {path}")
    return out


def fail(message: str) -> NoReturn:
    """One line on stderr, exit status 2 (bad input, or git or m3-agent failing on it)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    """Run the benchmark; bad input or a failing git or m3-agent is one line on stderr and exit 2."""
    try:
        run(sys.argv[1:])
    except subprocess.CalledProcessError as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr or "")
        first = (err.strip().splitlines() or [""])[0]
        fail(f"pack_recall: {' '.join(map(str, e.cmd[:5]))} failed: {first[:300]}")
    except RuntimeError as e:
        fail(f"pack_recall: {e}")


def run(argv: list[str]) -> None:
    """Parse the options, run every instance of every repository, print the tables and the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", action="append", default=[], help="[NAME=]PATH of a clone with its history; repeatable")
    ap.add_argument("--repos-dir", help="a directory whose subdirectories are clones")
    ap.add_argument("--limit", type=int, default=20, help="instances per repository (default 20)")
    ap.add_argument("--rev", default="HEAD", help="the commit the history is read back from (default HEAD)")
    ap.add_argument("--budgets", default=",".join(BUDGETS), help="which of 1m,200k,50k to run")
    ap.add_argument("--m3-agent", dest="exe", help="the m3-agent command (default: the one beside this Python)")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "m3-agent-pack-recall")
    ap.add_argument("--details", type=Path, help="write one JSON record per instance here")
    args = ap.parse_args(argv)
    repos = parse_repos(args.repo, args.repos_dir)
    if not repos:
        fail("pack_recall: give at least one --repo PATH or --repos-dir DIR (see docs/pack_recall.md)")
    budgets = {k: BUDGETS[k] for k in args.budgets.split(",") if k in BUDGETS}
    exe = args.exe or str(Path(sys.executable).with_name("m3-agent"))
    if not os.path.exists(exe):
        exe = shutil.which("m3-agent") or fail("pack_recall: no m3-agent command: pass --m3-agent PATH")
    try:
        ranker = Bm25Ranker()
    except ImportError:
        fail("pack_recall: BM25 needs bm25s: pip install -r benchmarks/requirements-pack-recall.txt")
    work = args.cache_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    records, started = [], time.perf_counter()
    for name, path in repos:
        instances = select_instances(path, name, args.limit, args.rev)
        head = git(path, "rev-parse", args.rev).strip()
        print(f"{name}: {len(instances)} instances from {head[:12]}", file=sys.stderr)
        checkout = Checkout(path, args.cache_dir, name)
        ranker.tokens.clear()
        for inst in instances:
            rec = run_instance(inst, checkout, ranker, exe, work, budgets)
            rec["head"] = head
            records.append(rec)
            print(f"  {inst.sha[:10]} gold {len(inst.gold)} ours " + " ".join(
                f"{k}:{len(rec['ours'][k]['found'])}" for k in budgets) + " bm25 " + " ".join(
                f"{k}:{len(rec['bm25'][k]['found'])}" for k in budgets) + f"  {inst.subject[:60]}", file=sys.stderr)
            if args.details:
                with args.details.open("a" if len(records) > 1 else "w") as f:
                    f.write(json.dumps(rec) + "\n")
    summary = summarize(records, budgets)
    summary["run_s"] = round(time.perf_counter() - started, 1)
    summary["repos"] = {name: git(path, "rev-parse", args.rev).strip() for name, path in repos}
    print_table(summary, budgets)
    print_misses(records, budgets)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
