"""What a repository says its tests need, read from its CI, tox, nox, tool tables and pytest configuration;
and environments built from it on the real engine, with real packages of the package index."""

from __future__ import annotations

import uuid

import pytest

from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env.build import BuildRequest, ensure_environment
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from m3_agent.sandbox.env.pyenv import Target, declared_in, plan_environment
from m3_agent.sandbox.env.testneeds import (FolderFiles, Need, TestCommand, command_lines, poetry_requirement,
                                            read_test_needs)
from tests.sandbox.env.tree import write

TARGET = Target("3.11.2", "x86_64", "2.36")
SESSION = uuid.uuid4().hex[:12]
SOURCE = f"testneeds-{SESSION}"


# tqdm's layout: pytest-asyncio only in .meta/requirements-test.txt, tox in pyproject.toml, and
# `--asyncio-mode=strict` in pytest's addopts.
TQDM_LIKE = {
    "pyproject.toml": f"""\
# {SESSION}
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "spinner"
version = "1.0"

[tool.setuptools]
packages = ["spinner"]

[tool.pytest.ini_options]
addopts = "-v --tb=short --asyncio-mode=strict"
asyncio_default_fixture_loop_scope = "function"
""",
    ".meta/requirements-test.txt": "pytest\npytest-asyncio>=0.24\ngit+https://example.invalid/nbval.git#egg=nbval\n",
    ".meta/requirements-build.txt": "build\n",
    "spinner/__init__.py": "async def spin():\n    return 3\n",
    "tests/tests_spin.py": ("import pytest\nfrom spinner import spin\n\n\n@pytest.mark.asyncio\n"
                            "async def test_spin():\n    assert await spin() == 3\n"),
}

# mypy's: pytest-xdist only in test-requirements.txt, which tox.ini's testenv installs, and `-nauto` in addopts.
MYPY_LIKE = {
    "pyproject.toml": f"""\
# {SESSION}
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "checker"
version = "1.0"

[tool.setuptools]
packages = ["checker"]

[tool.pytest.ini_options]
addopts = "-nauto --strict-markers"
testpaths = ["checker/test"]
""",
    "tox.ini": ("[tox]\nenvlist = py311, lint, docs\n\n[testenv]\ndeps =\n    -r test-requirements.txt\n"
                "    orjson;python_version=='3.12'\ncommands = python -m pytest {posargs}\n\n"
                "[testenv:lint]\ndeps = ruff\ncommands = ruff check .\n"),
    "test-requirements.txt": "pytest>=8\npytest-xdist>=3\nattrs\n",
    "requirements_lint_pre_commit.txt": "ruff\nblack\n",
    ".github/workflows/test.yml": """\
name: tests
on: [push]
jobs:
  lint:
    runs-on: ubuntu-latest
    steps:
      - run: pip install ruff && ruff check .
  main:
    runs-on: ubuntu-latest
    strategy:
      matrix:
        toxenv: [py]
    steps:
      - run: pip install tox
      - run: tox -e ${{ matrix.toxenv }} -- -n 2
""",
    "checker/__init__.py": "",
    "checker/test/__init__.py": "",
    "checker/test/test_check.py": "import attrs\n\n\ndef test_check():\n    assert attrs.define\n",
}


def test_tqdm_like_test_needs_come_from_tox_the_test_requirements_and_pytest_options(tmp_path):
    files = dict(TQDM_LIKE)
    files["pyproject.toml"] += ('\n[tool.tox]\nlegacy_tox_ini = """\n[tox]\nenvlist = py311, check\n\n[core]\n'
                                'deps =\n    pytest-timeout\n\n[testenv]\ndeps =\n    {[core]deps}\n    rich\n'
                                '    tf: tensorflow\ncommands = {envpython} -m pytest -k "not perf"\n\n'
                                '[testenv:check]\ndeps = twine\n"""\n')
    files[".github/workflows/test.yml"] = "jobs:\n  test:\n    steps:\n      - run: pip install tox\n      - run: tox\n"
    needs = read_test_needs(write(tmp_path, files))
    assert needs.of("requirement")[:2] == ["pytest-timeout", "rich"]  # tox's base environment, no tf factor
    assert "twine" not in needs.of("requirement") and "tensorflow" not in needs.of("requirement")
    assert Need("requirement", "pytest-asyncio>=0.24", ".meta/requirements-test.txt") in needs.items
    assert [n.value for n in needs.skipped] == ["git+https://example.invalid/nbval.git#egg=nbval"]  # no index has it
    assert needs.commands == [TestCommand(("python", "-m", "pytest", "-k", "not perf"), "", "pyproject.toml")]
    assert needs.of("file") == [".meta/requirements-test.txt"]  # the build's requirements are not the tests'


