"""`m3-agent fix` on real bug fixes of JavaScript and TypeScript repositories, with the M3 stand-in replaying
each fix: resolved or not is read from the repository's own tests run after the fix.

    .venv/bin/python benchmarks/fixbench_js.py --clones DIR [--only ufo,defu] [--keep-images]

The fixes are the `fixes` of `benchmarks/envbench_js_corpus.json`: a commit of the project's history that
fixed a bug and added a test for it. For each, a git repository is made at the commit's parent with the
commit's test changes applied and committed (the issue's failing test, as SWE-bench sets it up); the
issue is the commit's message. `fix_issue` (what `m3-agent fix` runs) then runs against the stand-in, a
scripted TEST DOUBLE that speaks vLLM's wire format, not a model. Its turns: test_runner on the chosen
test file (it must fail), bash applying the commit's own change to the source files with `git apply`,
test_runner again, submit. Every tool call runs in the real Docker sandbox on the repository's
environment (built first when the host has none for its key: the figure says which).

Per fix: the status `fix` gave (resolved: tests ran on the final patch and passed), the test file's counts
before and after the fix as the model read them, whether the environment was built, and the wall time.
The floor is the same script with the change left out (bash applies nothing): it must not resolve.
Prints one line per fix, then one JSON object (the last line): the rows and how many resolved.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from m3_agent.fix.flow import fix_issue
from m3_agent.sandbox.env.catalogue import prune_environments
from m3_agent.settings import load_settings
from m3_agent.standin.server import StandinServer

sys.path.insert(0, str(Path(__file__).parent))
from envbench_js import CORPUS, clone_of  # noqa: E402 - the benchmark beside this one

GIT = ["git", "-c", "user.name=fixbench", "-c", "user.email=fixbench@example.com"]
COUNTS = re.compile(r": (\d+) passed, (\d+) failed, (\d+) errors")


def git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def setup(clone: Path, fix: dict, dest: Path) -> tuple[Path, str, str]:
    """A repository at the fix's parent with its test changes committed; (repo, the issue, the source change)."""
    commit = fix["commit"]
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(clone), str(dest)], check=True)
    git(dest, "checkout", "-q", "-b", "fixbench", f"{commit}^")
    git(dest, "checkout", commit, "--", *fix["tests"])
    git(dest, "commit", "-qm", f"the tests of {commit[:10]}")
    change = git(dest, "diff", f"{commit}^", commit, "--", *fix["source"])
    issue = git(dest, "log", "-1", "--format=%B", commit)
    return dest, issue, change


def script(test: str, change: str | None) -> dict:
    """The stand-in's turns: the failing test, the commit's change applied (none for the floor), the test, submit."""
    run = {"tool_calls": [{"name": "test_runner", "arguments": {"test_file": test}}]}
    patch = (f"cat > /tmp/fix.patch <<'M3_PATCH_END'\n{change}M3_PATCH_END\ngit apply /tmp/fix.patch && git diff --stat"
             if change else "git status --short")
    edit = {"tool_calls": [{"name": "bash", "arguments": {"command": patch}}]}
    submit = {"content": "The test passes.", "tool_calls": [{"name": "submit", "arguments": {"summary": "fixed"}}]}
    return {"turns": [run, edit, run, submit]}


def counts(text: str) -> list[int] | None:
    m = COUNTS.search(text.splitlines()[0] if text else "")
    return [int(g) for g in m.groups()] if m else None


def run_fix(repo: Path, issue: Path, test: str, change: str | None) -> dict:
    """One `fix_issue` against a fresh stand-in: its status, the test counts the model read, the wall time."""
    with StandinServer(script(test, change)) as srv:
        settings, _ = load_settings(repo, {"--base-url": srv.base_url})
        t0 = time.monotonic()
        result = fix_issue(str(issue), repo=repo, settings=settings)
        wall = time.monotonic() - t0
        tools = [m["content"] for m in srv.requests[-1]["messages"] if m["role"] == "tool"] if srv.requests else []
    tests = [t for t in tools if COUNTS.search(t.splitlines()[0] if t else "")]
    return {"status": result.status, "before": counts(tests[0]) if tests else None,
            "after": counts(tests[-1]) if len(tests) > 1 else None, "wall_s": round(wall, 1),
            "built": any(n.startswith("built the repository's environment") for n in result.notices),
            "environment": result.environment, "error": result.run.error,
            "patch_lines": result.patch.count("\n")}


def bench_one(fix: dict, clone: Path, work: Path) -> dict:
    repo, issue_text, change = setup(clone, fix, work / fix["name"])
    issue = work / f"{fix['name']}.issue.md"
    issue.write_text(issue_text)
    row = {"name": fix["name"], "github": fix["github"], "commit": fix["commit"], "test": fix["test"]}
    row["fix"] = run_fix(repo, issue, fix["test"], change)
    row["floor"] = run_fix(repo, issue, fix["test"], None)
    row["resolved"] = (row["fix"]["status"] == "resolved" and row["floor"]["status"] != "resolved"
                       and bool(row["fix"]["before"]) and row["fix"]["before"][1] + row["fix"]["before"][2] > 0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clones", type=Path, required=True)
    parser.add_argument("--only", default="")
    parser.add_argument("--keep-images", action="store_true", help="keep the environment images built")
    args = parser.parse_args()
    fixes = json.loads(CORPUS.read_text())["fixes"]
    if args.only:
        fixes = [f for f in fixes if f["name"] in args.only.split(",")]
    work = Path(tempfile.mkdtemp(prefix="m3-agent-fixbench-js-"))
    rows = []
    try:
        for fix in fixes:
            row = bench_one(fix, clone_of(args.clones, fix["github"]), work)
            rows.append(row)
            f, fl = row["fix"], row["floor"]
            print(f"{row['name']} {row['commit'][:10]}: fix {f['status']} (tests before {f['before']}, after "
                  f"{f['after']}, built {f['built']}, {f['wall_s']} s); floor {fl['status']}; resolved={row['resolved']}",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep_images:
            for fix in fixes:
                prune_environments(keep=0, source=fix["name"])
    print(json.dumps({"rows": rows, "summary": {"fixes": len(rows), "resolved": sum(r["resolved"] for r in rows),
                                                "floor_resolved": sum(r["floor"]["status"] == "resolved" for r in rows)}}))


if __name__ == "__main__":
    main()
