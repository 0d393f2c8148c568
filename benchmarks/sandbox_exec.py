"""Per-command cost of the sandbox, side by side with mini-swe-agent and a raw docker-SDK exec.

    python benchmarks/sandbox_exec.py [--runs 30]

In one run, against the same image on the same engine:
  ours            `Sandbox.exec` (a long-lived server inside the container)
  mini-swe-agent  `DockerEnvironment.execute` (one `docker exec` process per command), installed from
                  PyPI into its own venv under the cache dir, driven from that venv
  docker SDK      `container.exec_run` (one exec API round trip per command)
on a trivial command and on a command printing 1 MB. The three are measured in interleaved rounds so
that load from other processes on the machine hits them alike. `ready_s` is the median time to
create + start a sandbox with a 40 MB git repository (working tree + .git) copied in, next to the
floor any container pays here (create + start of a bare `--network none` container, same run).

The last line of output is one JSON object: ours_ms, mini_swe_agent_ms, docker_exec_ms (medians of
the trivial command, ms), ratio_vs_mini, ready_s, and the 1 MB figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

import docker

from m3_agent.sandbox import DEFAULT_IMAGE, Sandbox, SandboxConfig, build_image

MINI_SPEC = "mini-swe-agent==2.4.6"
TRIVIAL = "echo hi"
ONE_MB = "head -c 1000000 /dev/zero | tr '\\0' a"
BENCH_LABEL = "m3-agent.bench"

# Runs inside mini-swe-agent's venv: one DockerEnvironment, commands timed on request. Answers are
# JSON lines marked "@@ " (mini-swe-agent prints its own banner and logs on stdout too).
MINI_WORKER = r"""
import json, subprocess, sys, time
from minisweagent.environments.docker import DockerEnvironment
t = time.perf_counter()
env = DockerEnvironment(image=sys.argv[1], cwd="/workspace", timeout=120,
                        run_args=["--rm", "--label", sys.argv[2] + "=1"])
print("@@", json.dumps({"start_s": time.perf_counter() - t}), flush=True)
try:
    for line in sys.stdin:
        req = json.loads(line)
        times, size = [], 0
        for _ in range(req["n"]):
            t = time.perf_counter()
            out = env.execute({"command": req["cmd"]})
            times.append(time.perf_counter() - t)
            assert out["returncode"] == 0, out
            size = len(out["output"])
        print("@@", json.dumps({"times": times, "size": size}), flush=True)
finally:
    subprocess.run(["docker", "rm", "-f", env.container_id], capture_output=True)
    env.container_id = None
