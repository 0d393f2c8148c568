"""A repository's Node.js side: what `package.json` and its lock file ask for, read and fetched on the host,
installed with no network in the environment's build container.

    plan = plan_node(Path("repo"))                  # None: no package.json
    release = choose_node(plan, machine="x86_64", suite="bookworm", say=print)  # the registry's, else Debian's
    fetch_node(plan, stage, release, machine="x86_64", say=print)  # host: Node, the manager, every package tarball
    for step, command in node_steps(plan): ...      # container: offline install, lifecycle scripts included

What is chosen:
  - Node (`choose_node`): the newest release of the npm registry's `node-linux-<arch>` package (the `node`
    binary alone) that satisfies `.nvmrc`, else `.node-version`, else `engines.node`, else the versions the
    CI's setup-node installs (`sandbox.env.nodeversion`); the newest even (LTS) major otherwise. When the
    registry has none in the range (or does not answer for it), Debian's `nodejs` where its version
    satisfies the range: the environment is then built on the sandbox image of a recipe with that package
    (debootstrap offline, like the sandbox image itself);
  - the package manager: `packageManager` in package.json, else the lock file's (`pnpm-lock.yaml`: pnpm,
    `yarn.lock`: yarn 1, else npm), fetched as its registry package (each bundles its own dependencies);
    without `packageManager`, its newest release up to the default major whose `engines.node` takes the
    Node chosen (an old Node's CI gets npm 9, not npm 10, which needs Node 18);
  - the packages: the host runs the manager with `--ignore-scripts` into a cache of tarballs (npm's cache,
    yarn's cache folder, pnpm's store), from the lock file, or without one from package.json's ranges
    as released before the commit's date (npm's `--before`); the container installs from that cache
    offline, where the lifecycle scripts run. Nothing of the project runs on the host.

`node_modules` does not stay in /workspace (the build empties it, and a sandbox's workspace is a fresh copy):
each one moves to NODE_MODULES under the same relative path, and every sandbox links it back in at start
(`sandbox.container.GIT_INIT`), ignored by git, so patches never hold it. Links from node_modules into the
workspace (a monorepo's own packages) are made absolute before the move so they still resolve.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from m3_agent import hostgit
from m3_agent.errors import EnvironmentBuildError
from m3_agent.sandbox.env import tapplugins
from m3_agent.sandbox.env.debian import apt_cache
from m3_agent.sandbox.env.nodeversion import LTS_RANGE, VERSION_FILES, manifest, node_choice
from m3_agent.sandbox.env.testneeds import FolderFiles
from m3_agent.redact import redact

NODE_HOME = "/opt/m3-agent/node"  # node and the package manager
NODE_BIN = f"{NODE_HOME}/bin"
NODE_MODULES = "/opt/m3-agent/node-packages"  # each node_modules, at its path in the repository (a folder of that name would hide them from node)
NODE_LINKS = f"{NODE_MODULES}/.links"  # the directories (relative) whose node_modules a sandbox links in
STAGE = "/tmp/m3-env/node"  # the fetched files inside the build container
WORKSPACE = "/workspace"
# Where node finds the project's own tools (jest, tsc) in a sandbox; after NODE_BIN on PATH.
WORKSPACE_BIN = f"{WORKSPACE}/node_modules/.bin"

LOCKS = {"package-lock.json": "npm", "npm-shrinkwrap.json": "npm", "pnpm-lock.yaml": "pnpm", "yarn.lock": "yarn"}
# What keys the environment beside every package.json (.npmrc is left out: it may hold a token).
KEY_FILES = (*LOCKS, *VERSION_FILES, "pnpm-workspace.yaml", ".yarnrc", ".yarnrc.yml", ".taprc")
DEFAULT_MANAGER = {"npm": "npm@^10", "yarn": "yarn@^1", "pnpm": "pnpm@^9"}
MANAGER_MAJORS_BACK = 4  # how far below the default major a manager that runs on an old Node is looked for
FETCH_TIMEOUT_S = 900.0
BUILDER = "9"  # bump when the Node steps change what an environment holds
DEBIAN_LIBRARIES = ("libatomic1",)
PNPM_METADATA = "pnpm-metadata"  # pnpm's cache of the registry's metadata, in the stage beside its store
DEBIAN_NODE = "nodejs"  # Debian's package of Node: the fallback when the registry has no release in the range


@dataclass
class NodePlan:
    """What one repository's Node side needs, read from its files on the host."""

    root: Path
    node_range: str  # an npm semver range
    node_source: str  # where the range came from
    manager: str  # npm | yarn | pnpm
    manager_spec: str  # what `npm pack` fetches: npm@^10, pnpm@9.1.0
    lock: str | None  # the lock file's name, None: resolve package.json's ranges
    packages: list[str] = field(default_factory=list)  # directories with a package.json: "." then the workspaces
    before: str | None = None  # ISO date: without a lock, releases before it
    legacy_peers: bool = False  # npm: peer dependencies as npm 6 took them (not checked, not installed)


