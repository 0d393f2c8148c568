"""Environments for the repositories users bring: `m3-agent env build` and one test file, on a fixed corpus.

    .venv/bin/python benchmarks/envbench.py --clones DIR [--only pillow,tomli] [--which head,old]
                                            [--markdown table.md] [--keep-images] [--logs DIR]

The corpus is `benchmarks/envbench_corpus.json` (28 public repositories, each at its head and at its last
commit before 2024-12-05, one chosen test file per commit; fixed before the builder was tuned on it). The
clones are not in this repository: DIR holds one git repository per entry, at `DIR/<owner>+<name>/repo`,
`DIR/<owner>+<name>` or `DIR/<name>` (a bare repository or a work tree; full history, so both commits
are there).

For each repository and commit, in a fresh checkout of that commit (a git repository, as `fix` sees it):
  cold_s    `m3-agent env build` with no environment image for that key (one this benchmark finds is
            removed first, so the build is cold; wheels the host's pip has cached are not downloaded again)
  steps_s   where the cold build's time went: [step, seconds] per `> step` line of its progress (`--logs DIR`
            keeps the progress, each line with the second it came at)
  warm_s    `m3-agent env build` again: the image is found
  help_s    `m3-agent --help` in the same run, the floor warm_s is held against (warm_over_help_s)
  size_mb   the environment image's size
  tests     the chosen test file run in the sandbox (network none, as the agent's runs), with the
            corpus entry's command (pytest by default): passed / failed / errors, failures whose message
            says the network is unreachable counted apart (`network`); `runs` is >= 90% of the rest passing
  floor     the same test file on the plain sandbox image, as a repository without the builder gets it
A build that fails keeps its row with the exit code and the build's last line as the cause.

Prints one line per run, then one JSON object (the last line): per run the figures above, and the
summary: share of heads and of old commits whose tests run (goals 0.9 and 0.8), of the floor's, the
largest warm_over_help_s. `--markdown FILE` also writes the table for docs/environments.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import IO

import docker.errors

from m3_agent.errors import M3AgentError
from m3_agent.sandbox import DEFAULT_IMAGE, Sandbox, SandboxConfig
from m3_agent.sandbox.engine import docker_client

CORPUS = Path(__file__).with_name("envbench_corpus.json")
PASS_SHARE = 0.9
TEST_TIMEOUT_S = 1800.0
BUILD_TIMEOUT_S = 3600.0
PYTEST = "python -m pytest -rfE -p no:cacheprovider {test}"  # no -q: a project whose addopts say -q would lose the counts
NETWORK = re.compile(r"Network is unreachable|Temporary failure in name resolution|Name or service not known|"
                     r"NewConnectionError|ConnectionRefused|nodename nor servname", re.I)
M3 = [str(Path(sys.executable).with_name("m3-agent"))]  # the console script, as a user runs it


def find_clone(clones: Path, github: str, name: str) -> Path:
    """The clone of `github` (owner/name) under `clones`, in any of the layouts the docstring names."""
    flat = github.replace("/", "+")
    for path in (clones / flat / "repo", clones / flat, clones / name):
        if path.is_dir():
            return path
    raise SystemExit(f"no clone of {github} under {clones}: expected {flat}/repo, {flat} or {name}")


def checkout(clone: Path, commit: str, dest: Path) -> tuple[Path, list[str]]:
    """A fresh git repository at `dest` with `commit` checked out (history kept: builds may ask git), and the
    files the clone lacks the contents of (a mirror that left out its largest blobs). git checks out the rest
    and exits 0; their removal is committed on top (no dependency file: the key and the releases' date stay
    the commit's), so what exports the tree from git finds every blob; the row names them."""
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(clone), str(dest)], check=True)
    proc = subprocess.run(["git", "-C", str(dest), "checkout", "-q", "--detach", commit], capture_output=True,
                          text=True, check=True)
    missing = re.findall(r"^error: unable to read sha1 file of (.+) \([0-9a-f]+\)$", proc.stderr, re.M)
    if missing:
        git = ["git", "-C", str(dest), "-c", "user.name=envbench", "-c", "user.email=envbench@example.invalid"]
        subprocess.run([*git, "rm", "-q", "--cached", "--", *missing], check=True)
        subprocess.run([*git, "commit", "-q", "-m", "envbench: files the clone lacks"], check=True)
    return dest, missing


