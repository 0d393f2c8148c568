"""`m3-agent eval run | grade | report`: a thin layer over evals.runner and evals.report."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from m3_agent.errors import EvalFailed, M3AgentError, SandboxUnavailable, UsageError
from m3_agent.evals.predictions import load_predictions
from m3_agent.evals.report import CostModel, Report, build_report, print_table, report_from_dir, to_html, to_json, to_markdown, write_reports
from m3_agent.evals.config import EvalConfig
from m3_agent.evals.harness import image_here, offline_image
from m3_agent.evals.instance import InstanceResult, grader_for
from m3_agent.evals.runner import Executor, RunOptions, run_eval
from m3_agent.evals.tasks import Task, builtin_names, builtin_standin_script, load_tasks
from m3_agent.sandbox import DEFAULT_IMAGE, SandboxConfig
from m3_agent.settings import load_settings, setting_flags

app = typer.Typer(no_args_is_help=True)

DEFAULT_ROOT = Path(".m3-agent") / "evals"
TASKS_HELP = ("Tasks: `builtin`, a .json / .jsonl / .parquet of SWE-bench instances, a dataset folder, or a hub "
              "dataset id (princeton-nlp/SWE-bench_Verified, SWE-bench/SWE-bench_Lite, ...).")


class RunProgress:
    """Live progress: done / running / resolved so far, tokens, elapsed and ETA; one line per instance."""

    def __init__(self, total: int, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self.running = self.resolved = self.tokens = 0
        self.progress = Progress(
            TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(),
            TextColumn("running {task.fields[running]}  resolved {task.fields[resolved]}  tokens {task.fields[tokens]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, disable=not enabled, transient=False,
        )
        self.task_id = self.progress.add_task("eval", total=total, running=0, resolved=0, tokens="0")

    def __call__(self, kind: str, info: dict[str, Any]) -> None:
        if kind == "start":
            self.running += 1
        else:
            r: InstanceResult = info["result"]
            if kind == "finish":
                self.running -= 1
            self.resolved += r.outcome == "resolved"
            if r.agent:
                self.tokens += r.agent.prompt_tokens + r.agent.completion_tokens
            if self.enabled:
                mark = {"resolved": "[green]resolved", "error": "[red]error", "empty_patch": "[dim]empty patch"}
                why = f" ({(r.error or r.report.error or '').splitlines()[0]})" if r.outcome == "error" else ""
                # ids and errors may hold brackets (`test_x[a]`): escaped, they are not read as markup.
                self.console.print(f"{'(earlier) ' if kind == 'skip' else ''}{escape(r.instance_id)}: "
                                   f"{mark.get(r.outcome, '[yellow]unresolved')}[/]{escape(why)} {r.wall_s:.1f}s")
            self.progress.advance(self.task_id)
        self.progress.update(self.task_id, running=self.running, resolved=self.resolved, tokens=f"{self.tokens:,}")


def _ids(instance_ids: list[str] | None) -> list[str] | None:
    out = [i.strip() for chunk in instance_ids or [] for i in chunk.split(",") if i.strip()]
    return out or None


def _check_inputs(workers: int, repos: Path | None) -> None:
    """Refuse what would fail every instance later, before any progress is drawn."""
    if workers < 1:
        raise UsageError(f"--workers {workers}: give at least 1 (instances run at once)")
    if repos is not None and not repos.is_dir():
        raise UsageError(f"--repos {repos} is not a folder: give the folder of clones or mirrors named <owner>__<name>")


def _default_output(kind: str, *parts: str) -> Path:
    """A stable default per (kind, inputs), so that running the same command again resumes."""
    key = hashlib.sha256("\0".join(str(Path(p).resolve()) if Path(p).exists() else p for p in parts).encode())
    stem = "-".join(Path(p).stem for p in parts)[:60]
    return DEFAULT_ROOT / f"{kind}-{stem}-{key.hexdigest()[:8]}"


@dataclass(frozen=True)
class ReportOptions:
    """What a run's report counts and records, and what the command shows."""

    cost: CostModel = field(default_factory=CostModel)
    all_tasks: list[Task] | None = None  # what the report counts (default: the tasks run): left-out tasks are incomplete
    meta: dict[str, Any] = field(default_factory=dict)  # more for run.json (what admission learned)
    quiet: bool = False  # no progress and no table
    json_out: bool = False  # end with the summary as one JSON object on stdout


