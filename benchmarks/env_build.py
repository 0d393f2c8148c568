"""What a repository's environment image adds to `m3-agent fix`: the cold build and the warm reuse, next to
a dependency-free repository in the same run.

    .venv/bin/python benchmarks/env_build.py [--runs 5] [--lookups 30]
    .venv/bin/python benchmarks/env_build.py --tree ../django --tree ../mypy [--runs 5]   # real trees
    .venv/bin/python benchmarks/env_build.py --tree ../django --before ../old/.venv/bin/python   # and the code before

Two git repositories are made in a temporary directory, each with one failing test:
  project          pyproject.toml ([build-system] setuptools; [project] depending on attrs and iniconfig, a
                   `test` extra with six), the package under src/, tests/test_x.py importing all three. Its
                   project name has a random suffix, so its environment key is new and the first build is cold.
  dependency-free  the same module and test, no dependency file: the plain sandbox image, nothing built. The
                   package sits at the top level, since nothing installs it.
Each is fixed by `fix_issue` (what `m3-agent fix` runs) against the M3 stand-in server, a scripted TEST
DOUBLE that speaks vLLM's wire format, not a model: test_runner (fails), file_edit, test_runner (passes),
submit. Every tool call runs in the real Docker sandbox; each fix must end `resolved`, with an environment
image for the project and none for the dependency-free repository.

Order: one untimed dependency-free fix (first imports), the cold project fix (it builds the environment),
then N warm project fixes interleaved with N dependency-free fixes, then `environment_for` alone on the
warm cache. The environment images the run built are removed at the end. "Cold" means a new image: wheels
the host's pip has cached are not downloaded again.

Figures (medians of N; seconds unless _ms):
  cold_s           the cold project fix - baseline_fix_s: what the first fix pays for its environment
  build_s          the cold fix's setup (fix_issue called -> agent loop starts) - the baseline's setup
  warm_fix_s       a warm project fix, end to end;  baseline_fix_s: a dependency-free fix, end to end
  warm_overhead_s  warm_fix_s - baseline_fix_s (the target: <= 0.5 s)
  warm_setup_overhead_s  the same difference on the setup alone (no agent loop noise); and on the loop's
                   parts (`RunResult.timings`): warm_sandbox_start_overhead_s, warm_tools_overhead_s
  warm_lookup_ms   `environment_for` on the warm cache: the image found by its key

The last line of output is one JSON object with these, runs, target_s and target_met.

With `--tree PATH` (repeatable; git repositories of real size: Django, mypy, textual, fastapi) only the
warm `m3-agent env build` is measured, as a user runs it: the command, a new process each time, on
PATH's HEAD, next to `m3-agent --help` in the same rounds (the floor: the command's own start-up). Its
environment is built first when it has none (that build is reported, not timed against the target), and
left in place. Per tree: files (tracked), warm_build_s and help_s (medians of N), overhead_s (the
target: <= 0.5 s) and target_met; the JSON line holds them under "trees", with the machine's load average
at the start and the end of the run (`os.getloadavg`: the figures move with it).
`--before PYTHON` (another install's interpreter, e.g. a venv of the code before a change) adds its warm
`env build` to the same rounds: before_build_s and before_overhead_s per tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from m3_agent.agent.events import AgentEvent
from m3_agent.fix.flow import fix_issue
from m3_agent.fix.result import FixResult
from m3_agent.sandbox import DEFAULT_IMAGE, SandboxConfig, build_image
from m3_agent.sandbox.env.build import environment_for
from m3_agent.sandbox.env.catalogue import prune_environments
from m3_agent.standin.server import StandinServer
from m3_agent.settings import load_settings

TARGET_S = 0.5
PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1"
dependencies = ["attrs>=23", "iniconfig>=2"]

[project.optional-dependencies]
test = ["six"]
"""
MODULE = """\
from dataclasses import dataclass


@dataclass
class Box:
    w: int
    h: int


def area(box: Box) -> int:
    return box.w + box.h
"""
TEST = "from envbench import Box, area\n\n\ndef test_area():\n    assert area(Box(2, 3)) == 6\n"
ISSUE = "# area() adds the sides\n\narea(Box(2, 3)) should be 6, it is 5.\n"


@dataclass
class Repo:
    """A repository to fix: where it is, the module the fix edits, whether it should get an environment."""

    path: Path
    module: str
    has_env: bool


@dataclass
class Fix:
    """One timed fix: wall time of `fix_issue`, its setup (until the agent loop starts), and the loop's parts."""

    wall_s: float
    setup_s: float
    sandbox_start_s: float
    tools_s: float


