"""`m3-agent pack`: write a repository's pack and print what went in, what did not, and why."""

from __future__ import annotations

import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Any

import typer

from m3_agent.agent.context.outline import DEFAULT_OUTLINE_MAX_TOKENS
from m3_agent.agent.context.pack import DEFAULT_OUTLINE_SHARE, Pack, pack_repository
from m3_agent.agent.context.estimate import estimate_tokens
from m3_agent.agent.context.selection import DEFAULT_MAX_FILE_BYTES
from m3_agent.agent.context.stability import StableOrder
from m3_agent.agent.context.tokens import (EstimateCounter, ServerCounter, TokenCounter, TokenizerJsonCounter,
                                           budget_for_server)
from m3_agent.errors import EndpointError, UsageError
from m3_agent.settings import load_settings, setting_flags


class Counter(str, Enum):
    """Which tokenizer counts: `auto` is the server when one answers, else a given tokenizer.json,
    else the estimate."""

    AUTO = "auto"
    SERVER = "server"
    TOKENIZER = "tokenizer"
    ESTIMATE = "estimate"


def read_issue(value: str | None) -> str | None:
    """`--issue`: a path to a file holding the issue, or the issue text itself."""
    if value is None:
        return None
    if value == "-":
        return sys.stdin.read()
    try:
        if len(value) < 4096 and os.path.isfile(value):
            return Path(value).read_text(encoding="utf-8", errors="replace")
    except (OSError, ValueError):  # ValueError: a NUL in the text
        pass
    return value


def choose_counter(choice: str, base_url: str | None, model: str | None, tokenizer: str | Path | None,
                   api_key: str | None, repo: str | Path = ".") -> TokenCounter:
    """The counter the flags ask for; `auto` falls back (with a warning) when the server does not answer;
    `estimate` with a server is calibrated against its /tokenize on a sample of `repo`."""
    if choice == "tokenizer" or (choice == "auto" and tokenizer and not base_url):
        if tokenizer is None:
            raise UsageError("--counter tokenizer needs --tokenizer PATH (a tokenizer.json)")
        return TokenizerJsonCounter(tokenizer)
    if choice == "server" and not base_url:
        raise UsageError("--counter server needs --base-url (or base_url in the configuration)")
    if not base_url:
        return EstimateCounter()
    try:
        server = ServerCounter(base_url, model, api_key=api_key)
    except EndpointError as e:
        if choice == "server":
            raise
        if choice == "estimate":
            _warn(f"no /tokenize at {base_url} to calibrate the estimate ({e})")
            return EstimateCounter()
        _warn(f"no /tokenize at {base_url} ({e}); counting with " + ("the tokenizer.json" if tokenizer else "the estimate"))
        return TokenizerJsonCounter(tokenizer) if tokenizer else EstimateCounter()
    # `estimate`: scaled to the server on a spread-out sample of the files a pack of `repo` holds (the packer's
    # own rules); no cache: `--no-cache` may be set.
    return estimate_tokens(repo, None, server).counter if choice == "estimate" else server


