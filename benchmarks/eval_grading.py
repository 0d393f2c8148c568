"""Benchmark: grade the built-in suite's gold predictions with 1 and 2 workers, beside the SWE-bench harness.

    .venv/bin/python benchmarks/eval_grading.py [--skip-peer]

Ours: `evals.runner.run_eval` (a process per instance, a hardened sandbox with an exec server inside,
JUnit XML). Peer: the official harness, PyPI `swebench` (installed by this script into its own venv
under the cache dir, never into the project), driving the same image and the same checkouts with its
own per-instance steps: `containers.create(... "tail -f /dev/null")` + start, `copy_to_container` of
the patch, its `git apply` chain, an eval script between its output markers run by
`exec_run_with_timeout`, its pytest log parser and report functions, then `cleanup_container`.
Its images hold the repository already; here both sides copy the same checkout in.

Then the offline SWE-bench tasks (real sympy and sphinx fixes, tests/evals/data/swebench) in their
offline-built instance images: gold and empty graded by our runner through the harness's parsers,
and by the official harness's own `run_evaluation` on the same images as the peer.

The last line of output is one JSON object: instances, s_per_instance_1w, s_per_instance_2w,
overhead_s (per instance: sandbox, checkout, apply, teardown; the tests themselves excluded), the
peer's figures under `peer`, and the SWE-bench tasks' under `swebench` (resolved and wall time for
gold and empty, ours and the peer's).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from m3_agent.evals.predictions import load_predictions  # noqa: E402
from m3_agent.evals.config import EvalConfig  # noqa: E402
from m3_agent.evals.runner import RunOptions, run_eval  # noqa: E402
from m3_agent.agent.context.cache import cache_dir  # noqa: E402
from m3_agent.evals.tasks import checkout, load_tasks  # noqa: E402
from m3_agent.sandbox import DEFAULT_IMAGE, build_image  # noqa: E402

PEER_SPEC = "swebench==5.0.2"

PEER_DRIVER = r'''
import json, sys, tarfile, io, time, statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
import docker
from swebench.harness.docker_utils import copy_to_container, exec_run_with_timeout, cleanup_container
from swebench.harness.grading import get_eval_tests_report, get_resolution_status
from swebench.harness.log_parsers.python import parse_log_pytest
from swebench.harness.constants import START_TEST_OUTPUT, END_TEST_OUTPUT

APPLY = ["git apply --verbose", "git apply --verbose --3way", "git apply --verbose --reject",
         "patch --batch --forward --fuzz=5 -p1 -i"]
args = json.loads(Path(sys.argv[1]).read_text())
client = docker.from_env(timeout=120)

def eval_script(t):
    files = sorted({x.split("::")[0] for x in t["FAIL_TO_PASS"] + t["PASS_TO_PASS"]})
    touched = sorted({l.split(" b/")[-1] for l in t["test_patch"].splitlines() if l.startswith("diff --git")})
    return "\n".join([
        "#!/bin/bash", "set -uxo pipefail", "cd /testbed", "git config --global --add safe.directory /testbed",
        "git checkout HEAD " + " ".join(touched),
        "git apply -v - <<'EOF_TEST_PATCH'", t["test_patch"].rstrip("\n"), "EOF_TEST_PATCH",
        f": '{START_TEST_OUTPUT}'", "python3 -m pytest -rA -p no:cacheprovider " + " ".join(files), "rc=$?",
        f": '{END_TEST_OUTPUT}'", 'echo ">>>>> Test Exit Code: $rc"', "git checkout HEAD " + " ".join(touched), ""])

def one(t, tree, workdir):
    start = time.monotonic()
    container = client.containers.create(args["image"], user="root", detach=True, command="tail -f /dev/null",
                                         network_mode="none", labels={"m3-agent.bench-peer": "1"})
    try:
        container.start()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(tree, arcname="testbed")
        container.put_archive("/", buf.getvalue())
        patch = Path(workdir) / f"{t['instance_id']}.diff"
        patch.write_text(t["patch"])
        copy_to_container(container, patch, PurePosixPath("/tmp/patch.diff"))
        applied = False
        for i, cmd in enumerate(APPLY):
            if i:
                container.exec_run(["/bin/bash", "-c", "git checkout -- . ; git clean -fd"], workdir="/testbed")
            if container.exec_run(f"{cmd} /tmp/patch.diff", workdir="/testbed").exit_code == 0:
                applied = True
                break
        container.exec_run("git -c core.fileMode=false diff", workdir="/testbed")
        script = Path(workdir) / f"{t['instance_id']}.sh"
        script.write_text(eval_script(t))
        copy_to_container(container, script, PurePosixPath("/eval.sh"))
        tests_start = time.monotonic()
        output, timed_out, _ = exec_run_with_timeout(container, "/bin/bash /eval.sh", 600)
        tests_s = time.monotonic() - tests_start
        sliced = output.split(START_TEST_OUTPUT)[-1].split(END_TEST_OUTPUT)[0] if START_TEST_OUTPUT in output else ""
        report = get_eval_tests_report(parse_log_pytest(sliced, None), {"FAIL_TO_PASS": t["FAIL_TO_PASS"],
                                                                      "PASS_TO_PASS": t["PASS_TO_PASS"]})
        resolved = applied and not timed_out and get_resolution_status(report) == "RESOLVED_FULL"
    finally:
        before_cleanup = time.monotonic()
        cleanup_container(client, container, None)
        cleanup_s = time.monotonic() - before_cleanup
    return {"id": t["instance_id"], "resolved": resolved, "wall_s": time.monotonic() - start, "tests_s": tests_s,
            "cleanup_s": cleanup_s}

out = {}
for workers in (1, 2):
    start = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(lambda p: one(*p, args["workdir"]), zip(args["tasks"], args["trees"])))
    wall = time.monotonic() - start
    out[f"{workers}w"] = {"wall_s": wall, "resolved": sum(r["resolved"] for r in rows),
                         "unresolved_ids": [r["id"] for r in rows if not r["resolved"]],
                         "overhead_s": statistics.mean(r["wall_s"] - r["tests_s"] for r in rows),
                         "cleanup_s": statistics.mean(r["cleanup_s"] for r in rows)}
print(json.dumps(out))
'''


def peer_python() -> Path:
    """The peer's interpreter: a venv under the cache dir with the SWE-bench harness (created once)."""
    venv = cache_dir() / "bench" / "swebench-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if subprocess.run([str(python), "-c", "import swebench.harness.grading"], capture_output=True).returncode != 0:
        print(f"installing the peer ({PEER_SPEC}) into {venv} ...", file=sys.stderr)
        subprocess.run([str(python), "-m", "pip", "install", "-q", PEER_SPEC], check=True)
    return python


