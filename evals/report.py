"""Reports over finished instances: SWE-bench's summary, run metrics, cost; as a table, JSON, Markdown, HTML.

    report = build_report(results, tasks=tasks, cost=CostModel(gpu_usd_per_hour=3.64), run_wall_s=812.0)
    print(to_markdown(report)); Path("report.html").write_text(to_html(report))

Cost is either per token (USD per 1M input / cached / output tokens) or self-hosted: GPU USD per hour
times the agent's wall time, per instance (M3-SERVING.md's cost model); the run as a whole is also
priced at GPU USD per hour times the run's wall time, which is what a dedicated server really costs.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table

from m3_agent.evals.instance import AgentStats, InstanceResult
from m3_agent.evals.results import load_results
from m3_agent.evals.tasks import Task

SCHEMA_VERSION = 2
SUMMED = ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens", "turns", "stalls",
          "sandbox_restarts")  # AgentStats fields the summary adds up over the instances


class CostModel(BaseModel):
    """How to price a run: per-token prices, or GPU USD per hour (self-hosted)."""

    usd_per_m_input: float | None = None
    usd_per_m_cached: float | None = None  # defaults to the input price
    usd_per_m_output: float | None = None
    gpu_usd_per_hour: float | None = None

    def instance_cost(self, r: InstanceResult) -> float | None:
        """USD for one instance's agent run, or None when there is no agent run or no price."""
        a = r.agent
        if a is None:
            return None
        if self.gpu_usd_per_hour is not None:
            return self.gpu_usd_per_hour * a.wall_s / 3600
        if self.usd_per_m_input is None and self.usd_per_m_output is None:
            return a.cost_usd
        cached_price = self.usd_per_m_cached if self.usd_per_m_cached is not None else self.usd_per_m_input
        return ((a.prompt_tokens - a.cached_tokens) * (self.usd_per_m_input or 0)
                + a.cached_tokens * (cached_price or 0) + a.completion_tokens * (self.usd_per_m_output or 0)) / 1e6


class InstanceRow(BaseModel):
    """One line of the per-instance table."""

    instance_id: str
    outcome: str
    agent: AgentStats | None = None  # None when predictions were graded without an agent run
    grading_s: float = 0.0
    wall_s: float = 0.0
    cost_usd: float | None = None
    error: str | None = None


class Summary(BaseModel):
    """SWE-bench's run report (counts and id lists) plus m3-agent's run metrics."""

    total_instances: int
    submitted_instances: int
    completed_instances: int
    resolved_instances: int
    unresolved_instances: int
    empty_patch_instances: int
    error_instances: int
    completed_ids: list[str]
    incomplete_ids: list[str]
    empty_patch_ids: list[str]
    submitted_ids: list[str]
    resolved_ids: list[str]
    unresolved_ids: list[str]
    error_ids: list[str]
    schema_version: int = SCHEMA_VERSION
    # m3-agent additions
    patch_apply_failed_ids: list[str] = Field(default_factory=list)
    environment_error_ids: list[str] = Field(default_factory=list)  # errors: the test command could not start
    resolve_rate: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cache_hit_share: float = 0.0
    prefill_computed_tokens: int = 0  # prompt tokens the server prefilled (prompt - cached)
    prefill_reused_tokens: int = 0  # prompt tokens served from its prefix cache (= cached_tokens)
    turns: int = 0
    stalls: int = 0
    sandbox_restarts: int = 0  # over all instances: sandboxes that died mid-run and were replaced
    mode_counts: dict[str, int] = Field(default_factory=dict)
    wall_s: float = 0.0  # the run's wall time when known, else the sum over instances
    cost_usd: float | None = None  # sum over instances
    run_cost_usd: float | None = None  # GPU USD per hour x the run's wall time
    cost_per_resolved_usd: float | None = None


class Report(BaseModel):
    """Everything the renderers need."""

    summary: Summary
    instances: list[InstanceRow]