def m3(*args: str, timeout: float = BUILD_TIMEOUT_S,
       log: Path | None = None) -> tuple[float, subprocess.CompletedProcess]:
    """Run `m3-agent ARGS`; its wall time and result. `log`: also write its lines there, each with the seconds
    since the start it was printed at (where a cold build's time goes)."""
    t0 = time.perf_counter()
    lines: dict[str, list[tuple[float, str]]] = {"out": [], "err": []}
    proc = subprocess.Popen([*M3, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def drain(stream: IO[str], into: list[tuple[float, str]]) -> None:
        for line in stream:
            into.append((time.perf_counter() - t0, line))

    readers = [threading.Thread(target=drain, args=(proc.stdout, lines["out"]), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, lines["err"]), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = 124
        lines["err"].append((timeout, f"timed out after {timeout:.0f} s\n"))
    for reader in readers:
        reader.join()
    elapsed = time.perf_counter() - t0
    if log is not None:
        log.write_text("".join(f"{t:8.1f} s  {line}" for t, line in sorted(lines["out"] + lines["err"])))
    return elapsed, subprocess.CompletedProcess(args, code, "".join(x for _, x in lines["out"]),
                                                "".join(x for _, x in lines["err"]))


def steps(log: str) -> list[list]:
    """[step, seconds] for each `> step` line of a build's log (`m3`'s): the time until the next line of its kind
    or the end, the last step's included."""
    marks = [(float(m.group(1)), m.group(2)[:80]) for m in re.finditer(r"^\s*([\d.]+) s  > (.*)$", log, re.M)]
    end = [float(t) for t in re.findall(r"^\s*([\d.]+) s  ", log, re.M)][-1:] or [0.0]
    return [[name, round(nxt - t, 1)] for (t, name), nxt in zip(marks, [t for t, _ in marks[1:]] + end)]


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def build(repo: Path, keep: bool, log: Path) -> dict:
    """Cold build (after removing an image already there for its key; its progress timed into `log`, and the
    seconds of each step in the row), warm build, the image's size."""
    _, shown = m3("env", "show", "--json", "--repo", str(repo))
    info = json.loads(shown.stdout) if shown.returncode == 0 else {}
    if info.get("built") and not keep:
        with closing(docker_client()) as client:
            client.images.remove(info["tag"], force=True)
    cold, proc = m3("env", "build", "--repo", str(repo), log=log)
    out = {"cold_s": round(cold, 1), "build_exit": proc.returncode, "tag": last_line(proc.stdout) or None,
           "steps_s": steps(log.read_text())}
    if proc.returncode != 0:
        return {**out, "tag": None, "cause": last_line(proc.stderr)}
    warm, _ = m3("env", "build", "--repo", str(repo))
    out["warm_s"] = round(warm, 3)
    if out["tag"] and out["tag"].startswith("m3-agent-env:"):
        with closing(docker_client()) as client:
            out["size_mb"] = round(client.images.get(out["tag"]).attrs.get("Size", 0) / 1e6)
    else:
        out["tag"] = None  # nothing to build: the plain sandbox image
    return out


def command_for(entry: dict, test: str) -> str:
    """The shell command that runs the chosen test file: the entry's own, or pytest."""
    module = test.removesuffix(".py").replace("/", ".")
    return entry.get("command", PYTEST).format(test=test, module=module)


def count(runner: str, output: str, exit_code: int) -> dict:
    """passed / failed / errors / network from the runner's own summary (the exit code for a plain script)."""
    if runner == "script":
        return {"passed": int(exit_code == 0), "failed": int(exit_code != 0), "errors": 0, "network": 0}
    if runner == "unittest":
        ran = re.findall(r"^Ran (\d+) tests?", output, re.M)
        bad = {k: int(v) for k, v in re.findall(r"(failures|errors|skipped)=(\d+)", output.split("Ran ")[-1])}
        total = int(ran[-1]) if ran else 0
        failed, errors = bad.get("failures", 0), bad.get("errors", 0)
        network = len([b for b in re.split(r"^={50,}$", output, flags=re.M) if b.startswith(("\nFAIL", "\nERROR"))
                       and NETWORK.search(b)])
        return {"passed": total - failed - errors - bad.get("skipped", 0), "failed": failed, "errors": errors,
                "network": min(network, failed + errors)}
    # pytest's last summary line, wherever it is: a plugin's warning on stderr can follow it (pytest-asyncio 0.24's)
    summary = [ln for ln in output.splitlines() if re.search(r"\d+ (passed|failed|errors?)\b.* in [\d.]+s", ln)]
    got = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?)\b", summary[-1] if summary else
                                             _pretty_summary(output))}
    short = sum(1 for ln in output.splitlines() if ln.startswith(("FAILED ", "ERROR ")) and NETWORK.search(ln))
    # A short summary line may carry no reason (scikit-image's has none): the failure's own section tells.
    sections = re.split(r"^_{3,} .+ _{3,}$", output.split("short test summary info")[0], flags=re.M)[1:]
    failed, errors = got.get("failed", 0), got.get("error", 0) + got.get("errors", 0)
    network = max(short, sum(1 for section in sections if NETWORK.search(section)))
    return {"passed": got.get("passed", 0), "failed": failed, "errors": errors,
            "network": min(network, failed + errors)}