def wants_node(root: Path) -> bool:
    """The repository has a package.json at its root: it gets Node and its packages."""
    return (root / "package.json").is_file()


def package_json(path: Path) -> dict:
    """The package.json at `path` ({} when absent); EnvironmentBuildError naming it when it cannot be read."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise EnvironmentBuildError(f"{path.name} cannot be read ({e}): fix it", step="read package.json") from None
    return data if isinstance(data, dict) else {}


def workspaces(root: Path) -> list[str]:
    """The monorepo's package directories (relative, sorted): package.json `workspaces`, or pnpm-workspace.yaml."""
    pnpm = root / "pnpm-workspace.yaml"
    patterns = _patterns(package_json(root / "package.json"), pnpm.read_text(errors="replace") if pnpm.is_file() else "")
    found = {Path(path).as_posix() for pattern in patterns for path in glob.glob(pattern, root_dir=root, recursive=True)
             if (root / path / "package.json").is_file() and "node_modules" not in Path(path).parts}
    return sorted(found - {"."})


def _patterns(package: dict, pnpm_workspace: str) -> list[str]:
    """The workspace globs of a package.json and a pnpm-workspace.yaml (its `packages:` list, read by lines:
    the file is that list and little else); negations are not read."""
    spec = package.get("workspaces", [])
    patterns = spec.get("packages", []) if isinstance(spec, dict) else spec
    patterns = [*(patterns if isinstance(patterns, list) else []),
                *re.findall(r"^\s*-\s*['\"]?([^'\"#\n]+?)['\"]?\s*$", pnpm_workspace, re.M)]
    return [p.rstrip("/") for p in patterns if isinstance(p, str) and p and not p.startswith("!")]


def key_files(root: Path) -> dict[str, str]:
    """The Node files of `root` that key the environment (relative path -> git blob id)."""
    if not wants_node(root):
        return {}
    paths = [root / "package.json", *(root / name for name in KEY_FILES)]
    paths += [root / ws / "package.json" for ws in workspaces(root)]
    paths += [root / rel for rel in node_choice(FolderFiles(root)).files]  # the CI files that chose Node
    return {p.relative_to(root).as_posix(): hostgit.blob_id(p.read_bytes()) for p in paths if p.is_file()}


def key_files_in(files: hostgit.CommitFiles) -> dict[str, str]:
    """`key_files` of an open commit's files (empty: the commit has no package.json, no Node side)."""
    top = files.names("")
    if "package.json" not in top:
        return {}
    found = {name: files.blob_id(name) or "" for name in ("package.json", *KEY_FILES) if name in top}
    found.update({rel: files.blob_id(rel) for rel in node_choice(files).files})  # the CI files that chose Node
    pnpm = (files.read_bytes("pnpm-workspace.yaml") or b"").decode(errors="replace")
    patterns = _patterns(manifest(files), pnpm)
    if patterns:  # a monorepo: its workspaces' package.json files, from a listing of the whole tree
        with hostgit.repository(files.root) as repo:
            listing = repo.git.ls_tree("-r", files.commit).splitlines()
        for line in listing:  # "mode blob sha\tpath"
            meta, _, path = line.partition("\t")
            folder = path.rpartition("/")[0]
            if (path.endswith("/package.json") and meta.split()[1] == "blob" and "node_modules" not in path.split("/")
                    and any(_matches(folder, p) for p in patterns)):
                found[path] = meta.split()[2]
    return found


def _matches(folder: str, pattern: str) -> bool:
    """`folder` is one glob.glob would give for `pattern` (a `*` stays within one path segment)."""
    if "**" in pattern:
        return fnmatch.fnmatch(folder, pattern) or fnmatch.fnmatch(folder, pattern.replace("/**", ""))
    return folder.count("/") == pattern.count("/") and fnmatch.fnmatch(folder, pattern)


def package_manager(root: Path) -> tuple[str, str, str | None]:
    """(manager, what to fetch, lock file name) from `packageManager`, else the lock file; npm by default."""
    lock = next((name for name in LOCKS if (root / name).is_file()), None)
    declared = package_json(root / "package.json").get("packageManager")
    if isinstance(declared, str) and "@" in declared:
        name, _, version = declared.partition("@")
        if name in DEFAULT_MANAGER:
            version = version.split("+", 1)[0]  # corepack's `pnpm@9.1.0+sha512...`
            lock = next((n for n, m in LOCKS.items() if m == name and (root / n).is_file()), None)
            return name, f"{name}@{version}", lock
    manager = LOCKS[lock] if lock else "npm"
    return manager, DEFAULT_MANAGER[manager], lock