def build_report(results: list[InstanceResult], *, tasks: list[Task] | None = None,
                 cost: CostModel | None = None, run_wall_s: float | None = None) -> Report:
    """Summarise results; `tasks` (when given) defines the total and which instances are incomplete."""
    cost = cost or CostModel()
    by_id = {r.instance_id: r for r in results}
    all_ids = [t.instance_id for t in tasks] if tasks is not None else list(by_id)
    finished = [by_id[i] for i in all_ids if i in by_id]
    rows = [_row(r, cost) for r in finished]
    ids = {k: [r.instance_id for r in finished if r.outcome == k] for k in ("resolved", "error")}
    completed = [r.instance_id for r in finished if r.outcome != "error"]
    empty = [r.instance_id for r in finished if not r.report.patch_exists]
    costs = [row.cost_usd for row in rows if row.cost_usd is not None]
    total_cost = round(sum(costs), 6) if costs else None
    runs = [r.agent for r in finished if r.agent is not None]
    modes: Counter[str] = Counter()
    for a in runs:
        modes.update(a.mode_counts)
    sums = {k: sum(getattr(a, k) for a in runs) for k in SUMMED}
    prompt, cached = sums["prompt_tokens"], sums["cached_tokens"]
    wall = run_wall_s if run_wall_s is not None else sum(row.wall_s for row in rows)
    summary = Summary(
        total_instances=len(all_ids),
        submitted_instances=sum(1 for r in finished if r.model_patch is not None),
        completed_instances=len(completed),
        resolved_instances=len(ids["resolved"]),
        unresolved_instances=len(completed) - len(ids["resolved"]),
        empty_patch_instances=len(empty),
        error_instances=len(ids["error"]),
        completed_ids=completed,
        incomplete_ids=[i for i in all_ids if i not in by_id],
        empty_patch_ids=empty,
        submitted_ids=[r.instance_id for r in finished if r.model_patch is not None],
        resolved_ids=ids["resolved"],
        unresolved_ids=[i for i in completed if i not in set(ids["resolved"])],
        error_ids=ids["error"],
        # The harness marks a run with no results "not applied" too: one that could not start is an environment error.
        patch_apply_failed_ids=[r.instance_id for r in finished if r.report.patch_exists and not r.error
                                and not r.report.patch_successfully_applied and not r.report.environment_error],
        environment_error_ids=[r.instance_id for r in finished if r.report.environment_error and not r.error],
        resolve_rate=round(len(ids["resolved"]) / len(all_ids), 4) if all_ids else 0.0,
        **sums,
        cache_hit_share=round(cached / prompt, 4) if prompt else 0.0,
        prefill_computed_tokens=prompt - cached,
        prefill_reused_tokens=cached,
        mode_counts=dict(modes),
        wall_s=round(wall, 3),
        cost_usd=total_cost,
        run_cost_usd=(round(cost.gpu_usd_per_hour * run_wall_s / 3600, 6)
                      if cost.gpu_usd_per_hour is not None and run_wall_s is not None else None),
        cost_per_resolved_usd=round(total_cost / len(ids["resolved"]), 6) if total_cost and ids["resolved"] else None,
    )
    return Report(summary=summary, instances=rows)


def _row(r: InstanceResult, cost: CostModel) -> InstanceRow:
    c = cost.instance_cost(r)
    return InstanceRow(instance_id=r.instance_id, outcome=r.outcome, agent=r.agent, wall_s=r.wall_s,
                       grading_s=r.report.timings.get("total_s", 0.0), error=r.error or r.report.error,
                       cost_usd=round(c, 6) if c is not None else None)


def report_from_dir(output_dir: Path, *, tasks: list[Task] | None = None, cost: CostModel | None = None) -> Report:
    """A report over the results.jsonl of an output directory (run metadata read from run.json)."""
    meta_path = Path(output_dir) / "run.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if cost is None and meta.get("cost"):
        cost = CostModel.model_validate(meta["cost"])
    return build_report(list(load_results(output_dir).values()), tasks=tasks, cost=cost,
                        run_wall_s=meta.get("wall_s"))


# --- renderers ---------------------------------------------------------------------------------------

def _money(v: float | None) -> str:
    return "-" if v is None else f"${v:.4f}"


def _modes(m: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(m.items())) or "-"


_COLUMNS = ["instance", "outcome", "agent", "turns", "tok in", "tok out", "cached", "cache hit", "modes",
            "stalls", "agent s", "grade s", "cost"]


_NO_AGENT = AgentStats(status="-")
# What only an agent's run fills: left out of the terminal and Markdown reports of `eval grade`.
_AGENT_COLUMNS = {"agent", "turns", "tok in", "tok out", "cached", "cache hit", "modes", "stalls", "agent s", "cost"}
_AGENT_LINES = {"tokens in / out / cached", "cache-hit share", "prefill computed / reused", "thinking modes",
                "turns / stalls", "sandbox restarts", "cost (sum over instances)", "cost per resolved instance"}