def _pretty_summary(output: str) -> str:
    """pytest-pretty's summary (scikit-image's test extra has it): the count lines after its last `Results (1.2s):`."""
    lines = output.splitlines()
    starts = [i for i, ln in enumerate(lines) if re.fullmatch(r"Results \([\d.]+s\):", ln.strip())]
    block = lines[starts[-1] + 1:starts[-1] + 8] if starts else []
    return "\n".join(ln for ln in block if re.fullmatch(r"\s*\d+ \w+", ln))


def run_tests(repo: Path, image: str, command: str, runner: str) -> dict:
    """The command in a sandbox from `image` on a copy of `repo`; its counts and whether it `runs`."""
    with Sandbox(SandboxConfig(image=image), repo=repo) as sb:
        r = sb.exec(command, timeout=TEST_TIMEOUT_S)
    counts = count(runner, r.stdout + "\n" + r.stderr, r.exit_code)
    counted = counts["passed"] + counts["failed"] + counts["errors"] - counts["network"]
    counts["runs"] = counted > 0 and counts["passed"] >= PASS_SHARE * counted
    if not counts["runs"]:
        counts["cause"] = first_error(r.stdout + "\n" + r.stderr) or f"exit {r.exit_code}"
    return counts


def first_error(output: str) -> str:
    """The first line that says what went wrong (an exception, pytest's `E` line, an ERROR)."""
    for line in output.splitlines():
        s = line.strip()
        if re.match(r"(E\s+)?\w*(Error|Exception)\b|^ERROR|^INTERNALERROR|^FAILED|unrecognized arguments", s):
            return s[:300]
    return ""


def bench_one(entry: dict, which: str, clone: Path, work: Path, keep: bool, logs: Path) -> dict:
    """Build and test one repository at one of its commits; the cold build's timed progress into `logs`."""
    at = entry[which]
    repo, missing = checkout(clone, at["commit"], work / f"{entry['name']}")
    row = {"name": entry["name"], "which": which, "commit": at["commit"][:12], "date": at["date"],
           "backend": entry["backend"], "compiles": entry["compiles"], "runner": entry["runner"],
           **({"missing_files": missing} if missing else {})}
    try:
        row.update(build(repo, keep, logs / f"{entry['name']}-{which}.log"))
        command = command_for(entry, at["test"])
        row["floor"] = run_tests(repo, DEFAULT_IMAGE, command, entry["runner"])
        if row["build_exit"] == 0:
            row["tests"] = run_tests(repo, row["tag"] or DEFAULT_IMAGE, command, entry["runner"])
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    return row


