"""Benchmark: `eval run` on the local process pool vs on Ray, same machine, same number of workers.

    .venv/bin/python benchmarks/eval_scale.py [--copies 4] [--workers 2] [--nodes 2]

The built-in suite is repeated `--copies` times (>= 40 instances: each copy has its own instance id
and its own scripted conversation in one M3 stand-in, a test double), then run by the agent and
graded in real Docker sandboxes twice: by the local executor with `--workers` processes, and by the
Ray executor on a cluster of `--nodes` node processes on this machine (`ray start --head` +
`ray start --address`) declaring `--workers` docker slots in all. Both drivers run in this process,
`--rounds` times each in the order local, ray, ray, local (so warm-up and load drift fall on both);
the cluster is started before the clock starts, as a real cluster is up before a run.

Ray's overhead per instance is the extra (mean) wall time the Ray runs took, spread over the instances one
worker slot ran: (T_ray - T_local) * workers / instances; its share is (T_ray - T_local) / T_local.
The target is at most 0.2 s or 10%. Beside it, `dispatch_s_per_instance` per executor: the time from an
instance's start to its result in the driver beyond the instance function's own wall time (process
start and imports for the local pool; shipping, scheduling and the way back for Ray).

Estimate for 500 instances on K nodes x E endpoints: an instance occupies a docker slot for its
measured wall time plus the overhead, plus `--model-s` seconds of model time (the stand-in answers
at once; real M3 on 1M-token contexts takes minutes), so
    wall(K, E) = ceil(500 / min(K * slots_per_node, E * sessions_per_endpoint)) * (t + overhead + model_s).

The last line of output is one JSON object: instances, workers, local_wall_s, ray_wall_s,
ray_overhead_s_per_instance, ray_overhead_share, target_met, s_per_instance (mean measured instance
wall), and `estimate_500` (seconds per "KxE").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from m3_agent.agent.config import AgentConfig  # noqa: E402
from m3_agent.evals.ray_executor import RayExecutor  # noqa: E402
from tests.evals.ray_cluster import LocalRayCluster  # noqa: E402
from m3_agent.evals.config import EvalConfig  # noqa: E402
from m3_agent.evals.runner import RunOptions, run_eval  # noqa: E402
from m3_agent.evals.tasks import SUITE_DIR, Task, builtin_names, builtin_tasks  # noqa: E402
from m3_agent.sandbox import DEFAULT_IMAGE, build_image  # noqa: E402
from m3_agent.standin.server import StandinServer  # noqa: E402

TARGET_S, TARGET_SHARE = 0.2, 0.10


def copies_of_the_suite(copies: int) -> tuple[list[Task], dict]:
    """The suite `copies` times, each copy's issue and conversation marked so the stand-in routes them apart."""
    tasks, conversations = [], []
    solutions = {n: json.loads((SUITE_DIR / n / "solution.json").read_text()) for n in builtin_names()}
    for task in builtin_tasks():
        name = task.instance_id.removeprefix("m3-agent__").removesuffix("-1")
        for k in range(1, copies + 1):
            marker = f"(copy {k}) "
            tasks.append(task.model_copy(update={"instance_id": f"{task.instance_id}-copy{k}",
                                                 "problem_statement": marker + task.problem_statement}))
            conv = dict(solutions[name])
            conversations.append({**conv, "match": marker + conv["match"]})
    return tasks, {"on_exhausted": "final", "conversations": conversations}


def run_once(tasks: list[Task], script: dict, out: Path, workers: int, executor) -> tuple[float, list, list]:
    """One full run with a fresh stand-in; (wall seconds, results, dispatch seconds per instance).

    Dispatch: from the instance's start to its result in the driver, minus the instance function's own
    wall time: process start and imports (local), or shipping, scheduling and the way back (Ray).
    """
    started: dict[str, float] = {}
    dispatch: list[float] = []

    def clock(kind: str, info: dict) -> None:
        if kind == "start":
            started[info["instance_id"]] = time.monotonic()
        elif kind == "finish":
            r = info["result"]
            dispatch.append(time.monotonic() - started[r.instance_id] - r.wall_s)

    with StandinServer(script) as srv:
        agent = AgentConfig.model_validate({"model": {"base_url": srv.base_url}})
        config = EvalConfig(output_dir=out, sandbox=agent.sandbox, agent=agent, test_timeout=300)
        start = time.monotonic()
        results = run_eval(tasks, None, config, RunOptions(workers=workers, executor=executor), on_event=clock)
        return time.monotonic() - start, results, dispatch


