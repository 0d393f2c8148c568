"""Fix several issues in one go and summarise the outcome.

Each issue runs on its own copy of the repository and ends on its own branch
(`m3-agent/issue-<key>`) with its own `.patch`; a failure on one issue (a missing GitHub issue, an
unreachable endpoint) is recorded and the batch goes on. The repository's packed prefix is the same
for every issue, so a server with prefix caching serves most of each first prompt from cache.

    python examples/batch_issues.py --repo path/to/repo --base-url http://gpu-node:8000/v1 12 15 bugs/perf.md

The last line printed is a JSON summary; the exit code is 0 only when every issue was resolved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rich.console import Console
from rich.table import Table

from m3_agent.api import M3AgentError, fix_issue, load_settings


def fix_all(issues: list[str], repo: str, overrides: dict) -> list[dict]:
    """Run `fix_issue` on each issue in turn; one summary row per issue."""
    settings, _ = load_settings(repo, overrides)
    rows = []
    for spec in issues:
        try:
            result = fix_issue(spec, repo=repo, settings=settings)
        except M3AgentError as e:
            rows.append({"issue": spec, "resolved": False, "exit_code": e.exit_code, "error": str(e)})
            continue
        run = result.run
        rows.append({
            "issue": spec, "resolved": result.resolved, "exit_code": result.exit_code, "status": run.status,
            "branch": result.branch, "patch_path": str(result.patch_path) if result.patch_path else None,
            "turns": run.turns, "prompt_tokens": run.usage.prompt_tokens,
            "cache_hit_share": run.cache_hit_share, "wall_s": round(run.timings.wall_s, 2),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    """Fix every issue given; print a table (stderr) and a JSON summary (stdout)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("issues", nargs="+", help="issue numbers, URLs, files or texts")
    parser.add_argument("--repo", default=".")
    parser.add_argument("--base-url", default=os.environ.get("M3_AGENT_MODEL__BASE_URL"))
    parser.add_argument("--max-turns", type=int, default=None)
    args = parser.parse_args(argv)

    rows = fix_all(args.issues, args.repo, {"--base-url": args.base_url, "--max-turns": args.max_turns})
    table = Table(title="m3-agent batch")
    for col in ("issue", "outcome", "branch", "turns", "cached"):
        table.add_column(col)
    for r in rows:
        outcome = "resolved" if r["resolved"] else r.get("error") or r.get("status", "")
        cached = f"{r['cache_hit_share']:.0%}" if "cache_hit_share" in r else "-"
        table.add_row(r["issue"][:40], outcome, r.get("branch") or "-", str(r.get("turns", "-")), cached)
    Console(stderr=True).print(table)
    resolved = sum(r["resolved"] for r in rows)
    print(json.dumps({"issues": rows, "resolved": resolved, "total": len(rows)}))
    return 0 if resolved == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
