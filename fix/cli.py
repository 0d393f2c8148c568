"""`m3-agent fix`: the command over the library flow (`fix.flow.fix_issue`) and its display (`fix.progress`).

    m3-agent fix 123 --base-url http://gpu-node:8000/v1        # issue #123 of the `origin` remote
    m3-agent fix https://github.com/acme/widgets/issues/123     # an issue URL (github.com or Enterprise)
    m3-agent fix --issue bug.md --repo ../widgets               # a file, or plain text
    m3-agent fix 123 --pr --comment                             # push, open a draft pull request, comment
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from m3_agent.errors import M3AgentError, UsageError
from m3_agent.fix import gitwork
from m3_agent.fix.flow import FixOptions, fix_issue
from m3_agent.fix.result import FixResult
from m3_agent.fix.progress import LiveProgress, short, summary
from m3_agent.settings import load_settings, setting_flags


# The command's own app; m3_agent/cli.py takes its one command, `fix`, into `m3-agent`.
app = typer.Typer()


@dataclass(frozen=True)
class Display:
    """How the command shows its work: progress and notices on `err`, or only the summary, or one JSON object."""

    err: Console
    quiet: bool = False
    json_out: bool = False


@app.command("fix", help="Fix an issue in a repository; hands back a branch and a patch.")
@setting_flags("--base-url", "--api-key", "--serve", "--model", "--max-turns", "--test-cmd", "--time-limit",
               "--thinking", "--images", "--include-uncommitted", "--sandbox-image", "--keep-broken-env",
               "--github-api-url",
               "--output-dir", "--push", "--remote", "--pr", "--ready", "--pr-anyway", "--comment", "--trajectory-url")
def fix_command(
    issue_arg: Optional[str] = typer.Argument(
        None, metavar="ISSUE", help="Issue number (origin's GitHub repo), owner/repo#N, issue URL, file, or text."
    ),
    issue: Optional[str] = typer.Option(None, "--issue", "-i", help="The issue, as ISSUE (instead of the argument)."),
    repo: Path = typer.Option(Path("."), "--repo", "-C", help="The repository to fix."),
    apply: bool = typer.Option(False, "--apply", help="Also apply the patch to the working tree (must be clean)."),
    base: Optional[str] = typer.Option(None, help="Start from this commit instead of HEAD (e.g. on a detached HEAD)."),
    config: Optional[Path] = typer.Option(None, "--config", help="Config file instead of m3-agent.toml / pyproject."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress, no diff: only the summary."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (FixResult) on stdout, nothing else."),
    *,
    flags: dict[str, Any],
) -> None:
    """Fix an issue; exit 0 when resolved (tests ran on the final patch and pass), 1 when not, 6 when no
    test ran on the final patch and no test command is known (see docs/usage.md). `flags`: the setting
    flags given (`setting_flags`)."""
    display = Display(Console(stderr=True, highlight=False), quiet=quiet, json_out=json_out)
    try:
        if issue_arg and issue:
            raise UsageError("give the issue once: as the argument or with --issue")
        result = _fix_from_flags(issue_arg or issue, repo, flags, config, FixOptions(base=base, apply=apply), display)
    except M3AgentError as e:
        if json_out:
            typer.echo(json.dumps({"resolved": False, "exit_code": e.exit_code, "error": str(e)}))
        raise
    _show(display, result)
    raise typer.Exit(result.exit_code)


def _show(display: Display, result: FixResult) -> None:
    """The result: one JSON object on stdout, or the diff (unless quiet) and the summary."""
    if display.json_out:
        typer.echo(result.model_dump_json(exclude={"run": {"patch"}}))
        return
    if not display.quiet and result.patch.strip():
        typer.echo(result.patch, nl=not result.patch.endswith("\n"))
    display.err.print(summary(result), soft_wrap=True)


def _fix_from_flags(spec: str | None, repo: Path, flags: dict[str, Any], config: Path | None, options: FixOptions,
                    display: Display) -> FixResult:
    """The command's work once its flags are parsed: settings, notices, progress display, `fix_issue`."""
    if not spec:
        raise UsageError("which issue? pass a number, an issue URL, a file or text (m3-agent fix --help)")
    root = gitwork.open_repo(repo).root
    settings, _ = load_settings(root, flags, config_file=config)

    def on_notice(text: str) -> None:
        if not display.json_out:
            display.err.print(f"m3-agent: {text}", markup=False, soft_wrap=True)

    if display.quiet or display.json_out:
        return fix_issue(spec, repo=root, settings=settings, options=options, on_notice=on_notice)
    with LiveProgress(display.err, max_turns=settings.limits.max_turns, label=short(spec, 50)) as progress:
        return fix_issue(spec, repo=root, settings=settings, options=options, callbacks=[progress],
                         on_notice=on_notice)