def plan_node(root: Path, *, before: str | None = None) -> NodePlan | None:
    """What `root`'s Node side needs; None without a package.json. Refuses, in one line, what cannot be
    installed offline here: Yarn 2+ (its own cache and Plug'n'Play)."""
    if not wants_node(root):
        return None
    manager, spec, lock = package_manager(root)
    if manager == "yarn" and (_berry(root, spec) or (root / ".pnp.cjs").is_file()):
        raise EnvironmentBuildError(
            "Yarn 2+ (Berry, Plug'n'Play) is not supported yet: only yarn 1, npm and pnpm repositories get an "
            "environment; use [sandbox] setup or an image of your own", step="read package.json")
    node = node_choice(FolderFiles(root))  # .nvmrc, .node-version, engines.node, the CI's setup-node, else LTS
    return NodePlan(root=root, node_range=node.range, node_source=node.source, manager=manager, manager_spec=spec,
                    lock=lock, packages=[".", *workspaces(root)], before=before)


def _berry(root: Path, spec: str) -> bool:
    if (root / ".yarnrc.yml").is_file():
        return True
    version = spec.partition("@")[2].lstrip("^~=v")
    return version[:1].isdigit() and not version.startswith("1")


# --- on the host ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeRelease:
    """The Node an environment gets: its version, and where it comes from."""

    version: str
    debian: str | None = None  # the Debian release whose `nodejs` package it is; None: the npm registry's binary

    def describe(self) -> str:
        """Where this Node comes from, as `env show` and the progress say it."""
        return f"Debian {self.debian}'s nodejs" if self.debian else "the npm registry's node-linux binary"


def choose_node(plan: NodePlan, *, machine: str, suite: str | None, say) -> NodeRelease:
    """The Node release for the plan's range: the npm registry's newest, else Debian `suite`'s `nodejs` when its
    version satisfies the range (None: the registry's only); EnvironmentBuildError (one line, naming both) when
    neither does."""
    package, npm = node_package(machine), _host_npm()
    unread = None
    try:
        version = resolve_node(npm, package, plan)
    except EnvironmentBuildError as e:  # the registry did not answer
        version, unread = None, f"cannot be read ({str(e).split(': ', 1)[-1]})"
    if version:
        return NodeRelease(version)
    registry = f"the npm registry's {package} {unread or 'has none'}"
    debian = debian_node(suite) if suite else None
    if suite is None:
        raise EnvironmentBuildError(f"no Node release satisfies {plan.node_range!r} ({plan.node_source}): {registry}: "
                                    "fix the range", step="resolve the Node version")
    if debian is not None and satisfies(debian, plan.node_range):
        say(f"the npm registry's {package} {unread or f'has no release in {plan.node_range!r}'}: "
            f"using Debian {suite}'s nodejs {debian}")
        return NodeRelease(debian, debian=suite)
    theirs = f"Debian {suite}'s nodejs {debian}" if debian else f"Debian {suite}'s nodejs (not in its apt lists)"
    raise EnvironmentBuildError(f"no Node release satisfies {plan.node_range!r} ({plan.node_source}): {registry}, "
                                f"nor does {theirs}: fix the range", step="resolve the Node version")


def node_package(machine: str) -> str:
    """The npm registry's package of the `node` binary for `machine` (x86_64, aarch64)."""
    return f"node-linux-{'arm64' if machine in ('aarch64', 'arm64') else 'x64'}"


def satisfies(version: str, node_range: str) -> bool:
    """`version` is in the npm semver range (LTS_RANGE, alone or in a CI matrix's `||`: any release; a range npm
    cannot read: none)."""
    import nodesemver

    parts = [p.strip() for p in node_range.split("||") if p.strip()]
    if LTS_RANGE in parts:  # Debian's nodejs is an LTS line
        return True
    try:
        return bool(nodesemver.satisfies(version, " || ".join(parts), loose=True))
    except (ValueError, TypeError):
        return False


def debian_node(suite: str) -> str | None:
    """The upstream version of Debian `suite`'s nodejs (`18.20.4` of `18.20.4+dfsg-1~deb12u2`), from that release's
    own apt lists (`debian.py`: the archive an offline image build, debootstrap, installs from); None when the host
    has no apt or those lists have no nodejs."""
    out = apt_cache(suite, "madison", DEBIAN_NODE) or ""
    found = []
    for line in out.splitlines():  # "nodejs | 18.20.4+dfsg-1~deb12u2 | http://... bookworm/main amd64 Packages"
        parts = [p.strip() for p in line.split("|")]
        version = re.match(r"(?:\d+:)?(\d+\.\d+\.\d+)", parts[1]) if len(parts) == 3 else None
        if version and re.search(rf"(^|\s){re.escape(suite)}/", parts[2]):
            found.append(version.group(1))
    return max(found, key=lambda v: tuple(int(p) for p in v.split(".")), default=None)


def _host_npm() -> str:
    npm = shutil.which("npm")
    if npm is None:
        raise EnvironmentBuildError("npm is not installed on the host, which fetches the packages: install "
                                    "Node.js (apt-get install npm)", step="fetch Node")
    return npm


