"""The built wheel installs under one import root, `m3_agent`, that an embedding program cannot collide with.

The wheel is built from this working tree, installed into a fresh virtualenv (its dependencies come
from the project's environment through a path entry, so nothing is downloaded), and run from a git
repository that has its own `agent/`, `tools/`, `sandbox/` and `evals/` packages on `sys.path`: the
layout of an internal tool that embeds m3-agent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from m3_agent.standin.server import StandinServer
from tests.conftest import make_git_repo

ROOT = Path(__file__).resolve().parents[1]
USER_PACKAGES = ("agent", "tools", "sandbox", "evals")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of this working tree, built from a copy (the build writes into its source tree)."""
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    (found,) = out.glob("m3_agent-*.whl")
    return found


@pytest.fixture(scope="module")
def fresh_env(wheel, tmp_path_factory) -> Path:
    """A new virtualenv with only the wheel installed; the dependencies are the project's, by path."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # Deps by path only: a .pth line adds the directory without running its own .pth files, so the
    # project's editable finder stays out and `m3_agent` can only come from the wheel.
    Path(site, "_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir


@pytest.fixture
def embedding_repo(git_repo) -> Path:
    """An internal tool's repository: its own agent/, tools/, sandbox/ and evals/ packages, and a bug."""
    files = {f"{name}/__init__.py": f"OWNER = 'the embedding program'\nNAME = {name!r}\n" for name in USER_PACKAGES}
    files["pricing.py"] = "def apply_discount(price, pct):\n    return price * pct / 100\n"
    return git_repo(files, name="internal-tool")


def run_in(env_dir: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(cwd)  # the embedding program's packages come first on sys.path
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_wheel_holds_one_import_root_and_no_generic_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"m3_agent"}, tops
    for sub in ("agent/loop.py", "tools/dispatch.py", "sandbox/container.py", "evals/grading.py", "fix/flow.py",
                "standin/server.py", "standin/kvsim.py", "serving/standin.py", "cli.py"):
        assert f"m3_agent/{sub}" in names, sub
    assert any(n.startswith("m3_agent/evals/suite/") for n in names), "the built-in eval suite ships in the wheel"


def test_installed_cli_runs_beside_the_embedding_programs_own_packages(fresh_env, embedding_repo, tmp_path):
    m3 = str(fresh_env / "bin" / "m3-agent")
    helped = run_in(fresh_env, embedding_repo, m3, "--help")
    assert helped.returncode == 0, helped.stderr
    for command in ("fix", "pack", "eval", "serve", "sandbox", "standin"):
        assert command in helped.stdout
    standin = run_in(fresh_env, embedding_repo, m3, "standin", "--help")  # the stand-in's own package installed
    assert standin.returncode == 0 and "--script" in standin.stdout, standin.stderr
    out = tmp_path / "pack.txt"
    packed = run_in(fresh_env, embedding_repo, m3, "pack", "--repo", ".", "-o", str(out))
    assert packed.returncode == 0, packed.stderr
    assert "def apply_discount(price, pct):" in out.read_text()
    which = run_in(fresh_env, embedding_repo, str(fresh_env / "bin" / "python"), "-c",
                   "import agent, tools, m3_agent.agent.loop as loop, m3_agent.tools as mt; "
                   "print(agent.OWNER, tools.NAME, loop.__file__, mt.__file__)")
    assert which.returncode == 0, which.stderr
    owner_line = which.stdout.strip()
    assert owner_line.startswith("the embedding program tools ")
    assert str(fresh_env) in owner_line.split()[-1] and str(fresh_env) in owner_line.split()[-2]


def library_example() -> str:
    """The README's Library section, as a user would copy it."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Library"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.docker
def test_readme_library_example_runs_from_the_wheel_in_an_embedding_program(fresh_env, embedding_repo, sandbox_image):
    script = {"turns": [
        {"tool_calls": [{"name": "file_write", "arguments": {
            "path": "pricing.py", "content": "def apply_discount(price, pct):\n    return price * (100 - pct) / 100\n"}}]},
        {"tool_calls": [{"name": "submit", "arguments": {"summary": "return the discounted price"}}]},
    ]}
    code = library_example()
    assert "http://gpu-node:8000/v1" in code
    with StandinServer(script) as srv:
        code = code.replace("http://gpu-node:8000/v1", srv.base_url)
        code += "\nimport agent, tools, sandbox, evals\nprint('OWNERS', agent.OWNER, tools.NAME, sandbox.NAME, evals.NAME)\n"
        proc = run_in(fresh_env, embedding_repo, str(fresh_env / "bin" / "python"), "-c", code, timeout=300)
        assert srv.turns_served == 2
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "return price * (100 - pct) / 100" in proc.stdout  # the patch the example prints
    assert proc.stdout.split("\n")[-2] == "OWNERS the embedding program tools sandbox evals"