def ours(tasks, preds, workers: int, work: Path) -> dict:
    config = EvalConfig(output_dir=work / f"ours-{workers}w", test_timeout=600)
    start = time.monotonic()
    results = run_eval(tasks, preds, config, RunOptions(workers=workers))
    wall = time.monotonic() - start
    return {
        "wall_s": wall,
        "resolved": sum(r.report.resolved for r in results),
        "overhead_s": statistics.mean(r.wall_s - r.report.timings.get("tests_s", 0.0) for r in results),
        "tests_s": statistics.mean(r.report.timings.get("tests_s", 0.0) for r in results),
    }


SWEBENCH_TASKS = ROOT / "tests" / "evals" / "data" / "swebench" / "tasks.jsonl"


def swebench_ours(tasks, work: Path) -> dict:
    """gold and empty predictions of the offline SWE-bench tasks, graded through the harness by our runner."""
    from m3_agent.evals.harness import OFFLINE_NAMESPACE

    out = {}
    for kind in ("gold", "empty"):
        config = EvalConfig(output_dir=work / f"sb-ours-{kind}", image_namespace=OFFLINE_NAMESPACE)
        start = time.monotonic()
        results = run_eval(tasks, load_predictions(kind, tasks), config, RunOptions(workers=2))
        out[kind] = {"resolved": sum(r.report.resolved for r in results), "wall_s": round(time.monotonic() - start, 3),
                     "errors": [r.instance_id for r in results if r.outcome == "error"]}
    return out