@dataclass
class Fetched:
    """What `fetch_node` put in the stage: the versions chosen, for the build's labels and progress."""

    node: str
    manager: str  # name@version
    lock_written: bool  # the host resolved package.json's ranges into a lock: the container installs from it
    legacy_peers: bool = False  # npm resolved with --legacy-peer-deps: the container installs with it too
    debian: str | None = None  # Node is Debian's nodejs of this release, in the image already (NodeRelease)
    tap_plugins: list[str] = field(default_factory=list)  # tap plugins fetched for its config: built in

    @property
    def node_label(self) -> str:
        """Node's line in the environment's package list: its version, and Debian's package when it is that (the
        registry's binary is the rule)."""
        return f"node {self.node}" + (f" ({NodeRelease(self.node, self.debian).describe()})" if self.debian else "")


def fetch_node(plan: NodePlan, stage: Path, release: NodeRelease, *, machine: str, say) -> Fetched:
    """Fetch Node (unless `release` is Debian's, which the image has), the package manager and every package
    into `stage` on the host, running no script."""
    npm = _host_npm()
    stage.mkdir(parents=True, exist_ok=True)
    plan = dataclasses.replace(plan, manager_spec=manager_for(npm, plan, release.version))
    if release.debian is None:
        say(f"fetching Node {release.version} ({plan.node_source}) and {plan.manager_spec} on the host")
        _pack(npm, f"{node_package(machine)}@{release.version}", stage / "node.tgz")
        _debian_libraries(stage)
    else:
        say(f"fetching {plan.manager_spec} on the host (Node {release.version} is {release.describe()}, in the image)")
    _pack(npm, plan.manager_spec, stage / "manager.tgz")
    manager_version = _tar_version(stage / "manager.tgz")
    project = stage / "project"
    _copy_manifests(plan, project)
    say(f"fetching the packages with {plan.manager} on the host (no scripts run)")
    plan = _fetch_packages(plan, stage, project, say)
    lock_written = plan.lock is None and plan.manager == "npm"
    if lock_written:
        shutil.copy2(project / "package-lock.json", stage / "package-lock.json")
    plugins = _fetch_tap_plugins(npm, plan, project, stage / tapplugins.STAGED, say)
    for done in (project, stage / "host-node", stage / "manager"):  # the cache holds what the container needs
        shutil.rmtree(done, ignore_errors=True)
    return Fetched(node=release.version, manager=f"{plan.manager}@{manager_version}", lock_written=lock_written,
                   legacy_peers=plan.legacy_peers, debian=release.debian, tap_plugins=plugins)


def _fetch_tap_plugins(npm: str, plan: NodePlan, project: Path, dest: Path, say) -> list[str]:
    """The tap plugins the project's tap config names and its lock lacks (`sandbox.env.tapplugins`), each at
    the release made for the locked @tapjs/core, installed into `dest`/node_modules on the host with no
    script run; what was fetched (name@version)."""
    lock = next((project / name for name in LOCKS if (project / name).is_file()), None)
    text = lock.read_text(errors="replace") if lock else ""
    missing = tapplugins.missing_plugins(plan.root, text)
    if not missing:
        return []
    core = tapplugins.locked_core(text)
    step = "fetch tap's plugins"
    chosen = {}
    for plugin in missing:
        name, wanted = tapplugins.split(plugin)
        version = tapplugins.plugin_release(_npm_view(npm, f"{name}@>=0", ["version", "peerDependencies"], step),
                                            core, wanted)
        if version is None:
            raise EnvironmentBuildError(f"the tap plugin {plugin} (.taprc or package.json tap.plugin) has no release "
                                        f"for @tapjs/core {core} on the registry", step=step)
        chosen[name] = version
    specs = [f"{n}@{v}" for n, v in chosen.items()]
    say(f"fetching the tap plugins its tap config names and its lock lacks, for @tapjs/core {core}: {', '.join(specs)}")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "package.json").write_text(json.dumps({"private": True, "dependencies": chosen}))
    # Their peer @tapjs/core is the project's own: tap's generator links it in, as `tap plugin add` does.
    _run_host([npm, "install", "--prefix", str(dest), "--ignore-scripts", "--no-audit", "--no-fund",
               "--legacy-peer-deps", "--no-package-lock"], None, step=step)
    return specs


def _fetch_packages(plan: NodePlan, stage: Path, project: Path, say) -> NodePlan:
    """Run the manager's fetch on the host, again where a retry can succeed; the plan that did."""
    step = f"fetch the packages ({plan.manager})"
    for _ in range(3):
        try:
            _run_host(_fetch_command(plan, stage), project, step=step)
            return plan
        except EnvironmentBuildError as e:
            said = str(e).split(": ", 1)[-1]
            if plan.before and _NO_RELEASE_BEFORE.search(str(e)):
                # A registry (a mirror) whose publish times are not the releases' own leaves nothing before the date.
                say(f"no release before {plan.before} fits ({said}): taking today's releases")
                plan = dataclasses.replace(plan, before=None)
            elif plan.manager == "npm" and not plan.legacy_peers and "ERESOLVE" in str(e):
                # npm 7+ refuses peer-dependency conflicts that npm 6, which many projects' CI used, never
                # checked (mitt's eslint 7 beside plugins asking for 8): resolve as npm 6 did.
                say(f"{said}: resolving again with --legacy-peer-deps, as npm 6 did")
                plan = dataclasses.replace(plan, legacy_peers=True)
            else:
                raise
    _run_host(_fetch_command(plan, stage), project, step=step)
    return plan