def _agent_ran(report: Report) -> bool:
    return any(row.agent is not None for row in report.instances)


def _columns(report: Report) -> list[str]:
    """The per-instance columns worth showing: no agent columns when no agent ran (a grade)."""
    return _COLUMNS if _agent_ran(report) else [c for c in _COLUMNS if c not in _AGENT_COLUMNS]


def _shown_cells(row: InstanceRow, columns: list[str]) -> list[str]:
    cells = dict(zip(_COLUMNS, _cells(row)))
    return [cells[c] for c in columns]


def _shown_headline(report: Report) -> list[tuple[str, str]]:
    lines = _headline(report.summary)
    return lines if _agent_ran(report) else [(k, v) for k, v in lines if k not in _AGENT_LINES]


def _agent(row: InstanceRow) -> AgentStats:
    return row.agent or _NO_AGENT


def _cells(row: InstanceRow) -> list[str]:
    a = _agent(row)
    return [row.instance_id, row.outcome, a.status, str(a.turns), f"{a.prompt_tokens:,}", f"{a.completion_tokens:,}",
            f"{a.cached_tokens:,}", f"{a.cache_hit_share:.0%}", _modes(a.mode_counts), str(a.stalls), f"{a.wall_s:.1f}",
            f"{row.grading_s:.1f}", _money(row.cost_usd)]


def _headline(s: Summary) -> list[tuple[str, str]]:
    return [
        ("resolved", f"{s.resolved_instances}/{s.total_instances} ({s.resolve_rate:.1%})"),
        ("unresolved / errors / empty patches", f"{s.unresolved_instances} / {s.error_instances} / {s.empty_patch_instances}"),
        ("patches that did not apply", str(len(s.patch_apply_failed_ids))),
        ("environment errors (tests could not start)", str(len(s.environment_error_ids))),
        ("incomplete", str(len(s.incomplete_ids))),
        ("tokens in / out / cached", f"{s.prompt_tokens:,} / {s.completion_tokens:,} / {s.cached_tokens:,}"),
        ("cache-hit share", f"{s.cache_hit_share:.1%}"),
        ("prefill computed / reused", f"{s.prefill_computed_tokens:,} / {s.prefill_reused_tokens:,}"),
        ("thinking modes", _modes(s.mode_counts)),
        ("turns / stalls", f"{s.turns} / {s.stalls}"),
        ("sandbox restarts", str(s.sandbox_restarts)),
        ("wall time", f"{s.wall_s:.1f} s"),
        ("cost (sum over instances)", _money(s.cost_usd)),
        ("cost (GPU $/h x run wall time)", _money(s.run_cost_usd)),
        ("cost per resolved instance", _money(s.cost_per_resolved_usd)),
    ]


def print_table(report: Report, console: Console | None = None) -> None:
    """The report as rich tables on the terminal."""
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 200)  # logs and pipes: no column cut to 80 characters
    table = Table(title="instances", show_lines=False)
    columns = _columns(report)
    for col in columns:
        # fold, never "…": a narrow terminal wraps an id or a number onto more lines instead of hiding part of it
        table.add_column(col, justify="left" if col in ("instance", "outcome", "agent", "modes") else "right",
                         overflow="fold")
    style = {"resolved": "green", "unresolved": "yellow", "error": "red", "empty_patch": "dim"}
    for row in report.instances:
        table.add_row(*_shown_cells(row, columns), style=style.get(row.outcome))
    console.print(table)
    head = Table(title="summary", show_header=False)
    head.add_column(justify="left")
    head.add_column(justify="right")
    for k, v in _shown_headline(report):
        head.add_row(k, v)
    console.print(head)


def to_json(report: Report) -> str:
    """The whole report as JSON: {summary, instances}."""
    return report.model_dump_json(indent=2)


def to_markdown(report: Report) -> str:
    """The report as Markdown: a summary list and a per-instance table."""
    lines = ["# m3-agent eval report", ""]
    columns = _columns(report)
    lines += [f"- **{k}**: {v}" for k, v in _shown_headline(report)]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in report.instances:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _shown_cells(row, columns)) + " |")
    errors = [r for r in report.instances if r.error]
    if errors:
        lines += ["", "## Errors", ""] + [f"- `{r.instance_id}`: {r.error.splitlines()[0] if r.error else ''}"
                                          for r in errors]
    return "\n".join(lines) + "\n"


