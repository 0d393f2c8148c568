"""`m3-agent pack`: write a repository's pack and print what went in, what did not, and why."""

from __future__ import annotations

import gc
import os
import sys
import time

from m3_agent.agent.context import gitls
from m3_agent.agent.context.limits import DEFAULT_MAX_FILE_BYTES
from m3_agent.errors import EndpointError, M3AgentError, UsageError

TYPE_CHECKING = False  # (not `typing.TYPE_CHECKING`: this command does not load `typing`)
if TYPE_CHECKING:
    from pathlib import Path

    from m3_agent.agent.context.pack import Pack
    from m3_agent.agent.context.tokens import EstimateCounter, TokenCounter

# The packer's modules load after git has been started on the repository (`gitls.prefetch`): the
# command's functions import them where they are used.

COUNTERS = ("auto", "server", "tokenizer", "estimate")  # which tokenizer counts


def read_issue(value: str | None) -> str | None:
    """`--issue`: a path to a file holding the issue, or the issue text itself."""
    if value is None:
        return None
    if value == "-":
        return sys.stdin.read()
    try:
        if len(value) < 4096 and os.path.isfile(value):
            with open(value, encoding="utf-8", errors="replace") as f:
                return f.read()
    except (OSError, ValueError):  # ValueError: a NUL in the text
        pass
    return value


def choose_counter(choice: str, base_url: str | None, model: str | None, tokenizer: str | Path | None,
                   api_key: str | None, warn, repo: str | Path = ".") -> TokenCounter:
    """The counter the flags ask for; `auto` falls back (with a warning) when the server does not answer;
    `estimate` with a server is calibrated against its /tokenize on a sample of `repo`."""
    from m3_agent.agent.context.tokens import EstimateCounter, ServerCounter, TokenizerJsonCounter

    if choice == "tokenizer" or (choice == "auto" and tokenizer and not base_url):
        if tokenizer is None:
            raise UsageError("--counter tokenizer needs --tokenizer PATH (a tokenizer.json)")
        return TokenizerJsonCounter(tokenizer)
    if choice == "server" or (choice == "auto" and base_url):
        if not base_url:
            raise UsageError("--counter server needs --base-url (or base_url in the configuration)")
        try:
            return ServerCounter(base_url, model, api_key=api_key)
        except EndpointError as e:
            if choice == "server":
                raise
            warn(f"no /tokenize at {base_url} ({e}); counting with " + ("the tokenizer.json" if tokenizer else "the estimate"))
            return TokenizerJsonCounter(tokenizer) if tokenizer else EstimateCounter()
    if choice == "estimate" and base_url:
        try:
            server = ServerCounter(base_url, model, api_key=api_key)
        except EndpointError as e:
            warn(f"no /tokenize at {base_url} to calibrate the estimate ({e})")
            return EstimateCounter()
        return calibrated_estimate(repo, server)
    return EstimateCounter()


