"""`m3-agent pack`: write a repository's pack and print what went in, what did not, and why."""

from __future__ import annotations

import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from agent.context.pack import Pack, pack_repository
from agent.context.selection import DEFAULT_MAX_FILE_BYTES
from agent.context.tokens import (
    EstimateCounter,
    ServerCounter,
    TokenCounter,
    TokenizerJsonCounter,
    budget_for_server,
)
from agent.errors import EndpointError, UsageError


class CounterChoice(str, Enum):
    """Which tokenizer counts: `auto` = the server when one answers, else a given tokenizer.json, else the estimate."""

    auto = "auto"
    server = "server"
    tokenizer = "tokenizer"
    estimate = "estimate"


def read_issue(value: str | None) -> str | None:
    """`--issue`: a path to a file holding the issue, or the issue text itself."""
    if value is None:
        return None
    if value == "-":
        return sys.stdin.read()
    path = Path(value)
    try:
        if len(value) < 4096 and path.is_file():
            return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        pass
    return value


def choose_counter(choice: CounterChoice, base_url: str | None, model: str | None, tokenizer: Path | None,
                   api_key: str | None, warn, repo: Path = Path(".")) -> TokenCounter:
    """The counter the flags ask for; `auto` falls back (with a warning) when the server does not answer;
    `estimate` with a server is calibrated against its /tokenize on a sample of `repo`."""
    if choice == CounterChoice.tokenizer or (choice == CounterChoice.auto and tokenizer and not base_url):
        if tokenizer is None:
            raise UsageError("--counter tokenizer needs --tokenizer PATH (a tokenizer.json)")
        return TokenizerJsonCounter(tokenizer)
    if choice == CounterChoice.server or (choice == CounterChoice.auto and base_url):
        if not base_url:
            raise UsageError("--counter server needs --base-url (or base_url in the configuration)")
        try:
            return ServerCounter(base_url, model, api_key=api_key)
        except EndpointError as e:
            if choice == CounterChoice.server:
                raise
            warn(f"no /tokenize at {base_url} ({e}); counting with " + ("the tokenizer.json" if tokenizer else "the estimate"))
            return TokenizerJsonCounter(tokenizer) if tokenizer else EstimateCounter()
    if choice == CounterChoice.estimate and base_url:
        try:
            server = ServerCounter(base_url, model, api_key=api_key)
        except EndpointError as e:
            warn(f"no /tokenize at {base_url} to calibrate the estimate ({e})")
            return EstimateCounter()
        return calibrated_estimate(repo, server)
    return EstimateCounter()


