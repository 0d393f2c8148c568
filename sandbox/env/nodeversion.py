"""Which Node a repository asks for, read from its files on the host (a folder, or a commit's git objects).

    choice = node_choice(FolderFiles(Path("repo")))
    choice.range, choice.source   # "14", "the CI's actions/setup-node node-version (.github/workflows/main.yml)"
    choice.files                  # the CI files that named it: they key the environment

In order, the first that says anything wins: `.nvmrc` (nvm's `lts/iron` names too), `.node-version`,
package.json `engines.node`; then, as the Python side reads how a project tests itself, the Node versions its
CI runs: every `actions/setup-node` step of `.github/workflows/*.yml`, its `node-version` (a matrix's values
and `include` entries followed, `env` values too) or `node-version-file`; test jobs first, any job when no
test job names one. A matrix becomes one range (`14 || 16 || 18`): the newest release the registry has of
any of them is taken. With none of these, the newest LTS line (`lts`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from m3_agent.sandbox.env.testneeds import NOT_TESTS, Files

VERSION_FILES = (".nvmrc", ".node-version")
LTS_RANGE = "lts"  # the newest even major: not an npm range, resolved by nodeenv.resolve_node
# nvm's names of the LTS lines, for `.nvmrc` files that say `lts/iron`.
LTS = {"argon": 4, "boron": 6, "carbon": 8, "dubnium": 10, "erbium": 12, "fermium": 14, "gallium": 16,
       "hydrogen": 18, "iron": 20, "jod": 22, "krypton": 24}
WORKFLOWS = ".github/workflows"
_EXPRESSION = re.compile(r"^\$\{\{\s*(matrix|env)\.([\w-]+)\s*\}\}$")


@dataclass(frozen=True)
class NodeChoice:
    """The Node range a repository asks for, where it says so, and the CI files that did (keyed)."""

    range: str  # an npm semver range, `||` between a matrix's values; LTS_RANGE stands for the newest LTS line
    source: str
    files: tuple[str, ...] = ()


def node_choice(files: Files) -> NodeChoice:
    """The Node `files` (a repository's) ask for, by the order of the module's docstring."""
    for name in VERSION_FILES:
        word = _first_word(files.read(name))
        if word:
            return NodeChoice(nvm_range(word), name)
    engines = manifest(files).get("engines")
    if isinstance(engines, dict) and isinstance(engines.get("node"), str) and engines["node"].strip():
        return NodeChoice(engines["node"].strip(), "package.json engines.node")
    ci = ci_node(files)
    return ci or NodeChoice(LTS_RANGE, "the newest LTS line (no .nvmrc, .node-version, engines.node or CI setup-node)")


def nvm_range(text: str) -> str:
    """An .nvmrc's (or setup-node's) word as an npm range: `v20.1` -> `20.1`, `lts/iron` -> `20`, `lts/*` ->
    LTS_RANGE, `node` -> `*`."""
    text = text.strip().lstrip("vV")
    if text.lower().startswith("lts/"):
        name = text[4:].lower()
        return str(LTS[name]) if name in LTS else LTS_RANGE
    return "*" if text.lower() in ("node", "latest", "current", "stable") else text


def ci_node(files: Files) -> NodeChoice | None:
    """The Node versions the CI's setup-node steps install, as one range; None when no workflow names one."""
    import yaml

    tests: dict[str, list[str]] = {}  # workflow -> the ranges of its test jobs
    others: dict[str, list[str]] = {}
    for path in files.names(WORKFLOWS):
        text = files.read(path) if path.endswith((".yml", ".yaml")) else None
        try:  # every scalar a string: `node-version: 16.10` is not the float 16.1
            data = yaml.load(text, Loader=getattr(yaml, "CBaseLoader", yaml.BaseLoader)) if text else None
        except yaml.YAMLError:
            continue
        jobs = data.get("jobs") if isinstance(data, dict) else None
        for key, job in (jobs if isinstance(jobs, dict) else {}).items():
            if not isinstance(job, dict):
                continue
            found = _job_ranges(files, job, data.get("env"))
            side = others if NOT_TESTS.search(f"{key} {job.get('name', '')}") else tests
            side.setdefault(path, []).extend(found)
    chosen = {p: r for p, r in tests.items() if r} or {p: r for p, r in others.items() if r}
    ranges = list(dict.fromkeys(r for found in chosen.values() for r in found))
    if not ranges:
        return None
    where = ", ".join(chosen)
    return NodeChoice(" || ".join(ranges), f"the CI's actions/setup-node ({where})", tuple(chosen))


def _job_ranges(files: Files, job: dict, workflow_env: object) -> list[str]:
    """The ranges one job's setup-node steps name, its matrix's and env's values followed."""
    env = {**(workflow_env if isinstance(workflow_env, dict) else {}),
           **(job.get("env") if isinstance(job.get("env"), dict) else {})}
    ranges: list[str] = []
    for step in job.get("steps") or []:
        if not isinstance(step, dict) or not str(step.get("uses", "")).startswith("actions/setup-node"):
            continue
        given = step.get("with") if isinstance(step.get("with"), dict) else {}
        if given.get("node-version"):
            words = _values(given["node-version"], job, env)
            ranges += [nvm_range(w) for w in words if w.strip() and not w.strip().startswith("lts/-")]
        elif given.get("node-version-file"):
            ranges += [r for r in [_version_file(files, str(given["node-version-file"]))] if r]
    return ranges


def _values(value: object, job: dict, env: dict) -> list[str]:
    """A `node-version` value as words: a matrix's or env's expression resolved, a list or several lines split;
    an expression that cannot be resolved here gives nothing."""
    if isinstance(value, list):
        return [w for v in value for w in _values(v, job, env)]
    text = str(value).strip()
    found = _EXPRESSION.match(text)
    if found and found.group(1) == "env":
        return _values(env.get(found.group(2), "${{ }}"), job, env)
    if found:
        matrix = (job.get("strategy") or {}).get("matrix") if isinstance(job.get("strategy"), dict) else None
        if not isinstance(matrix, dict):
            return []
        name = found.group(2)
        listed = matrix.get(name)
        included = [row.get(name) for row in matrix.get("include") or [] if isinstance(row, dict) and row.get(name)]
        return [w for v in [*(listed if isinstance(listed, list) else [listed] if listed else []), *included]
                for w in _values(v, {}, {})]
    if "${{" in text:
        return []
    return [w for w in re.split(r"[\n,]+", text) if w.strip()]


def _version_file(files: Files, name: str) -> str | None:
    """The range a `node-version-file` names: package.json's `volta.node` or `engines.node`, a `.tool-versions`
    line `nodejs 18.0.0`, else the file's first word (`.nvmrc`)."""
    rel = name.removeprefix("./")
    text = files.read(rel)
    if text is None:
        return None
    if rel.endswith("package.json"):
        try:
            data = json.loads(text)
        except ValueError:
            return None
        for value in ((data.get("volta") or {}).get("node"), (data.get("engines") or {}).get("node")):
            if isinstance(value, str) and value.strip():
                return value.strip()
        return None
    if rel.endswith(".tool-versions"):
        found = re.search(r"^\s*(?:nodejs|node)\s+(\S+)", text, re.M)
        return nvm_range(found.group(1)) if found else None
    word = _first_word(text)
    return nvm_range(word) if word else None


def _first_word(text: str | None) -> str:
    return next((ln.strip() for ln in (text or "").splitlines() if ln.strip() and not ln.lstrip().startswith("#")),
                "")


def manifest(files: Files) -> dict:
    """The root package.json, {} when there is none or it cannot be read."""
    try:
        data = json.loads(files.read("package.json") or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