def resolve_node(npm: str, package: str, plan: NodePlan) -> str | None:
    """The newest release of `package` in the plan's range (LTS_RANGE, alone or among a CI matrix's `||`:
    the newest even major); None when none is."""
    parts = [p.strip() for p in plan.node_range.split("||") if p.strip()]
    ranges = " || ".join(p for p in parts if p != LTS_RANGE)
    versions = _releases(npm, package, ranges) if ranges else []
    if LTS_RANGE in parts:
        versions += [v for v in _releases(npm, package, ">=0") if int(v.split(".")[0]) % 2 == 0]
    return max(versions, key=_version_key, default=None)


def _releases(npm: str, package: str, spec: str) -> list[str]:
    """The releases (no pre-releases) of `package` in the npm range `spec`, from the registry."""
    found = _npm_view(npm, f"{package}@{spec}", ["version"], "resolve the Node version")
    return [v for v in found if isinstance(v, str) and re.match(r"\d+\.\d+\.\d+$", v)]  # {"error": ...}: none


def _npm_view(npm: str, spec: str, fields: list[str], step: str) -> list:
    """`npm view spec fields --json` as a list of rows (npm prints one row alone, not in a list); [] for a
    package or range the registry does not have."""
    out = _run_host([npm, "view", spec, *fields, "--json"], None, step=step, quiet=True)
    try:
        found = json.loads(out or "[]")
    except ValueError:
        return []
    return [found] if isinstance(found, (dict, str)) else found if isinstance(found, list) else []


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def manager_for(npm: str, plan: NodePlan, node: str) -> str:
    """What to fetch of the plan's package manager for Node `node`: the project's `packageManager` as it is;
    else the newest release of the default's major, or of the closest major below it, whose `engines.node`
    takes `node` (npm 10 refuses the Node 14 an old project's CI names; npm 9 runs on it)."""
    if plan.manager_spec != DEFAULT_MANAGER[plan.manager]:
        return plan.manager_spec
    import nodesemver

    major = int(re.findall(r"\d+", plan.manager_spec)[0])
    for older in range(major, max(major - MANAGER_MAJORS_BACK, 0), -1):  # a major at a time: npm view lists
        rows = _npm_view(npm, f"{plan.manager}@^{older}", ["version", "engines.node"],  # fields per version
                         f"choose the {plan.manager} release for Node {node}")
        rows = [row if isinstance(row, dict) else {"version": row} for row in rows]  # a bare version: no engines
        fits = [str(row["version"]) for row in rows if re.match(r"\d+\.\d+\.\d+$", str(row.get("version")))
                and _takes(row.get("engines.node"), node, nodesemver)]
        if fits:
            return f"{plan.manager}@{max(fits, key=_version_key)}"
    return plan.manager_spec  # none fits: the default, whose own error then says why


def _takes(engines: object, node: str, nodesemver) -> bool:
    """A package's `engines.node` accepts `node` (no range: any Node)."""
    if not isinstance(engines, str) or not engines.strip():
        return True
    try:
        return bool(nodesemver.satisfies(node, engines, loose=True))
    except (ValueError, TypeError):  # a range nobody can read says nothing against it
        return True


def _pack(npm: str, spec: str, dest: Path) -> None:
    """`npm pack spec` into `dest` (npm's cache makes the second time local)."""
    out_dir = dest.parent / (dest.name + ".d")
    out_dir.mkdir()
    _run_host([npm, "pack", spec, "--pack-destination", str(out_dir), "--silent"], None, step=f"fetch {spec}")
    tarball = next(out_dir.glob("*.tgz"), None)
    if tarball is None:
        raise EnvironmentBuildError(f"npm pack {spec} wrote no tarball", step=f"fetch {spec}")
    tarball.rename(dest)
    out_dir.rmdir()


def _debian_libraries(stage: Path) -> None:
    """Debian's packages of the libraries Node's binary needs beyond the sandbox image's (libatomic since
    Node 26), downloaded on the host with apt, installed with dpkg in the container."""
    apt = shutil.which("apt-get")
    if apt is None:  # not Debian: the container says which library is missing, in one line
        return
    debs = stage / "debs"
    debs.mkdir(exist_ok=True)
    subprocess.run([apt, "download", *DEBIAN_LIBRARIES], cwd=debs, capture_output=True, timeout=FETCH_TIMEOUT_S)


def _tar_version(tarball: Path) -> str:
    with tarfile.open(tarball) as tar:
        member = tar.extractfile("package/package.json")
        return json.loads(member.read()).get("version", "?") if member else "?"