def summary(rows: list[dict], help_s: float) -> dict:
    """The shares that meet the goals, and the slowest warm build over `m3-agent --help`."""
    def share(which: str, key: str) -> float | None:
        picked = [r for r in rows if r["which"] == which]
        return round(sum(bool(r.get(key, {}).get("runs")) for r in picked) / len(picked), 3) if picked else None

    warm = [r["warm_s"] - help_s for r in rows if "warm_s" in r]
    return {"heads_run": share("head", "tests"), "old_run": share("old", "tests"),
            "floor_heads_run": share("head", "floor"), "floor_old_run": share("old", "floor"),
            "goal_heads": 0.9, "goal_old": 0.8, "help_s": round(help_s, 3),
            "max_warm_over_help_s": round(max(warm), 3) if warm else None}


def markdown(rows: list[dict]) -> str:
    """The table for docs/environments.md: one row per repository and commit, failures with their cause."""
    out = ["| repository | commit | backend | cold | warm | image | test file | floor | cause |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        t, f = r.get("tests") or {}, r.get("floor") or {}
        tests = f"{t['passed']}/{t['passed'] + t['failed'] + t['errors']}" + ("" if t.get("runs") else " (no)") if t else "-"
        floor = f"{f['passed']}/{f['passed'] + f['failed'] + f['errors']}" if f else "-"
        size = f"{r['size_mb']} MB" if r.get("size_mb") else "-"
        warm = f"{r['warm_s']:.2f} s" if "warm_s" in r else "-"
        cause = r.get("cause") or t.get("cause") or ""
        if r.get("missing_files"):
            cause = f"{cause} (not in the clone: {', '.join(r['missing_files'])})".strip()
        out.append(f"| {r['name']} | {r['which']} {r['date']} | {r['backend']}{' (C)' if r['compiles'] else ''} "
                   f"| {r['cold_s']} s | {warm} | {size} | {tests} | {floor} | {cause.replace('|', '/')[:160]} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clones", type=Path, required=True, help="where the corpus's git repositories are")
    p.add_argument("--only", default="", help="comma-separated names from the corpus (default: all)")
    p.add_argument("--which", default="head,old", help="head, old or both (default)")
    p.add_argument("--markdown", type=Path, help="also write the table here")
    p.add_argument("--keep-images", action="store_true", help="do not remove an image found before the cold build")
    p.add_argument("--corpus", type=Path, default=CORPUS, help="another corpus file of the same form")
    p.add_argument("--logs", type=Path, help="keep each cold build's progress here, timed (NAME-head.log)")
    a = p.parse_args()
    entries = json.loads(a.corpus.read_text())["repositories"]
    only = {n for n in a.only.split(",") if n}
    if only - {e["name"] for e in entries}:
        raise SystemExit(f"not in the corpus: {', '.join(sorted(only - {e['name'] for e in entries}))}")
    if a.logs:
        a.logs.mkdir(parents=True, exist_ok=True)
    help_s, _ = m3("--help")
    rows = []
    with tempfile.TemporaryDirectory(prefix="m3-agent-envbench-") as tmp:
        for entry in (e for e in entries if not only or e["name"] in only):
            clone = find_clone(a.clones, entry["github"], entry["name"])
            for which in a.which.split(","):
                try:
                    row = bench_one(entry, which, clone, Path(tmp), a.keep_images, a.logs or Path(tmp))
                except (subprocess.CalledProcessError, docker.errors.DockerException, M3AgentError) as e:
                    row = {"name": entry["name"], "which": which, "cause": f"benchmark error: {e}"[:300]}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    if a.markdown:
        a.markdown.write_text(markdown([r for r in rows if "cold_s" in r]))
    print(json.dumps({"runs": rows, "summary": summary(rows, help_s)}))


if __name__ == "__main__":
    main()