def make_git_repo(path: Path, files: dict[str, str]) -> Path:
    """A git repository at `path` with `files` committed."""
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.com",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.com"}
    subprocess.run(["git", "init", "-q", "-b", "main", str(path)], check=True, env=env)
    subprocess.run(["git", "-C", str(path), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(path), "commit", "-qm", "initial"], check=True, env=env)
    return path


def make_repos(tmp: Path, name: str) -> tuple[Repo, Repo]:
    """The project (named `name`: its directory is the environment's source label) and the dependency-free repo."""
    project = make_git_repo(tmp / name, {
        "pyproject.toml": PYPROJECT.format(name=name),
        "src/envbench/__init__.py": MODULE,
        "tests/test_x.py": "import attrs, iniconfig, six  # only the environment has these\n" + TEST,
    })
    plain = make_git_repo(tmp / "plain", {"envbench/__init__.py": MODULE, "tests/test_x.py": TEST})
    return Repo(project, "src/envbench/__init__.py", True), Repo(plain, "envbench/__init__.py", False)


def script(module: str) -> dict:
    """The stand-in's turns: run the tests, fix `module`, run them again, submit."""
    test = {"tool_calls": [{"name": "test_runner", "arguments": {"test_file": "tests"}}]}
    edit = {"tool_calls": [{"name": "file_edit", "arguments": {
        "path": module, "old_str": "return box.w + box.h", "new_str": "return box.w * box.h"}}]}
    submit = {"content": "The test passes.",
              "tool_calls": [{"name": "submit", "arguments": {"summary": "area() multiplies the sides."}}]}
    return {"turns": [test, edit, test, submit]}


def run_fix(repo: Repo, issue: Path) -> tuple[Fix, FixResult]:
    """One `fix_issue` on `repo` against a fresh stand-in, timed; raises when it did not resolve as expected."""
    started: list[float] = []

    def on_event(event: AgentEvent) -> None:
        if event.kind == "fix_start":  # sent once the sandbox config (and its environment) is ready
            started.append(time.perf_counter())

    with StandinServer(script(repo.module)) as srv:
        settings, _ = load_settings(repo.path, {"--base-url": srv.base_url})
        t0 = time.perf_counter()
        result = fix_issue(str(issue), repo=repo.path, settings=settings, callbacks=[on_event])
        wall = time.perf_counter() - t0
    if result.status != "resolved" or (result.environment is not None) != repo.has_env:
        raise RuntimeError(f"fix on {repo.path.name}: {result.status}, environment {result.environment}, "
                           f"error {result.run.error}, notices {result.notices}")
    timings = result.run.timings
    return Fix(wall, started[0] - t0, timings.sandbox_start_s, timings.tools_s), result