def test_a_tox_command_continued_over_lines_is_read_as_one(tmp_path):
    """Pillow's tox.ini continues its pytest command with a backslash at each line's end: shlex met a lone
    backslash and `env build` stopped with a traceback (ValueError: No escaped character)."""
    root = write(tmp_path, {
        "pyproject.toml": "[project]\nname = 'imaging'\nversion = '1'\n",
        "tox.ini": ("[testenv]\ndeps =\n    numpy\nextras =\n    tests\ncommands =\n    {envpython} selftest.py\n"
                    "    {envpython} -m pytest \\\n      --cov PIL \\\n      --numprocesses auto \\\n"
                    "      -W always \\\n      {posargs}\n    python -c 'an open quote\n")})
    needs = read_test_needs(root)
    assert needs.commands == [TestCommand(("python", "-m", "pytest", "--cov", "PIL", "--numprocesses", "auto", "-W",
                                           "always", "{posargs}"), "", "tox.ini")]  # test_runner fills {posargs}
    assert {"numpy", "pytest-cov", "pytest-xdist"} <= {n.split(">")[0] for n in needs.of("requirement")}
    assert needs.of("extra") == ["tests"]


def test_mypy_like_test_needs_follow_the_ci_into_tox_and_skip_lint(tmp_path):
    root = write(tmp_path, MYPY_LIKE)
    needs = read_test_needs(root)
    assert needs.of("file") == ["test-requirements.txt"]
    assert [n.source for n in needs.items if n.kind == "file"] == ["tox.ini"]
    assert 'orjson; python_version == "3.12"' in needs.of("requirement")
    assert "ruff" not in needs.of("requirement") and "tox" not in needs.of("requirement")
    assert sorted(declared_in(FolderFiles(root)).files) == [".github/workflows/test.yml", "pyproject.toml",
                                                            "test-requirements.txt", "tox.ini"]  # not the pre-commit file: it is read no more


def test_ci_installs_extras_groups_and_files_from_their_working_directory(tmp_path):
    root = write(tmp_path, {
        "pyproject.toml": "[project]\nname = 'app'\nversion = '1'\n[dependency-groups]\nci = ['hypothesis']\n",
        "backend/reqs/test.txt": "pytest\n",
        ".github/workflows/ci.yml": """\
jobs:
  docs:
    steps: [{run: pip install sphinx && make html}]
  unit:
    defaults: {run: {working-directory: backend}}
    steps:
      - run: |
          python -m pip install -e ".[test,yaml]" \\
            -r reqs/test.txt --group ci 'trio>=0.22'
      - if: matrix.lowest
        run: pip install attrs==19.1
      - run: python -m pytest -x tests
""",
    })
    needs = read_test_needs(root)
    assert needs.of("extra") == ["test", "yaml"] and needs.of("group") == ["ci"]
    assert needs.of("file") == ["backend/reqs/test.txt"] and needs.of("requirement") == ["trio>=0.22", "pytest"]
    assert needs.commands == [TestCommand(("python", "-m", "pytest", "-x", "tests"), "backend",
                                          ".github/workflows/ci.yml")]


def test_a_docs_requirements_file_in_a_test_step_is_not_a_test_need(tmp_path):
    """PyWavelets' test step installs its docs' requirements in the branch that builds the docs: the file is
    neither installed nor part of the key (a docs-only change would build the environment anew)."""
    root = write(tmp_path, {
        "pyproject.toml": "[project]\nname = 'app'\nversion = '1'\n",
        "util/readthedocs/requirements.txt": "sphinx\n",
        "doc/requirements.txt": "numpydoc\n",
        "requirements/test.txt": "pytest\n",
        ".github/workflows/tests.yml": """\
jobs:
  test:
    steps:
      - run: |
          pip install -r requirements/test.txt
          if [ "$REFGUIDE_CHECK" == "1" ]; then
              pip install -r util/readthedocs/requirements.txt -r doc/requirements.txt
              sphinx-build -b html doc/source doc/build
          else
              pytest --pyargs app
          fi
""",
    })
    assert read_test_needs(root).of("file") == ["requirements/test.txt"]
    assert sorted(declared_in(FolderFiles(root)).files) == [".github/workflows/tests.yml", "pyproject.toml",
                                                            "requirements/test.txt"]