def _copy_manifests(plan: NodePlan, project: Path) -> None:
    """package.json files, the lock and the managers' settings, at their paths: all the fetch reads."""
    for rel in plan.packages:
        (project / rel).mkdir(parents=True, exist_ok=True)
        shutil.copy2(plan.root / rel / "package.json", project / rel / "package.json")
    for name in (*LOCKS, "pnpm-workspace.yaml", ".npmrc", ".yarnrc"):
        if (plan.root / name).is_file():
            shutil.copy2(plan.root / name, project / name)


def _fetch_command(plan: NodePlan, stage: Path) -> list[str]:
    """The manager's command that fills the stage's cache from the lock (or the ranges), with no script. It
    runs on the host with the Node and the manager fetched for the container: the same versions resolve,
    whatever Node the host has."""
    run = [_host_node(stage), _manager_script(stage)]
    quiet = ["--ignore-scripts", "--no-audit", "--no-fund"]
    if plan.manager == "npm":
        # A lock with each tarball's URL: the container then needs no registry metadata, which a fetch with
        # --before stores in another form than an install without it asks for.
        quiet.append("--omit-lockfile-registry-resolved=false")
        quiet += ["--legacy-peer-deps"] if plan.legacy_peers else []
        cache = ["--cache", str(stage / "cache")]
        if plan.lock:
            return [*run, "ci", *quiet, *cache]
        # --package-lock: a project's .npmrc may turn the lock off (sindresorhus's do); the container installs from it
        return [*run, "install", "--package-lock=true", *quiet, *cache,
                *([f"--before={plan.before}"] if plan.before else [])]
    if plan.manager == "yarn":
        return [*run, "install", "--ignore-scripts", "--non-interactive", "--no-progress",
                "--cache-folder", str(stage / "cache"), *(["--frozen-lockfile"] if plan.lock else [])]
    # pnpm's metadata cache travels with its store: pnpm 11 checks each lock entry against the registry's
    # metadata before installing (its release-age and trust policies), offline too
    store = ["--store-dir", str(stage / "cache"), "--cache-dir", str(stage / PNPM_METADATA)]
    if plan.lock:  # pnpm reads only the lock: the fastest fetch there is
        return [*run, "fetch", *store]
    return [*run, "install", "--ignore-scripts", *store]


_NO_RELEASE_BEFORE = re.compile(r"No versions available|No matching version|ETARGET|ENOVERSIONS")


def _host_node(stage: Path) -> str:
    """The fetched `node` binary, unpacked for the host; the host's own `node` when Node is Debian's (the image's
    package, not fetched)."""
    out = stage / "host-node"
    if not (stage / "node.tgz").is_file():
        host = shutil.which("node")
        if host is None:
            raise EnvironmentBuildError("node is not installed on the host, which runs the package manager to fetch "
                                        "the packages: install Node.js (apt-get install nodejs)", step="fetch Node")
        return host
    with tarfile.open(stage / "node.tgz") as tar:
        member = tar.getmember("package/bin/node")
        member.name = "node"
        tar.extract(member, out, filter="data")
    (out / "node").chmod(0o755)
    return str(out / "node")


def _manager_script(stage: Path) -> str:
    """The package manager's entry script, unpacked from its tarball on the host."""
    out = stage / "manager"
    with tarfile.open(stage / "manager.tgz") as tar:
        tar.extractall(out, filter="data")
    bins = package_json(out / "package" / "package.json").get("bin") or {}
    entry = bins if isinstance(bins, str) else next(iter(bins.values()), "")
    return str(out / "package" / entry)


def _run_host(cmd: list[str], cwd: Path | None, *, step: str, quiet: bool = False) -> str:
    """Run a package manager on the host; EnvironmentBuildError with its first error line, tokens masked."""
    env = {**os.environ, "npm_config_update_notifier": "false", "CI": "1", "COREPACK_ENABLE_STRICT": "0"}
    if cwd is not None:  # the fetched node first: a manager that calls `node` gets the same one
        env["PATH"] = f"{cwd.parent / 'host-node'}{os.pathsep}{env.get('PATH', '')}"
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, errors="replace", env=env,
                              timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EnvironmentBuildError(f"{shlex.join(cmd[:3])} took over {FETCH_TIMEOUT_S:.0f} s", step=step) from None
    if proc.returncode != 0 and not (quiet and "E404" in proc.stderr):
        raise EnvironmentBuildError(f"{manager_error(proc.stderr or proc.stdout)} (exit {proc.returncode})",
                                    step=step)
    return proc.stdout