def lookup_ms(repo: Repo, tag: str, n: int) -> float:
    """Median ms of `environment_for` on the warm cache (the call `fix` makes before its loop, keyed as fix
    keys it: by the commit the copy came from, whose history gives the releases' date)."""
    head = subprocess.run(["git", "-C", str(repo.path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        _, env = environment_for(repo.path, SandboxConfig(), history=(repo.path, head), source=repo.path.name)
        times.append(time.perf_counter() - t)
        if env is None or env.built or env.tag != tag:
            raise RuntimeError(f"the warm lookup did not find {tag}: {env}")
    return statistics.median(times) * 1000


def median(fixes: list[Fix], field: str) -> float:
    return statistics.median(getattr(f, field) for f in fixes)


def measure(project: Repo, plain: Repo, issue: Path, runs: int, lookups: int) -> dict:
    """The figures of the module's docstring, in the order it gives."""
    run_fix(plain, issue)  # warm-up: first imports and first sandbox, paid by neither arm
    cold, result = run_fix(project, issue)
    print(f"cold project fix: {cold.wall_s:.2f} s (setup {cold.setup_s:.2f} s), built {result.environment}",
          file=sys.stderr)
    warm: list[Fix] = []
    base: list[Fix] = []
    for i in range(runs):
        warm.append(run_fix(project, issue)[0])
        base.append(run_fix(plain, issue)[0])
        print(f"round {i + 1}/{runs}: warm {warm[-1].wall_s:.2f} s, dependency-free {base[-1].wall_s:.2f} s",
              file=sys.stderr)
    baseline_s, warm_s = median(base, "wall_s"), median(warm, "wall_s")
    overhead = warm_s - baseline_s
    return {
        "cold_s": round(cold.wall_s - baseline_s, 3),
        "build_s": round(cold.setup_s - median(base, "setup_s"), 3),
        "cold_fix_s": round(cold.wall_s, 3),
        "warm_fix_s": round(warm_s, 3),
        "baseline_fix_s": round(baseline_s, 3),
        "warm_overhead_s": round(overhead, 3),
        "warm_setup_overhead_s": round(median(warm, "setup_s") - median(base, "setup_s"), 3),
        "warm_sandbox_start_overhead_s": round(median(warm, "sandbox_start_s") - median(base, "sandbox_start_s"), 3),
        "warm_tools_overhead_s": round(median(warm, "tools_s") - median(base, "tools_s"), 3),
        "warm_lookup_ms": round(lookup_ms(project, result.environment, lookups), 2),
        "runs": runs,
        "target_s": TARGET_S,
        "target_met": overhead <= TARGET_S,
    }


def timed(argv: list[str]) -> float:
    """Wall seconds of one command, which must succeed."""
    t = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - t


def measure_tree(tree: Path, runs: int, before: Path | None = None) -> dict:
    """The warm `m3-agent env build` on `tree`, next to `m3-agent --help` (and the `before` install's warm
    `env build`), alternated, medians of `runs`."""
    cli = [sys.executable, "-m", "m3_agent.cli"]
    arms = {"build": [*cli, "env", "build", "--repo", str(tree)], "help": [*cli, "--help"]}
    if before is not None:
        arms["before"] = [str(before), "-m", "m3_agent.cli", "env", "build", "--repo", str(tree)]
    files = len(subprocess.run(["git", "-C", str(tree), "ls-files"], check=True, capture_output=True,
                               text=True).stdout.splitlines())
    first = timed(arms["build"])  # builds when there is no environment yet
    if before is not None:
        timed(arms["before"])  # and when the other install keys it otherwise: outside the rounds too
    print(f"{tree.name}: {files} files; first env build {first:.1f} s", file=sys.stderr)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for i in range(runs):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))  # no arm always runs first
        for arm in order:
            times[arm].append(timed(arms[arm]))
    med = {arm: statistics.median(t) for arm, t in times.items()}
    warm, floor = med["build"], med["help"]
    print(f"{tree.name}: warm env build {warm:.2f} s, --help {floor:.2f} s, overhead {warm - floor:+.2f} s"
          + (f"; before: {med['before']:.2f} s ({med['before'] - floor:+.2f} s)" if before else ""), file=sys.stderr)
    out = {"tree": tree.name, "files": files, "first_build_s": round(first, 2), "warm_build_s": round(warm, 3),
           "help_s": round(floor, 3), "overhead_s": round(warm - floor, 3), "target_met": warm - floor <= TARGET_S}
    if before is not None:
        out.update(before_build_s=round(med["before"], 3), before_overhead_s=round(med["before"] - floor, 3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="warm project fixes, and as many dependency-free ones")
    ap.add_argument("--lookups", type=int, default=30, help="environment_for calls on the warm cache")
    ap.add_argument("--tree", type=Path, action="append", default=[],
                    help="measure the warm `env build` on this repository instead (repeatable)")
    ap.add_argument("--before", type=Path, help="with --tree: another install's python, measured in the same rounds")
    a = ap.parse_args()
    build_image(DEFAULT_IMAGE)
    if a.tree:
        load = os.getloadavg()[0]
        trees = [measure_tree(t.resolve(), a.runs, a.before) for t in a.tree]
        print(json.dumps({"trees": trees, "runs": a.runs, "target_s": TARGET_S, "load_start": round(load, 2),
                          "load_end": round(os.getloadavg()[0], 2), "target_met": all(t["target_met"] for t in trees)}))
        return
    name = f"envbench-{uuid.uuid4().hex[:8]}"  # a new project name: a new environment key, a cold build
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="m3-env-bench-") as tmp:
        project, plain = make_repos(Path(tmp), name)
        issue = Path(tmp) / "issue.md"
        issue.write_text(ISSUE)
        try:
            out = measure(project, plain, issue, a.runs, a.lookups)
        finally:
            removed = prune_environments(keep=0, source=name)
            print(f"removed {', '.join(removed) or 'no environment image'}", file=sys.stderr)
    print(f"cold: the first fix pays {out['cold_s']:.2f} s more than a dependency-free one "
          f"(environment build {out['build_s']:.2f} s)")
    print(f"warm: {out['warm_fix_s']:.2f} s vs {out['baseline_fix_s']:.2f} s dependency-free, "
          f"overhead {out['warm_overhead_s']:+.3f} s, median of {a.runs} "
          f"(target <= {TARGET_S} s: {'met' if out['target_met'] else 'NOT met'})")
    print(f"where the warm overhead goes: setup {out['warm_setup_overhead_s']:+.3f} s, sandbox start "
          f"{out['warm_sandbox_start_overhead_s']:+.3f} s, tool calls {out['warm_tools_overhead_s']:+.3f} s")
    print(f"warm lookup (environment_for): {out['warm_lookup_ms']:.1f} ms, median of {a.lookups}")
    print(f"benchmark wall time: {time.perf_counter() - t0:.1f} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
