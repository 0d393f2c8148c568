"""What keeping the last known workspace costs: a tool call alone, and the same call plus the diff the loop
takes after it (`agent.recovery`), in the Docker sandbox and the local environment.

    .venv/bin/python benchmarks/recovery_overhead.py [--files 250 2000] [--runs 30]

For each repository size (a generated git repository of N small Python files, 4 KB each) and each
environment, in interleaved rounds: `bash true` (the cheapest command call, the floor), `file_write`
of one file, and `diff()` on a workspace with two changed files. The loop pays `diff_ms` after every
call that ran a command or wrote a file, never after a read or a call that did not reach the
environment. The last line of output is one JSON object: per size and environment, the medians in
ms and `overhead_x` = (call + diff) / call for the floor command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from m3_agent.sandbox import DEFAULT_IMAGE, LocalEnvironment, Sandbox, SandboxConfig, build_image
from m3_agent.tools import default_tools, execute_call


def make_repo(root: Path, files: int) -> Path:
    """A committed git repository of `files` Python files in folders of 50."""
    for i in range(files):
        f = root / f"pkg{i // 50}" / f"mod{i}.py"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"# module {i}\n" + "def f(x):\n    return x + 1\n" * 140)
    env = ["-c", "user.name=b", "-c", "user.email=b@example.com"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    subprocess.run(["git", *env, "-C", str(root), "commit", "-qm", "base"], check=True)
    return root


def measure(env, runs: int) -> dict[str, float]:
    """Medians (ms) of the floor command call, a file_write call and a diff, in interleaved rounds."""
    tools = default_tools()
    execute_call("file_edit", json.dumps({"path": "pkg0/mod0.py", "old_str": "# module 0", "new_str": "# m0"}),
                 tools, env)
    calls = {
        "bash_true_ms": lambda: execute_call("bash", json.dumps({"command": "true"}), tools, env),
        "file_write_ms": lambda: execute_call("file_write", json.dumps({"path": "new.py", "content": "x = 1\n"}),
                                              tools, env),
        "diff_ms": env.diff,
    }
    samples: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(runs):
        for name, fn in calls.items():
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    out = {k: round(statistics.median(v) * 1000, 2) for k, v in samples.items()}
    out["overhead_x"] = round((out["bash_true_ms"] + out["diff_ms"]) / out["bash_true_ms"], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, nargs="+", default=[250, 2000], help="repository sizes in files")
    ap.add_argument("--runs", type=int, default=30, help="rounds per measurement")
    a = ap.parse_args()
    build_image(DEFAULT_IMAGE)
    results = {}
    for files in a.files:
        with tempfile.TemporaryDirectory(prefix="m3-recovery-bench-") as tmp:
            repo = make_repo(Path(tmp) / "repo", files)
            for kind, make in (("docker", lambda: Sandbox(SandboxConfig(), repo=repo)),
                               ("local", lambda: LocalEnvironment(repo))):
                with make() as env:
                    results[f"{files}_files_{kind}"] = row = measure(env, a.runs)
                print(f"{files} files, {kind}: {row}", file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