def test_nox_sessions_are_read_without_running_the_noxfile(tmp_path):
    root = write(tmp_path, {"noxfile.py": """\
import nox
raise SystemExit("a noxfile is never run")

@nox.session(python=["3.11"])
def tests(session):
    session.install("-e", ".[tests]")
    session.install("pytest-mock", "-r", "dev.txt")
    session.run("pytest", *session.posargs)

@nox.session
def lint(session):
    session.install("flake8")
""", "dev.txt": "coverage\n"})
    needs = read_test_needs(root)
    assert needs.of("requirement") == ["pytest-mock", "coverage"] and needs.of("extra") == ["tests"]
    assert needs.of("file") == ["dev.txt"]
    assert needs.commands == [TestCommand(("python", "-m", "pytest"), "", "noxfile.py")]


def test_the_words_of_a_command_substitution_are_not_install_targets():
    """typing_extensions' CI: `uv pip install ... --exclude-newer $(git show -s --format=%cd HEAD)` made `show`
    a requirement, and the download stopped at ResolutionImpossible (show needs readline)."""
    lines = command_lines("uv pip install --system -r test-requirements.txt --exclude-newer "
                          "$(git show -s --date=format:'%Y' --format=%cd HEAD)\npip install `echo six` $(a $(b c)) x\n")
    assert lines == [("uv", "pip", "install", "--system", "-r", "test-requirements.txt", "--exclude-newer",
                      "$SUBSTITUTED"), ("pip", "install", "$SUBSTITUTED", "$SUBSTITUTED", "x")]


def test_a_nox_session_that_installs_through_a_helper_names_the_helpers_group(tmp_path):
    """urllib3: `test` calls `tests_impl(session)`, whose `session.run_install("uv", "sync", "--group",
    dependency_group)` takes the group from the parameter's default; another session passes its own."""
    root = write(tmp_path, {"noxfile.py": """\
import nox


def tests_impl(session, extras=None, dependency_group: str = "dev", *, marker="slow"):
    session.run_install("uv", "sync", "--frozen", *(("--no-default-groups",) if extras else ()),
                        "--group", dependency_group, *(f"--extra={e}" for e in extras or ()))
    session.run("python", "-m", "pytest", "-m", marker)


@nox.session
def test(session):
    tests_impl(session)


@nox.session
def test_min(session):
    tests_impl(session, None, dependency_group="dev-min")
"""})
    needs = read_test_needs(root)
    assert needs.of("group") == ["dev", "dev-min"]
    assert needs.commands[0] == TestCommand(("python", "-m", "pytest", "-m", "slow"), "", "noxfile.py")


def test_tool_tables_and_environment_yml_give_test_needs_when_no_ci_says(tmp_path):
    root = write(tmp_path, {
        "pyproject.toml": ("[tool.poetry.group.test.dependencies]\npytest-mock = '^3.10'\nfreezegun = '*'\n"
                           "[tool.poetry.group.docs.dependencies]\nsphinx = '*'\n"
                           "[tool.pdm.dev-dependencies]\ntest = ['respx>=0.20']\n"
                           "[tool.pytest.ini_options]\ntimeout = 30\nrequired_plugins = 'pytest-env>=1 pytest-order'\n"),
        "environment.yml": "dependencies:\n  - python\n  - pip\n  - pip:\n    - h5py\n    - git+https://x.invalid/y\n",
    })
    needs = read_test_needs(root)
    assert needs.of("requirement") == ["respx>=0.20", "pytest-mock>=3.10", "freezegun", "h5py", "pytest-timeout",
                                       "pytest-env>=1", "pytest-order"]
    assert [n.value for n in needs.skipped] == ["git+https://x.invalid/y"]
    assert poetry_requirement("a", {"version": "~1.2"}) == "a>=1.2" and poetry_requirement("b", "2.0") == "b==2.0"


