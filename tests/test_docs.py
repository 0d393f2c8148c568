"""Every command block of the documentation runs as written, and shows what it really prints.

The blocks: fenced `sh`, `bash`, `shell` and `console` blocks, and indented blocks that start with a
command, in README.md, docs/*.md and examples/*/README.md. Each document runs in a scenario of its
own, as a user would meet it:

- the working directory is a git repository like the README's `widgets` (calc.py whose add()
  subtracts, its test, an `issue.md`); its `origin` reads issues from a local GitHub REST fake that
  holds acme/widgets#123, and pushes to a local bare repository; `examples/`, `benchmarks/` and
  `tests/evals/` of this checkout are linked into it; `bash run.sh ...` runs at the checkout's root;
- an M3 endpoint a block's `--base-url` names (`gpu-node:8000`, `127.0.0.1:8000`, `GPU-HOST:8000`) is
  a stand-in on a free loopback port (`--port 8000` becomes that port too), scripted to fix add(); a block that
  starts its own `m3-agent standin` gets that one instead, kept up for the block's later commands;
- every command must exit 0, and a `console` block's shown output must match what the command prints
  (stdout and stderr as a terminal shows them): line by line, with numbers, hexadecimal ids and `...`
  (a line of its own: any lines) as wildcards, `/home/me/widgets` as the repository's path,
  `https://github.com` as the fake's address, and whitespace and table rules compared loosely.

A block, or the rest of a block, that cannot run here (a GPU node, GitHub itself, a cluster, the
network) starts with a visible comment `# not run by the docs test: REASON`. The run's summary lists
every such block with its reason (tests/conftest.py prints it), so nothing is dropped silently.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from m3_agent.standin.server import StandinServer
from tests.conftest import make_git_repo
from tests.fix.test_fix import CALC, READ, TEST, edit
from tests.fix.test_github import FakeGitHub
from tests.fix.test_gitwork import bare_origin

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[1]
MARK = "# not run by the docs test:"
SHELL_LANGS = {"sh", "bash", "shell", "console"}
COMMAND_START = re.compile(rf"^(\$ |m3-agent |python |bash |git |pip |\.venv/|{MARK})")
ENDPOINT = re.compile(r"(--base-url http://)(?:gpu-node|GPU-HOST|127\.0\.0\.1):8000\b")
PORT_FLAG = re.compile(r"--port 8000\b")
HOME_PATH = "/home/me/widgets"
SHOWN_ISSUE = ("acme", "widgets", 123, "add() subtracts", "2 + 3 gives -1; it should be 5.")
SUMMARY = "add() returned a - b; it returns a + b now."
FIXING = [READ, edit("return a + b"), TEST, {"tool_calls": [{"name": "submit", "arguments": {"summary": SUMMARY}}]}]


@dataclass
class Command:
    """One command of a block: its text as a shell reads it, the output the document shows."""

    line: int
    text: str
    shown: list[str] | None = None
    skip: str | None = None


@dataclass
class Block:
    """One command block of a document."""

    doc: str
    line: int
    lang: str
    commands: list[Command] = field(default_factory=list)

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def documents() -> list[Path]:
    """The documents whose commands a user copies."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]


def raw_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line, language, lines) of each fenced command block and each indented block that starts
    with a command."""
    lines, found, i = text.split("\n"), [], 0
    while i < len(lines):
        fence = re.match(r"^(`{3,}|~{3,})\s*(\S*)", lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1)), len(lines))
            if fence.group(2) in SHELL_LANGS:
                found.append((i + 2, fence.group(2), lines[i + 1:end]))
            i = end + 1
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()) and COMMAND_START.match(lines[i][4:]):
            end = next((j for j in range(i, len(lines)) if not lines[j].startswith("    ")), len(lines))
            found.append((i + 1, "indented", [line[4:] for line in lines[i:end]]))
            i = end
        else:
            i += 1
    return found


def logical_lines(lines: list[str], first: int) -> list[tuple[int, str]]:
    """Lines joined over backslash continuations and here-documents, with their first line number."""
    out, i = [], 0
    while i < len(lines):
        start, text = i, lines[i]
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + lines[i].strip()
        heredoc = re.search(r"<<-?'?(\w+)'?", text)
        if heredoc and not text.lstrip().startswith("#"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == heredoc.group(1)), len(lines) - 1)
            text = "\n".join([text, *lines[i + 1:end + 1]])
            i = end
        out.append((first + start, text))
        i += 1
    return out


def parse_block(doc: str, first: int, lang: str, lines: list[str]) -> Block:
    """A block's commands; a `console` block's output lines go to the command before them."""
    block, skip = Block(doc, first, lang), None
    for number, text in logical_lines(lines, first):
        stripped = text.strip()
        if stripped.startswith(MARK):
            skip = stripped[len(MARK):].strip()
        elif lang == "console" and not stripped.startswith("$ "):
            if block.commands and stripped:
                block.commands[-1].shown = [*(block.commands[-1].shown or []), text]
        elif stripped and not stripped.startswith("#"):
            command = stripped[2:] if lang == "console" else stripped
            block.commands.append(Command(number, command, None, skip))
    return block


def all_blocks() -> list[Block]:
    """Every command block of every document."""
    return [parse_block(str(path.relative_to(ROOT)), first, lang, lines)
            for path in documents() for first, lang, lines in raw_blocks(path.read_text())]


def coverage_summary() -> list[str]:
    """What the docs test runs and what it does not, with the reasons: the lines the run's summary prints."""
    blocks = all_blocks()
    commands = [c for b in blocks for c in b.commands]
    ran = [c for c in commands if c.skip is None]
    lines = [f"{len(blocks)} command blocks, {len(commands)} commands: {len(ran)} run, "
             f"{len(commands) - len(ran)} not run here:"]
    for block in blocks:
        reasons = sorted({c.skip for c in block.commands if c.skip})
        skipped = sum(1 for c in block.commands if c.skip)
        if skipped:
            part = "block" if skipped == len(block.commands) else f"{skipped} of {len(block.commands)} commands"
            lines.append(f"  {block.where()} ({part}): {'; '.join(reasons)}")
    return lines


