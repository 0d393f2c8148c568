"""Reports: SWE-bench's counts and id lists, run metrics, cost models, and the four renderings."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from m3_agent.evals.grading import InstanceReport
from m3_agent.evals.instance import AgentStats, InstanceResult
from m3_agent.evals.report import (CostModel, build_report, middle_cut, print_table, report_from_dir, to_html, to_json,
                                  to_markdown, write_reports)
from m3_agent.evals.results import save_result
from m3_agent.evals.tasks import Task


def _result(iid: str, *, patch: str | None = "diff", resolved=False, applied=True, report_error=None, error=None,
            agent: AgentStats | None = None, wall=10.0) -> InstanceResult:
    report = InstanceReport(patch_is_None=patch is None, patch_exists=bool(patch), patch_successfully_applied=applied,
                            resolved=resolved, error=report_error, timings={"total_s": 2.0})
    return InstanceResult(instance_id=iid, model_name_or_path="m", model_patch=patch, report=report, agent=agent,
                          error=error, wall_s=wall)


AGENT = AgentStats(status="submitted", turns=6, prompt_tokens=1000, completion_tokens=200, cached_tokens=600,
                   reasoning_tokens=50, requests=6, cache_hit_share=0.6, mode_counts={"enabled": 1, "disabled": 5},
                   stalls=1, sandbox_restarts=2, wall_s=36.0)


@pytest.fixture
def results():
    return [
        _result("a-1", resolved=True, agent=AGENT),
        _result("b-1", agent=AGENT.model_copy(update={"mode_counts": {"enabled": 2}, "stalls": 0})),
        _result("c-1", patch="", applied=False),
        _result("d-1", applied=False, report_error="patch does not apply"),
        _result("e-1", patch=None, applied=False, error="instance timed out after 60s"),
    ]


def _tasks(*ids):
    return [Task(instance_id=i, repo="o/r", base_commit="x") for i in ids]


def test_summary_has_swebench_counts_and_id_lists(results):
    s = build_report(results, tasks=_tasks("a-1", "b-1", "c-1", "d-1", "e-1", "f-1")).summary
    assert (s.total_instances, s.submitted_instances, s.completed_instances) == (6, 4, 3)
    assert (s.resolved_instances, s.unresolved_instances, s.empty_patch_instances, s.error_instances) == (1, 2, 2, 2)
    assert s.resolved_ids == ["a-1"]
    assert s.unresolved_ids == ["b-1", "c-1"]
    assert s.empty_patch_ids == ["c-1", "e-1"]
    assert s.error_ids == ["d-1", "e-1"]
    assert s.patch_apply_failed_ids == ["d-1"]
    assert s.incomplete_ids == ["f-1"]
    assert s.resolve_rate == pytest.approx(1 / 6, abs=1e-4)


def test_run_metrics_add_up_over_instances(results):
    s = build_report(results).summary
    assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens, s.reasoning_tokens) == (2000, 400, 1200, 100)
    assert s.cache_hit_share == 0.6
    assert s.mode_counts == {"enabled": 3, "disabled": 5}
    assert (s.turns, s.stalls, s.sandbox_restarts) == (12, 1, 4)
    assert "- **sandbox restarts**: 4" in to_markdown(build_report(results))
    assert s.wall_s == 50.0  # no run wall time given: the sum over instances


def test_cost_per_token_counts_cached_tokens_at_their_own_price(results):
    cost = CostModel(usd_per_m_input=1.0, usd_per_m_cached=0.1, usd_per_m_output=2.0)
    report = build_report(results, cost=cost)
    per = (400 * 1.0 + 600 * 0.1 + 200 * 2.0) / 1e6
    assert report.instances[0].cost_usd == pytest.approx(per)
    assert report.summary.cost_usd == pytest.approx(2 * per)
    assert report.summary.cost_per_resolved_usd == pytest.approx(2 * per)
    assert report.instances[2].cost_usd is None  # no agent run, nothing to price


def test_cost_self_hosted_is_gpu_dollars_per_hour_times_time(results):
    report = build_report(results, cost=CostModel(gpu_usd_per_hour=3.64), run_wall_s=1800.0)
    assert report.instances[0].cost_usd == pytest.approx(3.64 * 36 / 3600)
    assert report.summary.run_cost_usd == pytest.approx(3.64 / 2)
    assert report.summary.wall_s == 1800.0


def test_renderings_carry_every_instance(results):
    report = build_report(results, cost=CostModel(gpu_usd_per_hour=2.0))
    md = to_markdown(report)
    assert md.startswith("# m3-agent eval report")
    assert sum(line.startswith("| ") for line in md.splitlines()) == 1 + len(results)
    assert "- `e-1`: instance timed out after 60s" in md
    page = to_html(report)
    assert page.count("<svg") == 3 and page.count("<rect") == 3 * len(results)
    for r in results:
        assert r.instance_id in page
    data = json.loads(to_json(report))
    assert data["summary"]["resolved_ids"] == ["a-1"] and len(data["instances"]) == len(results)


def test_html_escapes_what_it_shows():
    page = to_html(build_report([_result("<script>x</script>", resolved=True)]))
    assert "<script>x" not in page and "&lt;script&gt;x" in page


def test_report_from_a_results_folder_uses_its_run_metadata(tmp_path, results):
    for r in results:
        save_result(tmp_path, r)
    (tmp_path / "run.json").write_text(json.dumps({"wall_s": 120.0, "cost": {"gpu_usd_per_hour": 3.0}}))
    report = report_from_dir(tmp_path)
    assert report.summary.run_cost_usd == pytest.approx(0.1)
    assert report.summary.total_instances == len(results)
    paths = write_reports(report, tmp_path)
    summary = json.loads(paths["summary"].read_text())
    assert list(summary)[:7] == ["total_instances", "submitted_instances", "completed_instances", "resolved_instances",
                                 "unresolved_instances", "empty_patch_instances", "error_instances"]


def _stats_from_json(**counts) -> AgentStats:
    """Agent stats as results.jsonl may carry them: counts written as floats by another tool."""
    return AgentStats.model_validate({"status": "submitted", **{k: float(v) for k, v in counts.items()}})


def test_counts_print_as_integers_in_every_rendering():
    results = [_result("more-itertools__more-itertools-0e6acdf", resolved=True,
                       agent=_stats_from_json(turns=2, prompt_tokens=640_000, completion_tokens=6_862)),
               _result("a-1", agent=_stats_from_json(turns=1, prompt_tokens=900, completion_tokens=12))]
    report = build_report(results)
    page = to_html(report)
    assert "646,862 tok" in page and "912 tok" in page
    assert ">2 turns<" in page and ">1 turn<" in page
    assert ".0 tok" not in page and ".0 turn" not in page
    md = to_markdown(report)
    assert "| more-itertools__more-itertools-0e6acdf | resolved | submitted | 2 | 640,000 | 6,862 |" in md
    console = Console(width=200, record=True, file=io.StringIO())
    print_table(report, console)
    table = console.export_text()
    assert re.search(r"more-itertools-0e6acdf │ resolved +│ submitted │ +2 │ 640,000 │ +6,862 │", table), table
    assert "640,900 / 6,874 / 0" in table and "3 / 0" in table  # the summary's tokens and turns / stalls
    data = json.loads(to_json(report))
    counts = [data["summary"][k] for k in ("prompt_tokens", "completion_tokens", "turns", "resolved_instances")]
    counts += [data["instances"][0]["agent"][k] for k in ("prompt_tokens", "completion_tokens", "turns")]
    assert all(type(v) is int for v in counts), counts


def test_plot_labels_are_whole_or_cut_in_the_middle_with_the_full_id_on_hover():
    short = "more-itertools__more-itertools-0e6acdf"
    long = "instance_ansible__ansible-f327e65d11bb905ed9f15996024f857a95592629-vba6da65a0f3baefda7a058"
    page = to_html(build_report([_result(short, resolved=True, agent=AGENT), _result(long, agent=AGENT)]))
    assert page.count(f'font-size="12">{short}</text>') == 3  # whole, in each of the three plots
    cut = middle_cut(long)
    assert len(cut) == 48 and cut == "instance_ansible__ansib\u2026-vba6da65a0f3baefda7a058"
    assert page.count(f"<title>{long}</title>{cut}</text>") == 3
    assert middle_cut(short) == short


def test_a_grade_without_an_agent_shows_no_agent_columns_or_lines():
    graded = build_report([_result("a-1", resolved=True), _result("b-1")])
    out = io.StringIO()
    print_table(graded, Console(file=out, width=200))
    header = next(line for line in out.getvalue().splitlines() if "instance" in line and "outcome" in line)
    assert "grade s" in header and not any(col in header for col in ("tok in", "turns", "modes", "agent s", "cached"))
    assert "tokens in / out / cached" not in out.getvalue() and "turns / stalls" not in out.getvalue()
    assert "resolved" in out.getvalue() and "1/2 (50.0%)" in out.getvalue()
    md = to_markdown(graded)
    assert "| instance | outcome | grade s |" in md and "tok in" not in md
    ran = io.StringIO()
    print_table(build_report([_result("a-1", resolved=True, agent=AGENT)]), Console(file=ran, width=200))
    assert "tok in" in ran.getvalue() and "turns / stalls" in ran.getvalue()  # a run keeps them