def estimate(t: float, overhead: float, model_s: float, slots_per_node: int, sessions: int) -> dict[str, float]:
    """Seconds for 500 instances on K nodes x E endpoints (see the module docstring)."""
    out = {}
    for k in (1, 2, 4, 8, 16):
        for e in (1, 2, 4, 8):
            parallel = min(k * slots_per_node, e * sessions)
            out[f"{k}x{e}"] = round(math.ceil(500 / parallel) * (t + overhead + model_s), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=4, help="suite repetitions (10 instances each)")
    parser.add_argument("--workers", type=int, default=2, help="instances at once, on both executors")
    parser.add_argument("--nodes", type=int, default=2, help="Ray nodes (processes on this machine)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per executor, in the order local ray ray local ...")
    parser.add_argument("--model-s", type=float, default=600.0, help="assumed M3 time per instance, for the estimate")
    parser.add_argument("--slots-per-node", type=int, default=4, help="docker slots per node, for the estimate")
    parser.add_argument("--sessions-per-endpoint", type=int, default=8, help="concurrent sessions per endpoint, for the estimate")
    args = parser.parse_args()
    if args.workers % args.nodes:
        parser.error("--workers must be a multiple of --nodes (the same slots on every node)")
    build_image(DEFAULT_IMAGE)
    with tempfile.TemporaryDirectory(prefix="m3-eval-scale-") as tmp:
        os.environ["M3_AGENT_CACHE_DIR"] = str(Path(tmp) / "cache")  # the workers inherit it from their nodes
        tasks, script = copies_of_the_suite(args.copies)
        started = time.monotonic()
        with LocalRayCluster(nodes=args.nodes, docker_slots=args.workers // args.nodes) as cluster:
            cluster_start_s = time.monotonic() - started
            walls: dict[str, list[float]] = {"local": [], "ray": []}
            results: dict[str, list] = {"local": [], "ray": []}
            dispatch: dict[str, list[float]] = {"local": [], "ray": []}
            for i, kind in enumerate(["local", "ray", "ray", "local"] * (args.rounds // 2) + ["local", "ray"] * (args.rounds % 2)):
                executor = RayExecutor(address=cluster.address) if kind == "ray" else None
                wall, res, disp = run_once(tasks, script, Path(tmp) / f"{kind}-{i}", args.workers, executor)
                walls[kind].append(wall)
                results[kind] += res
                dispatch[kind] += disp
    local_s, ray_s = statistics.mean(walls["local"]), statistics.mean(walls["ray"])
    local, remote = results["local"], results["ray"]
    n = len(tasks)
    resolved = {k: sum(r.outcome == "resolved" for r in v) / len(walls[k]) for k, v in results.items()}
    overhead = (ray_s - local_s) * args.workers / n
    share = (ray_s - local_s) / local_s
    per_instance = statistics.mean(r.wall_s for r in local)
    print(f"{n} instances, {args.workers} workers: local {local_s:.1f}s, Ray ({args.nodes} nodes) {ray_s:.1f}s; "
          f"resolved {resolved}; cluster start {cluster_start_s:.1f}s (not counted)", file=sys.stderr)
    print(json.dumps({
        "instances": n, "workers": args.workers, "nodes": args.nodes, "resolved": resolved,
        "local_wall_s": round(local_s, 2), "ray_wall_s": round(ray_s, 2), "rounds": args.rounds,
        "local_walls_s": [round(w, 2) for w in walls["local"]], "ray_walls_s": [round(w, 2) for w in walls["ray"]], "cluster_start_s": round(cluster_start_s, 1),
        "s_per_instance": round(per_instance, 2), "s_per_instance_ray": round(statistics.mean(r.wall_s for r in remote), 2),
        "dispatch_s_per_instance": {k: round(statistics.mean(v), 3) for k, v in dispatch.items()},
        "ray_overhead_s_per_instance": round(overhead, 3), "ray_overhead_share": round(share, 4),
        "target_met": overhead <= TARGET_S or share <= TARGET_SHARE,
        "estimate_500": estimate(per_instance, max(overhead, 0.0), args.model_s, args.slots_per_node,
                                 args.sessions_per_endpoint),
        "estimate_assumes": {"model_s": args.model_s, "slots_per_node": args.slots_per_node,
                             "sessions_per_endpoint": args.sessions_per_endpoint},
    }))


if __name__ == "__main__":
    main()
