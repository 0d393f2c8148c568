"""JavaScript and TypeScript environments: `m3-agent env build` and one test file through test_runner, on a
fixed corpus of public repositories.

    .venv/bin/python benchmarks/envbench_js.py --clones DIR [--only ufo,mitt] [--markdown table.md] [--keep-images]

The corpus is `benchmarks/envbench_js_corpus.json` (12 repositories across npm, yarn 1 and pnpm; Jest,
Vitest, Mocha, node:test, AVA and tap; 8 in TypeScript; one pnpm monorepo), each at a fixed commit with
one chosen test file. The clones are not in this repository: DIR holds one git repository per entry at
`DIR/<owner>+<name>/repo` or `DIR/<owner>+<name>` (bare or a work tree).

For each repository, in a fresh checkout of its commit (a git repository, as `fix` sees it):
  cold_s    the environment built with no image for its key (one found is removed first; what the host's
            npm cache holds is not downloaded again), timed without waiting for other builds on the host
  warm_s    the environment asked for again (`ensure_environment`, what `fix` calls): the image is found
  warm_cli_s  `m3-agent env build` then, a process of its own: held against help_s
  help_s    `m3-agent --help` in the same run: the floor warm_cli_s is held against (warm_over_help_s)
  size_mb   the environment image's size
  tests     the chosen test file through test_runner (framework auto: the runner the test script names) in
            a sandbox with network none, as the agent's runs: passed / failed / errors; `runs` is >= 90%
            of them passing
  floor     the same test_runner call on the plain sandbox image, as a repository without the builder gets it
A build that fails keeps its row with the exit code and the build's error line as the cause.

Prints one line per repository, then one JSON object (the last line): each row's figures and the summary
(share that runs, goal 0.8; the floor's share; the largest warm_s, goal 0.5 s). `--markdown FILE` also
writes the table for docs/environments.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

import docker.errors

from m3_agent.errors import M3AgentError
from m3_agent.sandbox import DEFAULT_IMAGE, Sandbox, SandboxConfig
from m3_agent.sandbox.engine import docker_client
from m3_agent.sandbox.env.build import (ENV_REPOSITORY, build_environment, ensure_environment, read_request, request_for,
                                        request_key)
from m3_agent.sandbox.env.catalogue import prune_environments
from m3_agent.tools.test_runner import TestRunner, TestRunnerArgs

CORPUS = Path(__file__).with_name("envbench_js_corpus.json")
PASS_SHARE = 0.9
RUN_GOAL, WARM_GOAL_S = 0.8, 0.5
BUILD_TIMEOUT_S = 3600.0
M3 = [str(Path(sys.executable).with_name("m3-agent"))]  # the console script, as a user runs it


def clone_of(clones: Path, github: str) -> Path:
    """The clone of `github` (owner/name) under `clones`."""
    for candidate in (clones / github.replace("/", "+") / "repo", clones / github.replace("/", "+")):
        if candidate.exists():
            return candidate
    raise SystemExit(f"no clone of {github} under {clones}: fetch it first")


def checkout(clone: Path, commit: str, dest: Path) -> Path:
    """A fresh work tree of `clone` at `commit`, its own repository (the agent's copy is one too)."""
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(clone), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", commit], check=True)
    return dest


def m3(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    proc = subprocess.run([*M3, *args], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    return time.monotonic() - t0, proc


def build(repo: Path, name: str) -> dict:
    """A cold build of `repo`'s environment (an image of its key is removed first), then the warm lookup
    in-process and through `m3-agent env build`: times, tag, size, or the error line and exit code.

    The cold build calls `build_environment` directly: on this shared machine `env build` would first
    wait for other people's builds (one build at a time per host), which is not the build's own time."""
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    request = request_for(repo, SandboxConfig(image=DEFAULT_IMAGE), history=(repo, commit.strip()), source=name)
    t0 = time.monotonic()
    try:
        with closing(docker_client()) as client:
            read = read_request(request)
            key, _ = request_key(client, request, read)
            tag = f"{ENV_REPOSITORY}:{key}"
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(tag)  # cold: this key's image goes first
            build_environment(client, request, tag, key, None, read)
            cold_s = time.monotonic() - t0
            size = client.images.get(tag).attrs.get("Size", 0) / 1e6
    except M3AgentError as e:
        return {"cold_s": round(time.monotonic() - t0, 1), "exit_code": e.exit_code, "error": str(e)[:400]}
    t1 = time.monotonic()
    ensure_environment(request)
    warm_s = time.monotonic() - t1
    cli_s, proc = m3("env", "build", "--repo", str(repo))
    return {"cold_s": round(cold_s, 1), "warm_s": round(warm_s, 3), "warm_cli_s": round(cli_s, 3), "tag": tag,
            "size_mb": round(size), "exit_code": proc.returncode}


def run_test(repo: Path, image: str, test: str) -> dict:
    """The test file through test_runner in a sandbox of `image`: its counts, the runner, the problem."""
    try:
        with Sandbox(SandboxConfig(image=image), repo=repo) as sb:
            t0 = time.monotonic()
            result = TestRunner(timeout=900).run(TestRunnerArgs(test_file=test), sb)
            seconds = time.monotonic() - t0
    except M3AgentError as e:
        return {"runs": False, "problem": str(e)[:300]}
    data = result.data
    ran = data["passed"] + data["failed"] + data["errors"]
    runs = ran > 0 and data["passed"] >= PASS_SHARE * ran
    problem = (data.get("problem") or "").splitlines()[0][:300] if data.get("problem") else None
    return {"runner": data["framework"], "passed": data["passed"], "failed": data["failed"], "errors": data["errors"],
            "runs": runs, "test_s": round(seconds, 1), "problem": problem,
            "first_failure": (data["failing"][0]["id"] + ": " + data["failing"][0]["message"])[:300]
            if data["failing"] else None}


def bench_one(entry: dict, clone: Path, work: Path, keep: bool) -> dict:
    repo = checkout(clone, entry["head"]["commit"], work / entry["name"])
    row = {"name": entry["name"], "github": entry["github"], "manager": entry["manager"], "runner": entry["runner"],
           "typescript": entry["typescript"], "monorepo": entry["monorepo"], "test": entry["head"]["test"]}
    row.update(build(repo, entry["name"]))
    row["tests"] = run_test(repo, row["tag"], row["test"]) if row["exit_code"] == 0 else {"runs": False}
    row["floor"] = run_test(repo, DEFAULT_IMAGE, row["test"])
    if not keep and row.get("tag"):
        prune_environments(keep=0, source=entry["name"])
    return row


def summary(rows: list[dict], help_s: float) -> dict:
    runs = sum(r["tests"]["runs"] for r in rows)
    warm = [r["warm_s"] for r in rows if "warm_s" in r]
    cli = [r["warm_cli_s"] for r in rows if "warm_cli_s" in r]
    return {"repositories": len(rows), "built": sum(r["exit_code"] == 0 for r in rows), "tests_run": runs,
            "run_share": round(runs / len(rows), 3) if rows else None, "run_goal": RUN_GOAL,
            "floor_run_share": round(sum(r["floor"]["runs"] for r in rows) / len(rows), 3) if rows else None,
            "max_warm_s": max(warm) if warm else None, "warm_goal_s": WARM_GOAL_S, "help_s": round(help_s, 3),
            "warm_over_help_s": round(max(cli) - help_s, 3) if cli else None}


def markdown(rows: list[dict]) -> str:
    lines = ["| repository | manager | runner | TS | build (cold / warm) | image | test file: passed / failed | floor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        t = r["tests"]
        built = (f"{r['cold_s']:.0f} s / {r['warm_s']:.2f} s" if r["exit_code"] == 0
                 else f"exit {r['exit_code']}: {r.get('error', '')[:120]}")
        result = (f"`{r['test']}`: {t.get('passed', 0)} / {t.get('failed', 0) + t.get('errors', 0)}"
                  + ("" if t["runs"] else f" ({(t.get('problem') or t.get('first_failure') or 'not run')[:100]})"))
        floor = "runs" if r["floor"]["runs"] else "no"
        lines.append(f"| {r['github']} | {r['manager']} | {r['runner']} | {'yes' if r['typescript'] else 'no'}"
                     f"{' (monorepo)' if r['monorepo'] else ''} | {built} | {r.get('size_mb', '-')} MB | {result} "
                     f"| {floor} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clones", type=Path, required=True)
    parser.add_argument("--only", default="")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--keep-images", action="store_true", help="keep the environment images built")
    args = parser.parse_args()
    entries = json.loads(CORPUS.read_text())["repositories"]
    if args.only:
        entries = [e for e in entries if e["name"] in args.only.split(",")]
    help_s, _ = m3("--help")
    rows = []
    work = Path(tempfile.mkdtemp(prefix="m3-agent-envbench-js-"))
    try:
        for entry in entries:
            row = bench_one(entry, clone_of(args.clones, entry["github"]), work, args.keep_images)
            rows.append(row)
            t = row["tests"]
            print(f"{row['name']}: build exit {row['exit_code']} cold {row['cold_s']} s warm {row.get('warm_s')} s; "
                  f"{t.get('runner')} {t.get('passed', 0)} passed {t.get('failed', 0)} failed, runs={t['runs']}; "
                  f"{row.get('error') or t.get('problem') or ''}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.markdown:
        args.markdown.write_text(markdown(rows))
    print(json.dumps({"rows": rows, "summary": summary(rows, help_s)}))


if __name__ == "__main__":
    main()