# -- matching shown output ------------------------------------------------------------------------

BOX = str.maketrans({c: " " for c in "│┃║"})
NUMBER = re.compile(r"\d[\d,.]*")
HEX = re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{7,}\b")
GAP = re.compile(r"^[\s.…]*\.\.\.[\s.…]*$|^[\s.…]*…[\s.…]*$")


def normalize(line: str) -> str:
    """Whitespace and table rules compared loosely: rich sizes its columns to what they hold."""
    line = re.sub(r"([━─═])\1+", r"\1", line.translate(BOX))
    return " ".join(line.split())


def line_pattern(shown: str) -> str:
    """A shown line as a regular expression: numbers, hex ids and `...` are wildcards."""
    pattern, pos = [], 0
    wild = re.compile(rf"{HEX.pattern}|{NUMBER.pattern}|\.\.\.|…")
    for m in wild.finditer(shown):
        pattern.append(re.escape(shown[pos:m.start()]))
        token = m.group()
        pattern.append(".*?" if token in ("...", "…") else "[0-9a-f]+" if HEX.fullmatch(token) else r"[\d,.]+")
        pos = m.end()
    pattern.append(re.escape(shown[pos:]))
    return "".join(pattern)


def output_matches(shown: list[str], actual: str, places: dict[str, str]) -> bool:
    """Whether the shown lines occur in `actual` in order, a `...` line standing for any lines; `places`
    maps what differs from the document's run (this run's paths and hosts) to what the document shows."""
    for here, there in places.items():
        actual = actual.replace(here, there)
    text = "\n".join(normalize(line) for line in actual.splitlines() if line.strip())
    parts = []
    for line in shown:
        parts.append(r"(?:[^\n]*\n)*?" if GAP.match(line.translate(BOX)) else f"{line_pattern(normalize(line))}\n")
    pattern = "(?m)^" + "".join(parts)
    return re.search(pattern, text + "\n") is not None


