"""Regenerate the offline SWE-bench tasks (tests/evals/data/swebench/tasks.jsonl) from real fix commits.

    .venv/bin/python benchmarks/swebench_offline_tasks.py --git sympy/sympy=PATH --git sphinx-doc/sphinx=PATH

Each task: a release sdist from the package index as /testbed (committed with a fixed identity and
date, so `base_commit` is reproducible), and the patch of a real upstream fix commit made after that
release which applies to it, split into `patch` (source) and `test_patch` (tests). The git clones
are needed here only, to read the fix commit and the files the sdist lacks; tests never touch them.
FAIL_TO_PASS / PASS_TO_PASS are computed by running the tests in the offline instance image through
the harness's parser: with the empty patch and with the gold patch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from m3_agent.evals.harness import grade_with_harness, offline_image, testbed_sdists  # noqa: E402
from m3_agent.evals.tasks import Task  # noqa: E402
from m3_agent.sandbox import SandboxConfig  # noqa: E402
from m3_agent.sandbox.env.testbed import TestbedRecipe, make_testbed_tree  # noqa: E402

OUT = ROOT / "tests" / "evals" / "data" / "swebench" / "tasks.jsonl"

SOURCES = [
    {
        "instance_id": "sympy__sympy-25431", "repo": "sympy/sympy", "version": "1.12",
        "fix": "6448a601fdeb36223c7d3f983d70a1ac19dc4df4", "tag": "sympy-1.12",
        "sdist": "sympy==1.12", "restore": ["bin/test", "bin/get_sympy.py"],
        "packages": ["mpmath==1.3.0"], "path_entry": "/testbed",
        "test_cmd": "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
        "log_parser": "parse_log_sympy",
    },
    {
        "instance_id": "sphinx-doc__sphinx-10781", "repo": "sphinx-doc/sphinx", "version": "5.1",
        "fix": "4cd950e1ba1e666c838521871e374ec7ea0bc414", "tag": "v5.1.1",
        "sdist": "sphinx==5.1.1", "restore": [],
        "packages": ["docutils==0.18.1", "Jinja2==3.1.2", "MarkupSafe==2.1.2", "Pygments==2.13.0",
                     "snowballstemmer==2.2.0", "Babel==2.10.3", "pytz==2022.2.1", "alabaster==0.7.12",
                     "imagesize==1.4.1", "requests==2.28.1", "urllib3==1.26.12", "idna==3.4",
                     "charset-normalizer==2.1.1", "certifi==2022.9.14", "packaging==21.3", "pyparsing==3.0.9",
                     "sphinxcontrib-applehelp==1.0.2", "sphinxcontrib-devhelp==1.0.2",
                     "sphinxcontrib-jsmath==1.0.1", "sphinxcontrib-htmlhelp==2.0.0",
                     "sphinxcontrib-serializinghtml==1.1.5", "sphinxcontrib-qthelp==1.0.3", "html5lib==1.1",
                     "six==1.16.0", "webencodings==0.5.1", "pytest==7.1.3", "iniconfig==1.1.1", "pluggy==1.0.0",
                     "attrs==22.1.0", "py==1.11.0"],
        "path_entry": "/testbed",
        # tox --current-env runs this command (tox.ini's testenv) in the official images
        "test_cmd": "python -X dev -m pytest -rA --durations 25",
        "log_parser": "parse_log_sphinx",
    },
]


def git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(clone), *args], check=True, capture_output=True, text=True).stdout


def split_patch(clone: Path, commit: str) -> tuple[str, str]:
    """(source patch, test patch) of the commit, changelogs left out."""
    files = [f for f in git(clone, "show", "--format=", "--name-only", commit).split() if f]
    tests = [f for f in files if "tests/" in f or "testing/" in f]
    source = [f for f in files if f not in tests and f.endswith(".py")]
    show = lambda paths: git(clone, "show", "--format=", "--no-color", commit, "--", *paths) if paths else ""  # noqa: E731
    return show(source), show(tests)


def draft_task(src: dict, clone: Path) -> Task:
    patch, test_patch = split_patch(clone, src["fix"])
    recipe = TestbedRecipe(
        sdist=src["sdist"], upstream=f"{src['tag']} ({git(clone, 'rev-parse', src['tag'] + '^{commit}').strip()})",
        restore_files={p: git(clone, "show", f"{src['tag']}:{p}") for p in src["restore"]},
        packages=src["packages"], path_entry=src["path_entry"])
    message = git(clone, "show", "-s", "--format=%B", src["fix"]).strip()
    created = git(clone, "show", "-s", "--format=%aI", src["fix"]).strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_commit = make_testbed_tree(src["instance_id"], recipe, Path(tmp) / "testbed", sdists=testbed_sdists())
    return Task(instance_id=src["instance_id"], repo=src["repo"], version=src["version"], base_commit=base_commit,
                patch=patch, test_patch=test_patch, created_at=created, test_cmd=src["test_cmd"],
                log_parser=src["log_parser"], problem_statement=f"{message}\n\n(upstream fix: {src['fix']})\n",
                testbed=recipe.model_dump())


def compute_tests(task: Task) -> Task:
    image = offline_image(task)
    config = SandboxConfig()
    empty = grade_with_harness(task, "", image=image, sandbox=config)
    gold = grade_with_harness(task, task.patch, image=image, sandbox=config)
    for name, r in (("empty", empty), ("gold", gold)):
        if r.error or not r.test_statuses:
            raise SystemExit(f"{task.instance_id}: the {name} run gave no results: {r.error}\n{r.test_output[-2000:]}")
    ok = ("PASSED", "XFAIL")
    f2p = sorted(t for t, s in gold.test_statuses.items() if s in ok and empty.test_statuses.get(t) not in ok)
    p2p = sorted(t for t, s in gold.test_statuses.items() if s in ok and empty.test_statuses.get(t) in ok)
    print(f"{task.instance_id}: FAIL_TO_PASS {len(f2p)}, PASS_TO_PASS {len(p2p)}", file=sys.stderr)
    return task.model_copy(update={"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git", action="append", default=[], metavar="OWNER/NAME=PATH",
                        help="a clone with the upstream history of each repository")
    args = parser.parse_args()
    clones = dict(item.split("=", 1) for item in args.git)
    rows = []
    for src in SOURCES:
        if src["repo"] not in clones:
            raise SystemExit(f"pass --git {src['repo']}=PATH (a clone holding {src['fix']})")
        rows.append(compute_tests(draft_task(src, Path(clones[src["repo"]]))))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(t.model_dump(exclude_defaults=True)) + "\n" for t in rows))
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