_COLOURS = {"resolved": "#2e7d32", "unresolved": "#f9a825", "error": "#c62828", "empty_patch": "#9e9e9e"}
# Plot labels are monospace, so their width is known before a browser lays them out.
_LABEL_PX, _CHAR_PX, _LABEL_MAX = 12, 7.4, 48


def middle_cut(text: str, limit: int = _LABEL_MAX) -> str:
    """`text` unchanged when it fits in `limit` characters, else its head and tail around an ellipsis."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return f"{text[:head]}\u2026{text[len(text) - (limit - 1 - head):]}"


def _bars(title: str, rows: list[InstanceRow], values: list[float], fmt: Callable[[float], str]) -> str:
    """One horizontal bar chart as inline SVG: a bar per instance, coloured by outcome."""
    label_w = round(max((len(middle_cut(r.instance_id)) for r in rows), default=0) * _CHAR_PX) + 12
    bar_area, bar_h, gap = 460, 16, 4
    width, top = label_w + bar_area + 110, max(values, default=0) or 1.0
    height = 30 + len(rows) * (bar_h + gap)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(title)}"><text x="0" y="16" font-weight="bold">{html.escape(title)}</text>']
    for i, (row, v) in enumerate(zip(rows, values)):
        y = 26 + i * (bar_h + gap)
        w = bar_area * v / top
        # the label, right-aligned: whole, or cut in the middle with the full id on hover
        shown = middle_cut(row.instance_id)
        hover = f"<title>{html.escape(row.instance_id)}</title>" if shown != row.instance_id else ""
        parts.append(
            f'<text class="label" x="{label_w - 6:.0f}" y="{y + 12}" text-anchor="end" font-family="monospace" '
            f'font-size="{_LABEL_PX}">{hover}{html.escape(shown)}</text>'
            f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{_COLOURS.get(row.outcome, "#555")}">'
            f'<title>{html.escape(row.instance_id)}: {html.escape(fmt(v))} ({row.outcome})</title></rect>'
            f'<text x="{label_w + w + 4:.1f}" y="{y + 12}" font-size="12">{html.escape(fmt(v))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def to_html(report: Report) -> str:
    """A self-contained HTML page: summary, plots of time / tokens / turns per instance, the table."""
    s, rows = report.summary, report.instances
    plots = [
        _bars("wall time per instance", rows, [r.wall_s for r in rows], lambda v: f"{v:,.1f} s"),
        _bars("tokens per instance (in + out)", rows,
              [_agent(r).prompt_tokens + _agent(r).completion_tokens for r in rows], lambda v: f"{round(v):,} tok"),
        _bars("turns per instance", rows, [_agent(r).turns for r in rows],
              lambda v: f"{round(v):,} turn{'' if round(v) == 1 else 's'}"),
    ]
    legend = " ".join(f'<span style="color:{c}">&#9632; {k}</span>' for k, c in _COLOURS.items())
    head = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _headline(s))
    table_head = "".join(f"<th>{html.escape(c)}</th>" for c in _COLUMNS)
    table_rows = "".join(
        f'<tr style="color:{_COLOURS.get(r.outcome, "#000")}">' + "".join(f"<td>{html.escape(c)}</td>" for c in _cells(r))
        + "</tr>" for r in rows)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>m3-agent eval: {s.resolved_instances}/{s.total_instances} resolved</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ddd;padding:3px 8px;text-align:left}} svg{{display:block;margin:1.5em 0}}
td:first-child{{overflow-wrap:anywhere;max-width:32em}}</style></head>
<body><h1>m3-agent eval: {s.resolve_rate:.1%} resolved</h1>
<table>{head}</table>
<p>{legend}</p>
{"".join(plots)}
<h2>Instances</h2><table><tr>{table_head}</tr>{table_rows}</table>
</body></html>
"""


def write_reports(report: Report, output_dir: Path) -> dict[str, Path]:
    """Write summary.json (SWE-bench's fields first), report.json, report.md and report.html."""
    paths = {"summary": output_dir / "summary.json", "json": output_dir / "report.json",
             "markdown": output_dir / "report.md", "html": output_dir / "report.html"}
    paths["summary"].write_text(report.summary.model_dump_json(indent=2) + "\n")
    paths["json"].write_text(to_json(report) + "\n")
    paths["markdown"].write_text(to_markdown(report))
    paths["html"].write_text(to_html(report))
    return paths