def execute(tasks: list[Task], predictions, config: EvalConfig, options: RunOptions,
            shown: ReportOptions) -> Report:
    """Run, write the reports into the output directory, print the table (and the JSON summary).

    `options.admit` (evals.admission.KvAdmit) may hold instances back; `options.executor` (default:
    the local process pool) checks the sandbox image on its own nodes.
    """
    console = Console(stderr=shown.json_out)
    # Fail fast, before any instance runs, when the engine or the sandbox image is missing. Harness tasks
    # run in their instance images instead; an executor checks its own nodes.
    image = config.sandbox.image
    if options.executor is None and any(grader_for(t).checks_out for t in tasks) and not image_here(image):
        raise SandboxUnavailable(f"sandbox image {image} not found: run `m3-agent sandbox build`")
    try:
        config.output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot make the results folder {config.output_dir}: {e.strerror or e}; "
                         "pass --output DIR where you may write") from None
    started = time.monotonic()
    progress = RunProgress(len(tasks), console, enabled=not shown.quiet)
    with progress.progress:  # the live display, for as long as the run lasts
        results = run_eval(tasks, predictions, config, options, on_event=progress)
    meta_path = config.output_dir / "run.json"
    earlier = json.loads(meta_path.read_text()).get("wall_s", 0.0) if meta_path.is_file() else 0.0
    wall = round(earlier + time.monotonic() - started, 3)  # a resumed run adds to the time already spent
    meta = {"wall_s": wall, "workers": options.workers, "model_name": config.model_name,
            "cost": shown.cost.model_dump(), "instances": len(tasks), **shown.meta}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    report = build_report(results, tasks=shown.all_tasks or tasks, cost=shown.cost, run_wall_s=wall)
    paths = write_reports(report, config.output_dir)
    if not shown.quiet:
        print_table(report, console)
        console.print(f"reports: {paths['html']}  {paths['markdown']}  {paths['json']}; "
                      f"predictions: {config.output_dir / 'predictions.jsonl'}")
    if shown.json_out:
        print(report.summary.model_dump_json())
    errors = [r for r in results if r.outcome == "error"]
    if results and len(errors) == len(results):  # nothing was graded: a failure, whatever the reports say
        first = (errors[0].error or errors[0].report.error or "no reason recorded").splitlines()[0]
        raise EvalFailed(f"every instance ended in an error ({len(errors)} of {len(errors)}); the first, "
                         f"{errors[0].instance_id}: {first}")
    return report