def swebench_peer(tasks, work: Path) -> dict:
    """The official harness (`python -m swebench.harness.run_evaluation`) on the same images and tasks."""
    from m3_agent.evals import harness

    dataset = work / "sb-dataset.jsonl"
    rows = []
    for t in tasks:  # the dataset in the harness's v5 schema: the image and eval script per instance
        row = t.model_dump(exclude_none=True)
        row.pop("testbed", None)
        row.update(image=harness.instance_image_name(t.instance_id, namespace=harness.OFFLINE_NAMESPACE),
                   eval_script=harness.compose_eval_script(t), eval_type="pass_and_fail")
        rows.append(json.dumps(row))
    dataset.write_text("\n".join(rows) + "\n")
    empty = work / "sb-empty.jsonl"
    empty.write_text("".join(json.dumps({"instance_id": t.instance_id, "model_name_or_path": "empty",
                                         "model_patch": ""}) + "\n" for t in tasks))
    out = {}
    for kind, preds in (("gold", "gold"), ("empty", str(empty))):
        start = time.monotonic()
        proc = subprocess.run([str(peer_python()), "-m", "swebench.harness.run_evaluation", "-d", str(dataset),
                               "-p", preds, "--max_workers", "2", "-id", f"m3-bench-{kind}"],
                              cwd=work, capture_output=True, text=True)
        wall = time.monotonic() - start
        reports = sorted(work.glob(f"*.m3-bench-{kind}.json"))
        if proc.returncode != 0 or not reports:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit("the official harness run failed")
        report = json.loads(reports[0].read_text())
        out[kind] = {"resolved": report["resolved_instances"], "wall_s": round(wall, 3),
                     "errors": report["error_ids"]}
    return out


def swebench_section(work: Path, skip_peer: bool) -> dict:
    """The offline SWE-bench tasks (sympy, sphinx): ours and the official harness in the same run."""
    from m3_agent.evals.harness import offline_image

    tasks = load_tasks(SWEBENCH_TASKS)
    for t in tasks:
        offline_image(t)
    section = {"instances": len(tasks), "ours": swebench_ours(tasks, work)}
    print(f"m3-agent on SWE-bench tasks: {section['ours']}", file=sys.stderr)
    if not skip_peer:
        section["peer"] = {"name": f"SWE-bench harness ({PEER_SPEC}) run_evaluation", **swebench_peer(tasks, work)}
        print(f"peer on SWE-bench tasks: {section['peer']}", file=sys.stderr)
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-peer", action="store_true", help="measure m3-agent only")
    parser.add_argument("--skip-swebench", action="store_true", help="leave out the offline SWE-bench tasks")
    args = parser.parse_args()
    image = build_image(DEFAULT_IMAGE)
    tasks = load_tasks("builtin")
    preds = load_predictions("gold", tasks)
    n = len(tasks)
    with tempfile.TemporaryDirectory(prefix="m3-bench-") as tmp:
        work = Path(tmp)
        one, two = ours(tasks, preds, 1, work), ours(tasks, preds, 2, work)
        print(f"m3-agent: 1 worker {one['wall_s']:.1f}s, 2 workers {two['wall_s']:.1f}s for {n} instances; "
              f"resolved {one['resolved']}/{n} and {two['resolved']}/{n}; overhead {one['overhead_s']:.2f}s/instance, "
              f"tests {one['tests_s']:.2f}s/instance", file=sys.stderr)
        peer = None
        if not args.skip_peer:
            trees = [str(checkout(t, work / "trees" / t.instance_id)) for t in tasks]
            spec = work / "peer.json"
            spec.write_text(json.dumps({"image": image, "tasks": [t.model_dump() for t in tasks], "trees": trees,
                                        "workdir": str(work)}))
            driver = work / "peer_driver.py"
            driver.write_text(PEER_DRIVER)
            proc = subprocess.run([str(peer_python()), str(driver), str(spec)], capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit("the peer run failed")
            raw = json.loads(proc.stdout.strip().splitlines()[-1])
            peer = {
                "name": f"SWE-bench harness ({PEER_SPEC})",
                "resolved_1w": raw["1w"]["resolved"], "resolved_2w": raw["2w"]["resolved"],
                "unresolved_ids": raw["1w"]["unresolved_ids"],
                "s_per_instance_1w": round(raw["1w"]["wall_s"] / n, 3),
                "s_per_instance_2w": round(raw["2w"]["wall_s"] / n, 3),
                "overhead_s": round(raw["1w"]["overhead_s"], 3),
                "cleanup_s": round(raw["1w"]["cleanup_s"], 3),
            }
            print(f"peer: {peer}", file=sys.stderr)
        swebench = None if args.skip_swebench else swebench_section(work, args.skip_peer)
    print(json.dumps({
        "instances": n,
        "resolved_1w": one["resolved"], "resolved_2w": two["resolved"],
        "s_per_instance_1w": round(one["wall_s"] / n, 3),
        "s_per_instance_2w": round(two["wall_s"] / n, 3),
        "overhead_s": round(one["overhead_s"], 3),
        "tests_s": round(one["tests_s"], 3),
        "peer": peer,
        "swebench": swebench,
    }))


if __name__ == "__main__":
    main()