def calibrated_estimate(repo: str | Path, exact: TokenCounter, samples: int = 32) -> EstimateCounter:
    """The estimate scaled to `exact` on a spread-out sample of the repository's text files."""
    from m3_agent.agent.context.reader import read_bytes
    from m3_agent.agent.context.selection import apply_path_rules, decode, list_files
    from m3_agent.agent.context.tokens import EstimateCounter

    listing = list_files(os.path.abspath(repo))
    apply_path_rules(listing, None, None)
    paths = sorted(e.path for e in listing.entries if e.reason is None and e.kind == "file")
    texts = []
    for path in paths[:: max(1, len(paths) // samples)]:
        try:
            data, _ = read_bytes(os.path.join(listing.root, path), 256 * 1024)
        except OSError:
            continue
        content = decode(data)[0] if data is not None else None
        if content:
            texts.append(content.decode("utf-8", "replace"))
    return EstimateCounter().calibrated(exact, texts[:samples])


def summary_table(pack: Pack, elapsed: float, output: str) -> str:
    """The summary printed after packing: files packed and skipped by reason, tokens, time."""
    rows = [("packed", f"{pack.packed_count:,} files", f"{pack.packed_tokens():,} tokens")]
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


def build_parser():
    """The options of `m3-agent pack` (argparse: the command starts without loading the other commands)."""
    import argparse

    class HelpFormatter(argparse.HelpFormatter):
        """argparse's formatter, told the terminal's width: left to find it, it loads `shutil` (and
        the compression modules `shutil` loads)."""

        def __init__(self, prog: str) -> None:
            try:
                width = int(os.environ.get("COLUMNS", "")) or os.get_terminal_size(sys.stderr.fileno()).columns
            except (ValueError, OSError):
                width = 80
            super().__init__(prog, width=max(40, width - 2))

    p = argparse.ArgumentParser(
        prog="m3-agent pack", formatter_class=HelpFormatter, allow_abbrev=False,
        description="Pack a repository into one prompt: header, tree of all files, then files in a stable order. "
                    "Exit codes: 0 done, 2 bad input, 3 endpoint error, 130 interrupted.")
    p.add_argument("--repo", default=".", help="repository (or any directory) to pack")
    p.add_argument("--issue", help="issue text, or a file holding it, or - for stdin: ranks files when the budget is short")
    p.add_argument("--budget", type=int, help="token budget of the pack; default: the server's max_model_len less reserves, else none")
    p.add_argument("-o", "--output", help="write the pack here (default: stdout)")
    p.add_argument("--include", action="append", default=[], help="only files matching this glob (gitignore syntax); repeatable")
    p.add_argument("--exclude", action="append", default=[], help="leave out files matching this glob; repeatable")
    p.add_argument("--base-url", help="model server (vLLM) for exact counts and the default budget")
    p.add_argument("--model", help="served model name (default: the first listed)")
    p.add_argument("--tokenizer", help="a local tokenizer.json for exact counts")
    p.add_argument("--counter", choices=COUNTERS, default="auto",
                   help="auto (the server when one answers, else a given tokenizer.json, else the estimate) | server | tokenizer | estimate")
    p.add_argument("--max-file-bytes", type=int, help=f"skip files larger than this (default {DEFAULT_MAX_FILE_BYTES:,})")
    p.add_argument("--output-reserve", type=int, default=32_768, help="tokens kept for the model's output (default budget)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the token-count cache")
    return p


class _Args:
    """Parsed options, as argparse's Namespace holds them."""

    def __init__(self, **values) -> None:
        self.__dict__.update(values)


_DEFAULTS = {"repo": ".", "issue": None, "budget": None, "output": None, "include": [], "exclude": [], "base_url": None,
             "model": None, "tokenizer": None, "counter": "auto", "max_file_bytes": None, "output_reserve": 32_768,
             "no_cache": False}
_VALUED = {"--repo": "repo", "--issue": "issue", "--budget": "budget", "-o": "output", "--output": "output",
           "--include": "include", "--exclude": "exclude", "--base-url": "base_url", "--model": "model",
           "--tokenizer": "tokenizer", "--counter": "counter", "--max-file-bytes": "max_file_bytes",
           "--output-reserve": "output_reserve"}
_INTS = frozenset({"budget", "max_file_bytes", "output_reserve"})
_LISTS = frozenset({"include", "exclude"})


def parse_args(argv: list[str]):
    """What `build_parser().parse_args(argv)` gives, for the plain spellings of the options, without
    loading argparse (nor `re`, which argparse loads): anything else (help, an error, an unusual
    spelling) is left to argparse, which prints usage and exits 2 where it should."""
    values = {k: list(v) if isinstance(v, list) else v for k, v in _DEFAULTS.items()}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--no-cache":
            values["no_cache"] = True
            i += 1
            continue
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
            i += 1
        else:
            name, value = arg, argv[i + 1] if i + 1 < len(argv) else None
            i += 2
            if value is not None and value.startswith("-") and value != "-":
                value = None  # an option where a value should be, or a negative number: argparse decides
        dest = _VALUED.get(name)
        if dest is None or value is None or (dest == "counter" and value not in COUNTERS):
            return build_parser().parse_args(argv)
        if dest in _INTS:
            try:
                value = int(value)
            except ValueError:
                return build_parser().parse_args(argv)
        if dest in _LISTS:
            values[dest].append(value)
        else:
            values[dest] = value
    return _Args(**values)


def pack_command(args) -> None:
    """Pack a repository into one prompt: header, tree of all files, then files in a stable order."""
    started = time.perf_counter()
    from m3_agent.agent.context.pack import pack_repository
    from m3_agent.agent.context.tokens import budget_for_server

    repo = args.repo
    if not os.path.isdir(repo):
        raise UsageError(f"repository not found: {repo}")
    settings = _settings(repo)
    base_url = args.base_url or (settings.model.base_url if settings else None)
    model = args.model or (settings.model.name if settings else None)
    api_key = _api_key(settings)
    includes = list(args.include) + (settings.context.include if settings else [])
    excludes = list(args.exclude) + (settings.context.exclude if settings else [])
    max_file_bytes = args.max_file_bytes
    if max_file_bytes is None:
        max_file_bytes = settings.context.max_file_bytes if settings else DEFAULT_MAX_FILE_BYTES

    def warn(msg: str) -> None:
        print(f"m3-agent: warning: {msg}", file=sys.stderr)

    tok = choose_counter(args.counter, base_url, model, args.tokenizer, api_key, warn, repo)
    budget = args.budget
    if budget is None and base_url:
        try:
            budget = budget_for_server(base_url, model=getattr(tok, "model", model), output_reserve=args.output_reserve,
                                       api_key=api_key)
        except EndpointError as e:
            warn(f"no default budget: {e}")
    pack = pack_repository(repo, issue=read_issue(args.issue), budget=budget, counter=tok, include=tuple(includes),
                           exclude=tuple(excludes), max_file_bytes=max_file_bytes, cache=not args.no_cache)
    output = args.output
    if output is None or output == "-":
        sys.stdout.flush()
        pack.write_to(sys.stdout.buffer)
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


def main(argv: list[str] | None = None, *, own_process: bool = False) -> None:
    """`m3-agent pack ...`: one-line errors and the documented exit codes. With `own_process` (the
    command is the whole process), a finished pack ends the process at once: the output is written
    and flushed, and tearing down thousands of objects would only delay the exit."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)  # bad flags: usage on stderr, exit 2
    except SystemExit:
        gitls.stop_unused()  # started by `m3-agent`'s own entry point for the --repo it saw
        raise
    gitls.prefetch(str(args.repo))  # git lists the tree while the packer loads (if not already)
    collecting = gc.isenabled()
    gc.disable()  # thousands of small objects and no cycles worth collecting while packing
    try:
        pack_command(args)
        if own_process:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except KeyboardInterrupt:
        print("m3-agent: interrupted", file=sys.stderr)
        sys.exit(130)
    except M3AgentError as e:
        print(f"m3-agent: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except BrokenPipeError:  # `m3-agent pack | head`: the reader left, nothing to report
        sys.exit(0)
    finally:
        gitls.stop_unused()
        if collecting:
            gc.enable()


def _settings(repo: str):
    """The project's layered settings for `repo`, read only when a config file or variable may set them."""
    pyproject = os.path.join(repo, "pyproject.toml")
    if not (
        os.path.isfile(os.path.join(repo, "m3-agent.toml"))
        or (os.path.isfile(pyproject) and b"m3-agent" in _read(pyproject))
        or any(k.startswith("M3_AGENT_") and k != "M3_AGENT_CACHE_DIR" for k in os.environ)
    ):
        return None  # nothing to read: skip loading the settings machinery
    try:
        from m3_agent.settings import load_settings
    except ImportError:  # configuration is optional for packing
        return None
    from pathlib import Path

    settings, _ = load_settings(Path(repo))
    return settings


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _api_key(settings) -> str | None:
    if settings is None:
        return None
    value = settings.model.api_key.get_secret_value()
    return None if value in ("", "EMPTY") else value