@app.command("grade")
def grade_command(
    tasks: str = typer.Option(..., "--tasks", "-t", help=TASKS_HELP),
    split: str = typer.Option("test", "--split", help="Dataset split (hub datasets and dataset folders)."),
    image_namespace: str = typer.Option("swebench", help="Namespace of SWE-bench instance images ('' for none)."),
    image_tag: str = typer.Option("latest", help="Tag of SWE-bench instance images."),
    predictions: str = typer.Option(..., "--predictions", "-p", help="A predictions file, `gold` or `empty`."),
    repos: Optional[Path] = typer.Option(None, "--repos", help="Folder of clones or mirrors named <owner>__<name>."),
    workers: int = typer.Option(1, "--workers", "-w", help="Instances graded at once."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Results folder (rerun with it to resume)."),
    instance_ids: Optional[list[str]] = typer.Option(None, "--instance-ids", "-i", help="Only these ids (repeat or comma-separate)."),
    test_timeout: float = typer.Option(600.0, help="Seconds for one instance's tests."),
    instance_timeout: float = typer.Option(1800.0, help="Seconds for one whole instance."),
    image: Optional[str] = typer.Option(None, help="Sandbox image (default: the project image)."),
    retry_errors: bool = typer.Option(False, "--retry-errors", help="Redo instances that ended in an error."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress and no table."),
    json_out: bool = typer.Option(False, "--json", help="End with the summary as one JSON object on stdout."),
) -> None:
    """Grade existing predictions: resolved = every FAIL_TO_PASS and PASS_TO_PASS test passes."""
    _check_inputs(workers, repos)
    task_list = load_tasks(tasks, instance_ids=_ids(instance_ids), split=split)
    preds = load_predictions(predictions, task_list)
    # As SWE-bench does: only instances with a prediction are graded; the others count as incomplete.
    predicted = [t for t in task_list if t.instance_id in preds]
    if not predicted:
        raise UsageError(f"no prediction in {predictions} names a task of {tasks}: check the instance_id values")
    strays = len(set(preds) - {t.instance_id for t in task_list})
    if strays and not quiet:
        Console(stderr=True).print(f"m3-agent: {strays} prediction(s) name no task here and are ignored")
    config = EvalConfig(output_dir=output or _default_output("grade", tasks, predictions), repos=repos,
                        sandbox=SandboxConfig(image=image or DEFAULT_IMAGE), test_timeout=test_timeout,
                        instance_timeout=instance_timeout, image_namespace=image_namespace or None, image_tag=image_tag)
    execute(predicted, preds, config, RunOptions(workers=workers, retry_errors=retry_errors),
            ReportOptions(all_tasks=task_list, quiet=quiet, json_out=json_out))


@app.command("run")
@setting_flags("--base-url", "--api-key", "--serve", "--model", "--max-turns", "--thinking", "--image",
               repeated={"--base-url": "repeat for a pool (--executor ray)"})
def run_command(
    tasks: str = typer.Option(..., "--tasks", "-t", help=TASKS_HELP),
    split: str = typer.Option("test", "--split", help="Dataset split (hub datasets and dataset folders)."),
    image_namespace: str = typer.Option("swebench", help="Namespace of SWE-bench instance images ('' for none)."),
    image_tag: str = typer.Option("latest", help="Tag of SWE-bench instance images."),
    model_name: str = typer.Option("m3-agent", help="model_name_or_path written into the predictions."),
    repos: Optional[Path] = typer.Option(None, "--repos", help="Folder of clones or mirrors named <owner>__<name>."),
    workers: int = typer.Option(1, "--workers", "-w", help="Instances run at once."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Results folder (rerun with it to resume)."),
    instance_ids: Optional[list[str]] = typer.Option(None, "--instance-ids", "-i", help="Only these ids (repeat or comma-separate)."),
    test_timeout: float = typer.Option(600.0, help="Seconds for one instance's tests."),
    instance_timeout: float = typer.Option(3600.0, help="Seconds for one whole instance (agent + grading)."),
    usd_per_m_input: Optional[float] = typer.Option(None, help="Price: USD per 1M input tokens."),
    usd_per_m_cached: Optional[float] = typer.Option(None, help="Price: USD per 1M cached input tokens."),
    usd_per_m_output: Optional[float] = typer.Option(None, help="Price: USD per 1M output tokens."),
    gpu_usd_per_hour: Optional[float] = typer.Option(None, help="Self-hosted price: GPU USD per hour."),
    config_file: Optional[Path] = typer.Option(None, "--config", help="Config file instead of m3-agent.toml / pyproject."),
    retry_errors: bool = typer.Option(False, "--retry-errors", help="Redo instances that ended in an error."),
    kv_admission: bool = typer.Option(True, "--kv-admission/--no-kv-admission",
                                      help="Order a repository's instances back to back and start one only while "
                                           "the running contexts fit the server's KV cache (never above --workers)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress and no table."),
    json_out: bool = typer.Option(False, "--json", help="End with the summary as one JSON object on stdout."),
    executor: str = typer.Option("local", "--executor", help="local (a process pool) | ray (a Ray cluster)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --executor ray: the cluster (HOST:PORT); default: a one-machine Ray."),
    *,
    flags: dict[str, Any],  # the setting flags given (`setting_flags`); --base-url is a list: a pool
) -> None:
    """Run the agent on each task, then grade its patch; predictions are written in SWE-bench's format."""
    _check_inputs(workers, repos)
    urls = flags["--base-url"] or []
    if executor not in ("local", "ray"):
        raise UsageError(f"unknown --executor {executor!r}: use local or ray")
    if executor == "local" and (len(urls) > 1 or ray_address):
        raise UsageError("several --base-url and --ray-address need --executor ray")
    endpoint, agent, settings = _endpoint_and_agent({**flags, "--base-url": urls[0] if urls else None}, config_file,
                                                    quiet)
    task_list = load_tasks(tasks, instance_ids=_ids(instance_ids), split=split)
    config = EvalConfig(output_dir=output or _default_output("run", tasks), repos=repos, sandbox=agent.sandbox,
                        test_timeout=test_timeout, instance_timeout=instance_timeout, model_name=model_name,
                        agent=agent, reuse=settings.eval, image_namespace=image_namespace or None, image_tag=image_tag)
    run_order, admit, meta = task_list, None, {}
    if kv_admission:
        run_order, admit, meta = _kv_admission(task_list, endpoint, settings, workers, repos, agent, quiet)
    run = RunOptions(workers=workers, retry_errors=retry_errors, admit=admit,
                     executor=_ray_executor(ray_address, [endpoint, *urls[1:]], agent) if executor == "ray" else None)
    execute(run_order, None, config, run, ReportOptions(
        cost=CostModel(usd_per_m_input=usd_per_m_input, usd_per_m_cached=usd_per_m_cached,
                       usd_per_m_output=usd_per_m_output, gpu_usd_per_hour=gpu_usd_per_hour), meta=meta,
        all_tasks=task_list, quiet=quiet, json_out=json_out))  # the report keeps the tasks' own order


def _endpoint_and_agent(flags: dict[str, Any], config_file: Optional[Path], quiet: bool) -> tuple[str, Any, Any]:
    """The settings, the endpoint they name (checked: exit 3 or 8 now, not one error per instance) and the
    agent config with its URL and key."""
    from m3_agent.serving.endpoint import Served

    settings, _ = load_settings(".", flags, config_file=config_file)
    serving = Served(settings.serve, None if quiet else lambda msg: typer.echo(msg, err=True))
    # the plain-http warning once for the run, not per instance
    agent = settings.resolved_agent_config(serving, warn=lambda w: typer.echo(f"m3-agent: warning: {w}", err=True))
    return agent.model.base_url, agent, settings


def _kv_admission(tasks: list[Task], endpoint: str, settings, workers: int, repos: Optional[Path],
                  agent, quiet: bool) -> tuple[list[Task], Any, dict]:
    """The tasks in reuse order, the admission gate for the endpoint's KV capacity, and what run.json records."""
    from m3_agent.agent.endpoint import EndpointClient
    from m3_agent.evals.admission import (KvAdmit, Reuse, bytes_per_token, diff_bytes_per_token, learn_capacity,
                                          order_for_reuse)
    from m3_agent.evals.reuse.ordering import batch_ids

    capacity, reuse = learn_capacity(endpoint, settings.serve), settings.eval
    key = agent.model.api_key.get_secret_value()
    try:
        window = EndpointClient(endpoint, api_key=key).card(agent.model.name).max_model_len or 1_048_576
    except M3AgentError:
        window = 1_048_576
    if not quiet:
        said = f"{capacity.tokens:,} tokens of KV cache ({capacity.source})" if capacity else "no KV capacity known"
        Console(stderr=True).print(f"m3-agent: {escape(said)}; a repository's instances run back to back")
    first = {t.repo: t for t in reversed(tasks)}  # one task per repository: its tree calibrates the ratio
    per_token = {repo: bytes_per_token(endpoint, t, repos, api_key=key) for repo, t in first.items()} if capacity else {}
    per_diff = ({repo: diff_bytes_per_token(endpoint, t, repos, api_key=key) for repo, t in first.items()}
                if capacity and reuse.delta else {})
    meta = {"kv_capacity_tokens": capacity.tokens if capacity else None,
            "kv_capacity_source": capacity.source if capacity else None,
            "bytes_per_token": {k: round(v, 3) for k, v in per_token.items()},
            "bytes_per_diff_token": {k: round(v, 3) for k, v in per_diff.items()}}
    admit = KvAdmit(capacity, workers, repos=repos, window=window, per_token=per_token,
                    max_turns=agent.limits.max_turns,
                    reuse=Reuse(reuse.delta, reuse.shared_share, batch_ids(tasks, delta=reuse.delta), per_diff))
    return order_for_reuse(tasks), admit, meta


def _ray_executor(address: Optional[str], endpoints: list[str], agent) -> Executor:
    """The Ray executor over a pool of the endpoints (the first one was checked already); one key for all."""
    from m3_agent.evals.endpoints import EndpointPool
    from m3_agent.evals.ray_executor import RayExecutor
    from m3_agent.agent.access import ApiKey, Endpoint

    key = ApiKey(value=agent.model.api_key, source="the key of the first --base-url")
    for url in endpoints[1:]:
        Endpoint(base_url=url, key=key).check()  # exit 3 or 8 now, as for the first
    return RayExecutor(address=address, pool=EndpointPool(endpoints))


@app.command("images")
def images_command(
    tasks: str = typer.Option(..., "--tasks", "-t", help="Tasks with a `testbed` recipe (see docs/evals.md)."),
    split: str = typer.Option("test", "--split", help="Dataset split (hub datasets and dataset folders)."),
    image_namespace: str = typer.Option("m3-agent-offline", help="Namespace to name the images in."),
    instance_ids: Optional[list[str]] = typer.Option(None, "--instance-ids", "-i", help="Only these ids."),
) -> None:
    """Build SWE-bench-layout instance images offline (no registry): one name per line on stdout."""
    console = Console(stderr=True)
    for task in load_tasks(tasks, instance_ids=_ids(instance_ids), split=split):
        print(offline_image(task, namespace=image_namespace or None,
                            progress=lambda line: console.print(escape(line), highlight=False)))


def _write_out(path: Path, text: str) -> None:
    """Write an --out file; a path that cannot be written is a usage error, not a traceback."""
    try:
        path.write_text(text)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


@app.command("standin-script")
def standin_script_command(
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the script to this file (default: stdout)."),
    instance_ids: Optional[list[str]] = typer.Option(None, "--instance-ids", "-i",
                                                     help="Only these built-in tasks (names or ids)."),
) -> None:
    """The stand-in script that plays the built-in suite's fixes, for `m3-agent standin --script FILE`.

    A TEST DOUBLE: with it `eval run --tasks builtin` exercises the machinery without a model.
    """
    names = [i.removeprefix("m3-agent__").removesuffix("-1") for i in _ids(instance_ids) or []]
    unknown = sorted(set(names) - set(builtin_names()))
    if unknown:
        raise UsageError(f"no built-in task {', '.join(unknown)}: the suite has {', '.join(builtin_names())}")
    text = json.dumps(builtin_standin_script(names or None), indent=1) + "\n"
    if out is None:
        print(text, end="")
        return
    _write_out(out, text)
    Console(stderr=True).print(f"wrote {out}: serve it with `m3-agent standin --script {out}`", markup=False)


@app.command("report")
def report_command(
    output: Path = typer.Argument(..., help="A results folder written by `eval run` or `eval grade`."),
    fmt: str = typer.Option("table", "--format", "-f", help="table | json | md | html"),
    out: Optional[Path] = typer.Option(None, "--out", help="Write to this file instead of the terminal."),
    tasks: Optional[str] = typer.Option(None, "--tasks", "-t", help="The tasks, to count unfinished instances."),
    usd_per_m_input: Optional[float] = typer.Option(None, help="Price: USD per 1M input tokens."),
    usd_per_m_cached: Optional[float] = typer.Option(None, help="Price: USD per 1M cached input tokens."),
    usd_per_m_output: Optional[float] = typer.Option(None, help="Price: USD per 1M output tokens."),
    gpu_usd_per_hour: Optional[float] = typer.Option(None, help="Self-hosted price: GPU USD per hour."),
) -> None:
    """Render the report of a results folder: terminal table, JSON, Markdown or an HTML page with plots."""
    if not (output / "results.jsonl").is_file():
        raise UsageError(f"no results in {output}: give the folder an `eval run` or `eval grade` wrote")
    renderers = {"json": to_json, "md": to_markdown, "markdown": to_markdown, "html": to_html}
    if fmt != "table" and fmt not in renderers:
        raise UsageError(f"unknown --format {fmt!r}: use table, json, md or html")
    cost = CostModel(usd_per_m_input=usd_per_m_input, usd_per_m_cached=usd_per_m_cached,
                     usd_per_m_output=usd_per_m_output, gpu_usd_per_hour=gpu_usd_per_hour)
    cost = cost if cost.model_dump(exclude_none=True) else None
    report = report_from_dir(output, tasks=load_tasks(tasks) if tasks else None, cost=cost)
    if fmt == "table":
        if out:
            raise UsageError("--out needs --format json, md or html")
        print_table(report)
        return
    text = renderers[fmt](report)
    if out:
        _write_out(out, text if text.endswith("\n") else text + "\n")
        typer.echo(f"wrote {out}: the {fmt} report of {len(report.instances)} instances in {output}")
    else:
        print(text)