def calibrated_estimate(repo: Path, exact: TokenCounter, samples: int = 32) -> EstimateCounter:
    """The estimate scaled to `exact` on a spread-out sample of the repository's text files."""
    from agent.context.selection import apply_path_rules, decode, list_files, read_bytes

    listing = list_files(repo.absolute())
    apply_path_rules(listing, None, None)
    paths = sorted(e.path for e in listing.entries if e.reason is None and e.kind == "file")
    texts = []
    for path in paths[:: max(1, len(paths) // samples)]:
        try:
            data, _ = read_bytes(str(listing.root / path), 256 * 1024)
        except OSError:
            continue
        content = decode(data)[0] if data is not None else None
        if content:
            texts.append(content.decode("utf-8", "replace"))
    return EstimateCounter().calibrated(exact, texts[:samples])


def summary_table(pack: Pack, elapsed: float, output: str) -> str:
    """The summary printed after packing: files packed and skipped by reason, tokens, time."""
    rows = [("packed", f"{len(pack.files):,} files", f"{sum(f.tokens for f in pack.files):,} tokens")]
    rows += [(f"skipped: {reason}", f"{n:,} files", "") for reason, n in pack.skipped_by_reason().items()]
    budget = f" of {pack.budget:,} budget" if pack.budget is not None else ""
    rows.append(("pack text", f"{pack.total_files:,} in tree", f"{pack.tokens:,} tokens{budget}"))
    rows.append(("counter", pack.counter_kind, ""))
    rows.append(("time", f"{elapsed:.2f} s", ""))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"m3-agent pack -> {output}"]
    lines += [f"  {a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)


def pack_command(
    repo: Annotated[Path, typer.Option("--repo", help="repository (or any directory) to pack")] = Path("."),
    issue: Annotated[Optional[str], typer.Option("--issue", help="issue text, or a file holding it, or - for stdin: ranks files when the budget is short")] = None,
    budget: Annotated[Optional[int], typer.Option("--budget", help="token budget of the pack; default: the server's max_model_len less reserves, else none")] = None,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="write the pack here (default: stdout)")] = None,
    include: Annotated[Optional[list[str]], typer.Option("--include", help="only files matching this glob (gitignore syntax); repeatable")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option("--exclude", help="leave out files matching this glob; repeatable")] = None,
    base_url: Annotated[Optional[str], typer.Option("--base-url", help="model server (vLLM) for exact counts and the default budget")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="served model name (default: the first listed)")] = None,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="a local tokenizer.json for exact counts")] = None,
    counter: Annotated[CounterChoice, typer.Option("--counter", help="auto | server | tokenizer | estimate")] = CounterChoice.auto,
    max_file_bytes: Annotated[Optional[int], typer.Option("--max-file-bytes", help=f"skip files larger than this (default {DEFAULT_MAX_FILE_BYTES:,})")] = None,
    output_reserve: Annotated[int, typer.Option("--output-reserve", help="tokens kept for the model's output (default budget)")] = 32_768,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="do not read or write the token-count cache")] = False,
) -> None:
    """Pack a repository into one prompt: header, tree of all files, then files in a stable order."""
    started = time.perf_counter()
    if not repo.is_dir():
        raise UsageError(f"repository not found: {repo}")
    settings = _settings(repo)
    base_url = base_url or getattr(settings, "base_url", None)
    model = model or getattr(settings, "model", None)
    api_key = _api_key(settings)
    includes = list(include or []) + list(getattr(settings, "pack_include", None) or [])
    excludes = list(exclude or []) + list(getattr(settings, "pack_exclude", None) or [])
    if max_file_bytes is None:
        max_file_bytes = getattr(settings, "pack_max_file_bytes", None) or DEFAULT_MAX_FILE_BYTES

    def warn(msg: str) -> None:
        print(f"m3-agent: warning: {msg}", file=sys.stderr)

    tok = choose_counter(counter, base_url, model, tokenizer, api_key, warn, repo)
    if budget is None and base_url:
        try:
            budget = budget_for_server(base_url, model=getattr(tok, "model", model), output_reserve=output_reserve,
                                       api_key=api_key)
        except EndpointError as e:
            warn(f"no default budget: {e}")
    pack = pack_repository(repo, issue=read_issue(issue), budget=budget, counter=tok, include=tuple(includes),
                           exclude=tuple(excludes), max_file_bytes=max_file_bytes, cache=not no_cache)
    if output is None or str(output) == "-":
        sys.stdout.flush()
        sys.stdout.buffer.write(pack.data)
        sys.stdout.buffer.flush()
        where = "stdout"
    else:
        try:
            pack.write(output)
        except OSError as e:
            raise UsageError(f"cannot write {output}: {e.strerror or e}") from e
        where = str(output)
    print(summary_table(pack, time.perf_counter() - started, where), file=sys.stderr)
    if pack.counter_kind == "estimate":
        print("token counts are estimates (no server /tokenize or tokenizer.json given)", file=sys.stderr)


def _settings(repo: Path):
    """The project's layered settings for `repo`, read only when a config file or variable may set them."""
    pyproject = repo / "pyproject.toml"
    if not (
        (repo / "m3-agent.toml").is_file()
        or (pyproject.is_file() and b"m3-agent" in pyproject.read_bytes())
        or any(k.startswith("M3_AGENT_") and k != "M3_AGENT_CACHE_DIR" for k in os.environ)
    ):
        return None  # nothing to read: skip loading the settings machinery
    try:
        from agent.config import load_settings
    except ImportError:  # configuration is optional for packing
        return None
    settings, _ = load_settings(repo)
    return settings


def _api_key(settings) -> str | None:
    key = getattr(settings, "api_key", None)
    if key is None:
        return None
    value = key.get_secret_value() if hasattr(key, "get_secret_value") else str(key)
    return None if value in ("", "EMPTY") else value