def summary_table(pack: Pack, elapsed: float, output: str) -> str:
    """The summary printed after packing: files packed and skipped by reason, tokens, time."""
    rows = [("packed", f"{pack.packed_count:,} files", f"{pack.packed_tokens():,} tokens")]
    if pack.outlined:
        rows.append(("outlined (left out)", f"{len(pack.outlined):,} files", f"{pack.outline_tokens:,} tokens"))
    rows += [(f"skipped: {reason}", f"{n:,} files", "") for reason, n in pack.skipped_by_reason().items()]
    budget = f" of {pack.budget:,} budget" if pack.budget is not None else ""
    rows.append(("pack text", f"{pack.total_files:,} in tree", f"{pack.tokens:,} tokens{budget}"))
    rows.append(("counter", pack.counter_kind, ""))
    rows.append(("time", f"{elapsed:.2f} s", ""))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join([f"m3-agent pack -> {output}", *(f"  {a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows)])


app = typer.Typer()  # m3_agent/cli.py takes the command in from here


@app.command("pack", help="Pack a repository into one prompt for the 1M window.")
@setting_flags("--base-url", "--model")
def pack_command(
    repo: str = typer.Option(".", "--repo", help="Repository (or any directory) to pack."),
    issue: str | None = typer.Option(
        None, help="Issue text, or a file holding it, or - for stdin: ranks files when the budget is short."),
    budget: int | None = typer.Option(
        None, help="Token budget of the pack; default: the server's max_model_len less reserves, else none."),
    output: str | None = typer.Option(None, "--output", "-o", help="Write the pack here (default: stdout)."),
    include: list[str] = typer.Option([], help="Only files matching this glob (gitignore syntax); repeatable."),
    exclude: list[str] = typer.Option([], help="Leave out files matching this glob; repeatable."),
    tokenizer: str | None = typer.Option(None, help="A local tokenizer.json for exact counts."),
    counter: Counter = typer.Option(
        Counter.AUTO, help="auto (the server when one answers, else a given tokenizer.json, else the estimate) | server | "
             "tokenizer | estimate."),
    max_file_bytes: int | None = typer.Option(
        None, help=f"Skip files larger than this (default {DEFAULT_MAX_FILE_BYTES:,})."),
    output_reserve: int = typer.Option(32_768, help="Tokens kept for the model's output (default budget)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Do not read or write the token-count cache."),
    outline_share: float | None = typer.Option(
        None, help=f"Share of the budget for outlines of the files left out (default {DEFAULT_OUTLINE_SHARE}; 0: none)."),
    *,
    flags: dict[str, Any],  # --base-url (the server for exact counts and the default budget) and --model
) -> None:
    """Pack a repository into one prompt: header, tree of all files, then files in a stable order.
    Exit codes: 0 done, 2 bad input, 3 endpoint error, 130 interrupted."""
    started = time.perf_counter()
    if not os.path.isdir(repo):
        raise UsageError(f"repository not found: {repo}")
    settings = _settings(repo, flags)
    base_url = settings.model.base_url if settings else flags["--base-url"]
    model = settings.model.name if settings else flags["--model"]
    api_key = settings.model.api_key.get_secret_value() if settings else None  # (the client drops "EMPTY")
    includes = list(include) + (settings.context.include if settings else [])
    excludes = list(exclude) + (settings.context.exclude if settings else [])
    if max_file_bytes is None:
        max_file_bytes = settings.context.max_file_bytes if settings else DEFAULT_MAX_FILE_BYTES
    if outline_share is None:
        outline_share = settings.context.outline_share if settings else DEFAULT_OUTLINE_SHARE
    tok = choose_counter(counter.value, base_url, model, tokenizer, api_key, repo)
    if tok.kind == "server" and (settings is None or settings.model.warn_plain_http):
        from m3_agent.agent.access import plain_http_warning

        if warning := plain_http_warning(base_url or ""):
            _warn(warning)  # every file goes to /tokenize there
    if budget is None and base_url:
        try:
            budget = budget_for_server(base_url, model=getattr(tok, "model", model), output_reserve=output_reserve,
                                       api_key=api_key)
        except EndpointError as e:
            _warn(f"no default budget: {e}")
    history, share = (settings.context.history, settings.eval.shared_share) if settings else (None, 0.0)
    pack = pack_repository(repo, issue=read_issue(issue), budget=budget, counter=tok, include=tuple(includes),
                           exclude=tuple(excludes), max_file_bytes=max_file_bytes, cache=not no_cache,
                           history=history, outline_share=outline_share,  # `[eval] shared_share`: an instance's
                           order=StableOrder(history or repo, None, shared_share=share) if share else None,
                           outline_max_tokens=(settings.context.outline_max_tokens if settings
                                               else DEFAULT_OUTLINE_MAX_TOKENS))
    where = _write(pack, output)
    print(summary_table(pack, time.perf_counter() - started, where), file=sys.stderr)
    if pack.counter_kind == "estimate":
        print(_estimated(base_url), file=sys.stderr)


def _estimated(base_url: str | None) -> str:
    """Why the counts are estimates: a server that did not count them, or none given."""
    why = (f"the server at {base_url} did not count them (see above): start it, or pass --tokenizer FILE"
           if base_url else "no server /tokenize or tokenizer.json given")
    return f"token counts are estimates ({why})"


def _warn(msg: str) -> None:
    print(f"m3-agent: warning: {msg}", file=sys.stderr)


def _write(pack: Pack, output: str | None) -> str:
    """Write the pack to `output` (stdout when None or -); where it went."""
    if output is None or output == "-":
        try:
            sys.stdout.flush()
            pack.write_to(sys.stdout.buffer)
            sys.stdout.buffer.flush()
        except BrokenPipeError:  # `m3-agent pack | head`: the reader left, nothing to report
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit)
            raise typer.Exit(0)
        return "stdout"
    try:
        pack.write(output)
    except OSError as e:
        raise UsageError(f"cannot write {output}: {e.strerror or e}") from e
    return str(output)


def _settings(repo: str, flags: dict[str, Any]):
    """The project's layered settings for `repo` under `flags`, read only when a config file or variable may
    set them."""
    pyproject = os.path.join(repo, "pyproject.toml")
    if not (
        os.path.isfile(os.path.join(repo, "m3-agent.toml"))
        or (os.path.isfile(pyproject) and b"m3-agent" in Path(pyproject).read_bytes())
        or any(k.startswith("M3_AGENT_") and k != "M3_AGENT_CACHE_DIR" for k in os.environ)
    ):
        return None  # nothing to set
    settings, _ = load_settings(Path(repo), flags)
    return settings