"""


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "m3-agent" / "bench"


def mini_python() -> Path:
    """mini-swe-agent in its own venv (created once), so it never enters the project's dependencies."""
    env_dir = cache_dir() / "mini-venv"
    py = env_dir / "bin" / "python"
    probe = [str(py), "-c", "import minisweagent.environments.docker"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    print(f"setting up {MINI_SPEC} in {env_dir}", file=sys.stderr)
    venv.create(env_dir, with_pip=True, clear=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", MINI_SPEC], check=True)
    return py


def make_repo(size_mb: int = 40) -> Path:
    """A deterministic git repository of Python-like source, `size_mb` MB on disk with its .git, made once."""
    repo = cache_dir() / f"repo-{size_mb}mb"
    if (repo / ".git").is_dir():
        return repo
    rng = random.Random(7)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(2, 10)))
             for _ in range(5000)]
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.com",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.com"}
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    i = 0
    while dir_bytes(repo) < size_mb * 1_000_000:
        for _ in range(100):  # a batch of files, committed, then measured again (with .git)
            d = repo / f"pkg{i % 40}" / f"sub{i % 7}"
            d.mkdir(parents=True, exist_ok=True)
            lines = ["    " + " = ".join(rng.choice(words) for _ in range(4)) for _ in range(rng.randint(150, 1200))]
            (d / f"mod{i}.py").write_text("\n".join(lines) + "\n")
            i += 1
        subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
        subprocess.run(["git", "-C", str(repo), "commit", "-qm", f"batch {i}"], check=True, env=env)
    return repo


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def worker_answer(proc: subprocess.Popen) -> dict:
    """The next marked JSON line from the mini-swe-agent worker."""
    for line in proc.stdout:
        if line.startswith("@@ "):
            return json.loads(line[3:])
    raise RuntimeError("the mini-swe-agent worker exited early")


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30, help="runs per command per contender (>= 30)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds the runs are split into")
    ap.add_argument("--ready-runs", type=int, default=7)
    args = ap.parse_args()
    runs = max(30, args.runs)
    per_round = -(-runs // args.rounds)

    image = build_image(DEFAULT_IMAGE)
    repo = make_repo(40)
    repo_bytes = dir_bytes(repo)
    py = mini_python()

    client = docker.from_env()
    raw = client.containers.run(image, ["sleep", "3600"], detach=True, remove=True, network_mode="none",
                                labels={BENCH_LABEL: "1"})
    mini = subprocess.Popen([str(py), "-c", MINI_WORKER, image, BENCH_LABEL], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    results: dict[str, dict[str, list[float]]] = {k: {"trivial": [], "1mb": []} for k in ("ours", "mini", "sdk")}
    sizes: dict[str, dict[str, int]] = {k: {} for k in results}
    try:
        mini_start = worker_answer(mini)["start_s"]
        with Sandbox(SandboxConfig(image=image)) as sb:
            for _ in range(3):  # warm-up: first calls pay for page cache and imports
                sb.exec(TRIVIAL)
                raw.exec_run(["bash", "-c", TRIVIAL])
            for _ in range(args.rounds):
                for name, cmd in (("trivial", TRIVIAL), ("1mb", ONE_MB)):
                    mini.stdin.write(json.dumps({"cmd": cmd, "n": per_round}) + "\n")
                    mini.stdin.flush()
                    answer = worker_answer(mini)
                    results["mini"][name] += answer["times"]
                    sizes["mini"][name] = answer["size"]

                    def ours(cmd=cmd, name=name):
                        r = sb.exec(cmd)
                        assert r.exit_code == 0 and not r.truncated
                        sizes["ours"][name] = len(r.stdout)

                    def sdk(cmd=cmd, name=name):
                        r = raw.exec_run(["bash", "-c", cmd])
                        assert r.exit_code == 0
                        sizes["sdk"][name] = len(r.output)

                    results["ours"][name] += timed(ours, per_round)
                    results["sdk"][name] += timed(sdk, per_round)
    finally:
        mini.stdin.close()
        mini.wait(60)
        raw.remove(force=True)
        client.close()

    ready, floor = [], []
    client = docker.from_env()
    for _ in range(args.ready_runs):  # interleaved with the floor: create + start of a bare container, no copy
        t = time.perf_counter()
        sb = Sandbox(SandboxConfig(image=image), repo=repo).start()
        ready.append(time.perf_counter() - t)
        sb.close()
        t = time.perf_counter()
        bare = client.containers.create(image, ["sleep", "60"], network_mode="none", labels={BENCH_LABEL: "1"})
        bare.start()
        floor.append(time.perf_counter() - t)
        bare.remove(force=True)  # returns once it is gone: no removal in flight, no idle container, at the next start
    client.close()

    for name in ("trivial", "1mb"):
        assert sizes["ours"][name] == sizes["sdk"][name], sizes  # all three really moved the same output
        assert abs(sizes["mini"][name] - sizes["ours"][name]) <= 1, sizes
    print(f"{'':16}{'trivial (ms)':>14}{'1 MB (ms)':>12}   median of {len(results['ours']['trivial'])} runs")
    for key, label in (("ours", "ours"), ("mini", "mini-swe-agent"), ("sdk", "docker exec_run")):
        print(f"{label:16}{ms(results[key]['trivial']):>14}{ms(results[key]['1mb']):>12}")
    print(f"ready (create + start + {repo_bytes / 1e6:.0f} MB repo copied in): median {statistics.median(ready):.3f} s"
          f" of {len(ready)}; floor (create + start, --network none, nothing else): {statistics.median(floor):.3f} s;"
          f" mini-swe-agent start (no copy): {mini_start:.3f} s")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    ours_ms, mini_ms = ms(results["ours"]["trivial"]), ms(results["mini"]["trivial"])
    summary = {
        "ours_ms": ours_ms,
        "mini_swe_agent_ms": mini_ms,
        "docker_exec_ms": ms(results["sdk"]["trivial"]),
        "ratio_vs_mini": round(mini_ms / ours_ms, 1),
        "ready_s": round(statistics.median(ready), 3),
        "start_floor_s": round(statistics.median(floor), 3),
        "ours_1mb_ms": ms(results["ours"]["1mb"]),
        "mini_swe_agent_1mb_ms": ms(results["mini"]["1mb"]),
        "docker_exec_1mb_ms": ms(results["sdk"]["1mb"]),
        "ratio_vs_mini_1mb": round(ms(results["mini"]["1mb"]) / ms(results["ours"]["1mb"]), 1),
        "runs": len(results["ours"]["trivial"]),
        "repo_mb": round(repo_bytes / 1e6, 1),
        "mini_swe_agent": MINI_SPEC.split("==")[1],
        "load_avg_1m": round(load, 2) if load is not None else None,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