# -- running a document ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Scenario:
    """Where a document's commands run: the user's repository, the GitHub fake, the environment."""

    repo: Path
    env: dict[str, str]
    gh: FakeGitHub
    servers: list[subprocess.Popen] = field(default_factory=list)

    def command_text(self, command: Command, port: int) -> str:
        return PORT_FLAG.sub(f"--port {port}", ENDPOINT.sub(rf"\g<1>127.0.0.1:{port}", command.text))

    def run(self, block: Block, command: Command, port: int) -> None:
        text = self.command_text(command, port)
        where = f"{block.doc}:{command.line}: {command.text}"
        export = re.fullmatch(r"export (\w+)=(\S*)(\s+#.*)?", text)
        if export:
            self.env[export.group(1)] = export.group(2)
            return
        if text.startswith("m3-agent standin "):
            self.serve(text, port, where)
            return
        cwd = ROOT if text.startswith("bash run.sh") else self.repo
        proc = subprocess.run(["bash", "-c", text], cwd=cwd, env=self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=600)
        assert proc.returncode == 0, f"{where}\nexited {proc.returncode}:\n{proc.stdout[-3000:]}"
        if command.shown:
            places = {str(self.repo): HOME_PATH, self.gh.web: "https://github.com"}
            assert output_matches(command.shown, proc.stdout, places), (
                f"{where}\nthe document shows:\n" + "\n".join(command.shown) + f"\nit printed:\n{proc.stdout}")

    def serve(self, text: str, port: int, where: str) -> None:
        """A server command runs in the foreground until Ctrl-C: here, until the block ends."""
        proc = subprocess.Popen(shlex.split(text, comments=True), cwd=self.repo, env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.servers.append(proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{where}\nexited {proc.returncode}: {proc.stderr.read()}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).close()
                return
            except OSError:
                time.sleep(0.2)
        pytest.fail(f"{where}\nno answer on port {port} after 30 s")

    def stop_servers(self) -> None:
        for proc in self.servers:
            proc.terminate()
            proc.wait(timeout=30)
        self.servers.clear()


def run_block(scenario: Scenario, block: Block) -> None:
    """A block's runnable commands in order; the stand-in scripted to fix add() unless it starts its own."""
    runnable = [c for c in block.commands if c.skip is None]
    if not runnable:
        return
    port = free_port()
    own_server = any(c.text.startswith("m3-agent standin ") for c in runnable)
    standin = None if own_server else StandinServer({"turns": FIXING * 3}, port=port)
    try:
        if standin:
            standin.start()
        for command in runnable:
            scenario.run(block, command, port)
    finally:
        scenario.stop_servers()
        if standin:
            standin.stop()


@pytest.fixture
def scenario(tmp_path, sandbox_image):
    repo = make_git_repo(tmp_path / "widgets", {**CALC, "issue.md": "# add() subtracts\n\n2 + 3 gives -1.\n"})
    origin = bare_origin(tmp_path / "origin.git")
    for name in ("examples", "benchmarks", "tests/evals"):
        (repo / name).symlink_to(ROOT / name)
    (repo / ".git" / "info" / "exclude").write_text("examples\nbenchmarks\ntests/evals\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("M3_AGENT_", "GITHUB_", "GH_"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", COLUMNS="200",
               XDG_STATE_HOME=str(tmp_path / "state"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    with FakeGitHub(token="ghp_...", origin=origin) as gh:
        gh.add_issue(*SHOWN_ISSUE)
        subprocess.run(["git", "-C", str(repo), "remote", "add", "origin", f"{gh.web}/acme/widgets.git"], check=True)
        subprocess.run(["git", "-C", str(repo), "remote", "set-url", "--push", "origin", str(origin)], check=True)
        subprocess.run(["git", "-C", str(repo), "push", "-q", "origin", "main"], check=True)
        yield Scenario(repo, env, gh)


@pytest.mark.parametrize("doc", [str(p.relative_to(ROOT)) for p in documents()])
def test_every_runnable_command_of_the_document_runs_as_written(doc, scenario):
    for block in (b for b in all_blocks() if b.doc == doc):
        run_block(scenario, block)


def test_the_output_matcher_finds_drift_and_allows_what_varies(tmp_path):
    printed = f"resolved  (submitted, 5 turns, 2.1 s)\nbranch: m3-agent/issue-7 (0a1b2c3d4e5f)\npatch:  {tmp_path}/x.patch\n"
    places = {str(tmp_path): HOME_PATH}
    assert output_matches(["resolved  (submitted, 4 turns, 3.4 s)", "branch: m3-agent/issue-9 (70f1a51d86b6)",
                           f"patch:  {HOME_PATH}/x.patch"], printed, places)
    assert not output_matches(["resolved  (submitted, 4 turns, 3.4 s)", "patch:  .m3-agent/x.patch"], printed, places)
    assert not output_matches(["resolved  (submitted, 4 turns, 3.4 s)", f"patch:  {HOME_PATH}/x.patch"], printed, places)
    assert output_matches(["resolved  (submitted, 4 turns, 3.4 s)", "...", f"patch:  {HOME_PATH}/x.patch"], printed, places)


def test_blocks_commands_and_markers_are_read_as_a_reader_sees_them():
    text = ("```console\n$ m3-agent fix 1 \\\n    --quiet\nresolved\n```\n\n"
            "```sh\nm3-agent serve profiles   # all\n# not run by the docs test: needs a GPU node\n"
            "m3-agent serve start --profile b200\n```\n\n```python\nprint(1)\n```\n\n"
            "From the shell:\n\n    m3-agent standin --script s.json\n")
    blocks = [parse_block("x.md", first, lang, lines) for first, lang, lines in raw_blocks(text)]
    assert [(b.line, b.lang) for b in blocks] == [(2, "console"), (8, "sh"), (19, "indented")]
    fix, = blocks[0].commands
    assert (fix.text, fix.shown, fix.skip) == ("m3-agent fix 1 --quiet", ["resolved"], None)
    assert [(c.text, c.skip) for c in blocks[1].commands] == [
        ("m3-agent serve profiles   # all", None), ("m3-agent serve start --profile b200", "needs a GPU node")]