def manager_error(text: str) -> str:
    """The line of npm's, yarn's or pnpm's output that says what went wrong, tokens masked."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [re.sub(r"^(npm (ERR!|error)|error|\[?ERR_PNPM_\w+\]?)\s*", "", ln) for ln in lines
              if re.match(r"(npm (ERR!|error)|error |\[?ERR_PNPM)", ln)]
    errors = [e for e in errors if e and not re.match(rf"(A complete log|Log files|({NOT_THE_ERROR})( |$))", e)]
    return masked((errors or lines or ["no output"])[0])[:300]


_SECRET = re.compile(r"(_authToken|_auth|_password|token)\s*=\s*(\S+)", re.I)


def masked(text: str) -> str:
    """`text` with the tokens of the user's .npmrc masked, and whatever follows any `_authToken=`."""
    secrets = []
    path = Path.home() / ".npmrc"
    if path.is_file():
        secrets += [m.group(2) for m in _SECRET.finditer(path.read_text(errors="replace"))]
    return _SECRET.sub(lambda m: f"{m.group(1)}=****", redact(text, secrets))


# --- in the build container -------------------------------------------------------------------------------

def node_steps(plan: NodePlan, fetched: Fetched) -> list[tuple[str, str]]:
    """(name, shell command) of each step run as root in the build container, from the fetched stage."""
    wrappers = "".join(
        f"printf '#!/bin/sh\\nexec {NODE_BIN}/node {NODE_HOME}/lib/{fetched.manager.split('@')[0]}/{entry} \"$@\"\\n'"
        f" > {NODE_BIN}/{name} && chmod 755 {NODE_BIN}/{name} && "
        for name, entry in _entries(plan.manager))
    node = (f"mkdir -p {NODE_BIN} {NODE_HOME}/lib && ln -s /usr/bin/node {NODE_BIN}/node" if fetched.debian else
            f"{{ ls {STAGE}/debs/*.deb >/dev/null 2>&1 && dpkg -i {STAGE}/debs/*.deb >/dev/null || true; }} && "
            f"mkdir -p {NODE_BIN} {NODE_HOME}/lib {STAGE}/x && tar xzf {STAGE}/node.tgz -C {STAGE}/x "
            f"&& cp {STAGE}/x/package/bin/node {NODE_BIN}/node && rm -rf {STAGE}/x")
    toolchain = (f"{node} && tar xzf {STAGE}/manager.tgz -C {NODE_HOME}/lib && mv {NODE_HOME}/lib/package "
                 f"{NODE_HOME}/lib/{plan.manager} && {wrappers}node --version && {plan.manager} --version")
    steps = [(f"install Node {fetched.node} and {fetched.manager}", toolchain)]
    if fetched.lock_written:
        steps.append(("use the lock file resolved on the host", f"cp {STAGE}/package-lock.json {WORKSPACE}/"))
    steps.append((f"install the packages offline ({plan.manager}; their scripts run here)",
                  _install(dataclasses.replace(plan, legacy_peers=fetched.legacy_peers))))
    if fetched.tap_plugins:
        steps.append((f"build tap with its configured plugins ({', '.join(fetched.tap_plugins)})",
                      f"cd {WORKSPACE} && " + tapplugins.BUILD_TAP.format(stage=f"{STAGE}/{tapplugins.STAGED}")))
    steps.append(("move node_modules out of the workspace", MOVE_NODE_MODULES))
    return steps


def _entries(manager: str) -> list[tuple[str, str]]:
    """(command, script in the package) of each command the manager's package provides."""
    return {"npm": [("npm", "bin/npm-cli.js"), ("npx", "bin/npx-cli.js")],
            "yarn": [("yarn", "bin/yarn.js"), ("yarnpkg", "bin/yarn.js")],
            "pnpm": [("pnpm", "bin/pnpm.cjs"), ("pnpx", "bin/pnpx.cjs")]}[manager]


def _install(plan: NodePlan) -> str:
    cache = f"{STAGE}/cache"
    if plan.manager == "npm":
        command = (f"npm ci --offline --package-lock=true --no-audit --no-fund --cache {cache}"
                   f"{' --legacy-peer-deps' if plan.legacy_peers else ''}")
    elif plan.manager == "yarn":
        command = (f"yarn install --offline --non-interactive --no-progress --cache-folder {cache}"
                   f"{' --frozen-lockfile' if plan.lock else ''}")
    else:
        command = (f"pnpm install --offline --store-dir {cache} --cache-dir {STAGE}/{PNPM_METADATA} "
                   "--package-import-method copy "
                   f"--config.confirmModulesPurge=false{' --frozen-lockfile' if plan.lock else ''}")
    return f"{WITHOUT_AUTH} && {WITH_GIT} {{ {command}; }} > {STAGE}/install.log 2>&1; {SAY_ERROR}"


# A `prepare` script that installs git hooks (lefthook, husky, simple-git-hooks) fails outside a git
# repository, and the build's copy of the repository has no .git: it gets an empty one for the install,
# removed after it (SAY_ERROR), so the image's workspace holds none.
WITH_GIT = "{ [ -e .git ] || { git init -q . && touch .git/m3-made; }; } 2>/dev/null;"


# npm's lines around an error that do not say it: a failed script's own line is `command sh -c ...`.
NOT_THE_ERROR = "code|errno|syscall|path|command failed"