def test_the_plan_says_which_file_gave_each_requirement(tmp_path):
    files = {**MYPY_LIKE, "test-requirements.txt": "-r base-requirements.txt\npytest-xdist>=3 \\\n    --hash=sha256:00\n",
             "base-requirements.txt": "attrs\n-e .[yaml]\n", "requirements.txt": "six\n"}
    files["pyproject.toml"] += "[project.optional-dependencies]\nyaml = ['pyyaml']\n"
    # The metadata as pip prepares it in the build container (the host runs no build backend).
    metadata = {"name": "checker", "provides_extra": ["yaml"], "requires_dist": ["pyyaml; extra == 'yaml'"]}
    plan = plan_environment(write(tmp_path, files), TARGET, metadata=metadata)
    assert plan is not None and plan.requirement_files == ["requirements.txt"]
    assert plan.sources == {"pyyaml": "the project's metadata",  # orjson's marker is not the image's Python
                            "attrs": "base-requirements.txt", "pytest-xdist>=3": "test-requirements.txt",
                            "pytest": "always", "requirements.txt": "requirements.txt"}


@pytest.mark.docker
@pytest.mark.timeout(1800)  # builds on one host wait for each other: the whole suite's may come first
@pytest.mark.parametrize(("name", "files", "command"), [
    ("tqdm-like", TQDM_LIKE, "pytest -q tests/tests_spin.py"),
    ("mypy-like", MYPY_LIKE, "pytest -q"),
])
def test_the_tests_run_with_what_the_project_declares_where_it_does(git_repo, sandbox_image, name, files, command):
    """Before: pytest-asyncio and pytest-xdist were never installed, and pytest stopped at once with
    `unrecognized arguments: --asyncio-mode=strict` / `-nauto`, running 0 tests."""
    repo = git_repo(files, name=name)
    env = ensure_environment(BuildRequest(repo=repo, source=SOURCE))
    try:
        assert env is not None and env.built
        with Sandbox(SandboxConfig(image=env.tag), repo=repo) as sb:
            run = sb.exec(command)
            assert "1 passed" in run.stdout, run.stdout + run.stderr
        info = next(e for e in list_environments() if e.tag == env.tag)
        assert info.sources  # `env show` names the file of each requirement
    finally:
        prune_environments(keep=0, source=SOURCE)


def test_a_commit_is_keyed_from_git_objects_as_its_files_are_on_disk(git_repo):
    """Warm runs key from git's objects without exporting the tree: the test needs' files key alike there."""
    from m3_agent.hostgit import CommitFiles

    repo = git_repo(MYPY_LIKE)
    on_disk = declared_in(FolderFiles(repo)).files
    assert ".github/workflows/test.yml" in on_disk and "test-requirements.txt" in on_disk
    with CommitFiles(repo, "HEAD") as files:
        declared = declared_in(files)
    assert declared.files == on_disk and declared.wanted


def test_pyproject_is_parsed_once_for_every_rule_that_reads_it(tmp_path, monkeypatch):
    """tox's legacy table, the tool tables, pytest's options and the wish for an environment all read
    pyproject.toml: one lookup parsed it five times (sqlalchemy's 10 kB: 2 ms each)."""
    import tomllib

    from m3_agent import hostgit
    from m3_agent.sandbox.env import testneeds
    from m3_agent.sandbox.env.pyenv import declared_in
    from tests.conftest import make_git_repo

    pyproject = TQDM_LIKE["pyproject.toml"] + '\n[tool.tox]\nlegacy_tox_ini = "[testenv]\\ndeps = pytest-timeout"\n'
    repo = make_git_repo(tmp_path / "r", {"pyproject.toml": pyproject, "spinner/__init__.py": ""})
    parsed: list[str] = []
    loads = tomllib.loads
    monkeypatch.setattr(testneeds.tomllib, "loads", lambda text: parsed.append(text) or loads(text))
    testneeds.parse_toml.cache_clear()
    with hostgit.CommitFiles(repo, "HEAD") as files:
        declared = declared_in(files)
    assert "pytest-timeout" in [n.value for n in declared.needs.items] and declared.wanted
    assert parsed == [pyproject]
