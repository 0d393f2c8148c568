"""Beyond one node: vLLM tensor parallel across nodes on Ray, or replicas behind a router.

Both are printed (never run) by `m3-agent serve start --dry-run --nodes N` / `--replicas N`:
each step is a command and the machine it runs on; `--replicas` also prints the `eval run` that
uses the replicas as an endpoint pool. Servers that answer other machines require an API key:
every plan carries one (`access.choose_key(shared=True)`), shown masked.
"""

from __future__ import annotations

from pydantic import BaseModel

from m3_agent.errors import UsageError
from m3_agent.redact import mask
from m3_agent.agent.endpoint import is_loopback
from m3_agent.agent.access import ALL_INTERFACES, KEY_ENV, LOOPBACK, choose_key
from m3_agent.serving.profiles import Overrides, Profile, build_command, flag_value, set_flag

RAY_PORT = 6379
ROUTER_PORT = 30000  # not 8000: the router may share a node with a replica


def keyed(overrides: Overrides | None, host: str | None = None) -> Overrides:
    """`overrides` for a server of a plan: on `host` (default: theirs, else loopback), with a key."""
    o = overrides or Overrides()
    host = host or o.host or LOOPBACK
    return o.model_copy(update={"host": host, "api_key": o.api_key or choose_key(host, shared=True)})


def replica_host(overrides: Overrides | None) -> str:
    """Where a replica listens: the host asked for, unless loopback, since replicas answer the router."""
    given = (overrides or Overrides()).host
    return given if given and not is_loopback(given) else ALL_INTERFACES


class Step(BaseModel):
    """One command of a multi-node launch and where to run it."""

    where: str
    command: str


def ray_tensor_parallel(profile: Profile, nodes: int, *, head: str = "<HEAD_IP>",
                        overrides: Overrides | None = None) -> list[Step]:
    """One model replica split by tensor parallelism over `nodes` nodes, coordinated by Ray."""
    if profile.engine != "vllm":
        raise UsageError("the multi-node tensor-parallel form is for vLLM: pass --engine vllm")
    if flag_value(profile.args, "--data-parallel-size"):
        raise UsageError(f"{profile.name} is data parallel: scale it with --replicas, not --nodes")
    if nodes < 2:
        raise UsageError("--nodes needs at least 2 nodes")
    o = keyed(overrides).model_copy(update={"tensor_parallel_size": profile.gpus * nodes})
    cmd = build_command(profile, "native", o)
    argv = list(cmd.argv)
    set_flag(argv, "--distributed-executor-backend", "ray")
    cmd = cmd.model_copy(update={"argv": argv})
    env = " ".join(f"{k}={v}" for k, v in cmd.env.items())
    prefix = f"{env} " if env else ""
    steps = [Step(where="head node", command=f"{prefix}ray start --head --port={RAY_PORT}")]
    steps += [
        Step(where=f"worker node {i}", command=f"{prefix}ray start --address={head}:{RAY_PORT}")
        for i in range(1, nodes)
    ]
    steps.append(Step(where="head node, once `ray status` shows every GPU", command=cmd.shell()))
    return steps


def replicas_behind_router(profile: Profile, replicas: int, *, overrides: Overrides | None = None) -> list[Step]:
    """`replicas` independent single-node servers and one router spreading requests over them."""
    if replicas < 2:
        raise UsageError("--replicas needs at least 2 replicas")
    hosts = [f"<NODE_{i}_IP>" for i in range(1, replicas + 1)]
    o = keyed(overrides, replica_host(overrides))
    cmd = build_command(profile, "native", o)
    steps = [Step(where=f"node {h}", command=cmd.shell()) for h in hosts]
    workers = " ".join(f"http://{h}:{cmd.port}" for h in hosts)
    # sglang-router's --api-key is sent to the workers and required of its own clients (checked with 0.3.2)
    router = (f"python -m sglang_router.launch_router --worker-urls {workers} --policy cache_aware "
              f"--host {ALL_INTERFACES} --port {ROUTER_PORT} --api-key {mask(o.api_key.value.get_secret_value())}")
    return [*steps, Step(where="router host (pip install sglang-router)", command=router)]


def eval_pool_step(profile: Profile, replicas: int, *, overrides: Overrides | None = None) -> Step:
    """The `eval run` that uses the same replicas as an endpoint pool (sticky per instance, no router needed)."""
    hosts = [f"<NODE_{i}_IP>" for i in range(1, replicas + 1)]
    o = keyed(overrides, ALL_INTERFACES)
    port = build_command(profile, "native", o).port
    urls = " ".join(f"--base-url http://{h}:{port}/v1" for h in hosts)
    return Step(where="eval driver, instead of the router (each instance keeps its replica's prefix cache)",
                command=f"{KEY_ENV}={mask(o.api_key.value.get_secret_value())} m3-agent eval run --tasks TASKS "
                        f"--executor ray --ray-address <HEAD_IP>:{RAY_PORT} {urls}")