# The install's output, then, when it failed, the manager's own error line last, as `error: ...` (the line
# a failed build step reports), not npm's trailing notes about its log files.
SAY_ERROR = (f"s=$?; [ -e .git/m3-made ] && rm -rf .git; cat {STAGE}/install.log; if [ $s -ne 0 ]; then "
             f"grep -E '^(npm (ERR!|error)|\\[?ERR_PNPM|error )' "
             f"{STAGE}/install.log | grep -vE 'A complete log|Log files|npm (ERR!|error) ({NOT_THE_ERROR})( |$)' | head -1 "
             "| sed -E 's/^(npm (ERR!|error) |error )?/error: /'; exit $s; fi")


# The project's .npmrc keeps its settings in the build, not its credentials: an offline install needs none,
# and a `${NPM_TOKEN}` the container does not have would stop npm. (The copy is removed before the commit.)
WITHOUT_AUTH = ("for f in .npmrc .yarnrc; do if [ -f $f ]; then grep -viE '_auth|_password|token' $f > $f.m3 || true; "
                "mv $f.m3 $f; fi; done")


# pnpm 11+ checks before `pnpm run` that node_modules matches the lock, and some releases (magic-string's
# 11.13.1), finding each one moved out of the workspace and linked back (this environment's layout), run `pnpm
# install`, which fails with no network (its `pnpm run build` before vitest). The image's packages are the
# lock's, so the check is off in the image's own environment: for test_runner and for a model's `pnpm run
# test` through bash alike.
PNPM_SETTINGS = {"pnpm_config_verify_deps_before_run": "false", "npm_config_verify_deps_before_run": "false"}


def image_environment(root: Path) -> dict[str, str]:
    """The variables a Node environment's image sets for every command of its sandboxes: its package
    manager's settings for the environment's layout ({} without a package.json)."""
    if not wants_node(root):
        return {}
    return dict(PNPM_SETTINGS) if package_manager(root)[0] == "pnpm" else {}


def node_environment() -> dict[str, str]:
    """The variables every package-manager step in the build container gets: no network, no user config."""
    return {"npm_config_update_notifier": "false", "npm_config_userconfig": "/dev/null", "CI": "1",
            "npm_config_logs_max": "0",  # no "A complete log of this run ..." line in place of the error
            "npm_config_unsafe_perm": "true", "npm_config_cache": f"{STAGE}/cache", **NO_DOWNLOADS}


# Packages whose install script downloads a browser or a binary from the network, which the build
# container has not (yargs-parser's puppeteer: `node install.mjs` failed the build). Browser tests are not
# run here, so each is told to skip it, by the variable its own documentation names.
NO_DOWNLOADS = {"PUPPETEER_SKIP_DOWNLOAD": "1", "PUPPETEER_SKIP_CHROMIUM_DOWNLOAD": "1",
                "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1", "CYPRESS_INSTALL_BINARY": "0",
                "ELECTRON_SKIP_BINARY_DOWNLOAD": "1", "CHROMEDRIVER_SKIP_DOWNLOAD": "true",
                "GECKODRIVER_SKIP_DOWNLOAD": "true", "SAUCECTL_INSTALL_BINARY": "0"}


# Each top-level node_modules (not one inside another) moves to NODE_MODULES at the same relative path;
# links inside that point into the workspace (a monorepo's own packages, `file:` dependencies) become
# absolute first, since relative ones would point into NODE_MODULES after the move.
MOVE_NODE_MODULES = f"""cd {WORKSPACE} && python3 - <<'EOF'
import os, shutil
ws, out = {WORKSPACE!r}, {NODE_MODULES!r}
found = []
for top, dirs, _ in os.walk(ws):
    dirs[:] = [d for d in dirs if d != ".git"]
    if "node_modules" in dirs:
        dirs.remove("node_modules")
        found.append(os.path.join(top, "node_modules"))
for nm in found:
    for top, dirs, files in os.walk(nm):
        for name in dirs + files:
            link = os.path.join(top, name)
            if os.path.islink(link):
                real = os.path.realpath(link)
                if real.startswith(ws + "/") and "/node_modules/" not in real[len(ws):] + "/":
                    os.unlink(link)
                    os.symlink(real, link)
os.makedirs(out, exist_ok=True)
rels = []
for nm in found:
    rel = os.path.relpath(os.path.dirname(nm), ws)
    os.makedirs(os.path.join(out, rel), exist_ok=True)
    shutil.move(nm, os.path.join(out, rel, "node_modules"))
    rels.append(rel)
    for name in (".cache", ".vite-temp", ".vite", ".vitest"):
        # tools write there (AVA's and babel's caches, vite's bundled TypeScript config): the image is
        # read-only to the sandbox's user, /tmp is not
        cache = os.path.join(out, rel, "node_modules", name)
        if not os.path.lexists(cache):
            os.symlink("/tmp", cache)
with open({NODE_LINKS!r}, "w") as f:
    f.write("".join(r + chr(10) for r in rels))
print(len(rels), "node_modules directories kept")
EOF"""
