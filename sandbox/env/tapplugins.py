"""tap 18+'s plugins that a project configures but does not install, read on the host.

tap builds its Test class from its plugins. At a run, when the plugins its config names (`.taprc`'s or
package.json `tap`'s `plugin` list) are not those it was built with, tap rebuilds it (`tap build`): each
plugin that is not installed is looked up in the registry (for the release made for the installed
`@tapjs/core`) and npm-installed into `.tap/plugins`, then the class is generated again. A sandbox has no
network, so such a project's tests never start (lru-cache's `.taprc` names `@tapjs/clock`, which neither its
package.json nor its lock holds). The builder does the same ahead of time: the host fetches each missing
plugin (`nodeenv.fetch_node`), the build container puts it in `.tap/plugins` and runs tap's own generator
(BUILD_TAP), so the image's tap is built with the configured plugins and a run has nothing to rebuild.

    missing = missing_plugins(root, lock_text)      # ["@tapjs/clock"]
    core = locked_core(lock_text)                    # "4.5.6": the plugin release must be made for it
    version = plugin_release(rows, core)             # rows: `npm view NAME@>=0 version peerDependencies`
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from m3_agent.sandbox.env.nodeversion import manifest
from m3_agent.sandbox.env.testneeds import FolderFiles

CORE = "@tapjs/core"
STAGED = "tap-plugins"  # the stage's folder with the plugins' node_modules, fetched on the host
_NAME = re.compile(r"^(@[^./_][^/]*/[^@._/][^@]*|[^._@/][^@/]*)(?:@(.*))?$")  # tap's own pattern for a package


def configured_plugins(root: Path) -> list[str]:
    """The plugins a project's tap config adds (`.taprc`'s `plugin`, else package.json `tap.plugin`): the
    registry names, without exclusions (`!@tapjs/mock`) and local paths."""
    import yaml

    listed: object = None
    taprc = root / ".taprc"
    if taprc.is_file():
        try:
            listed = (yaml.safe_load(taprc.read_text(errors="replace")) or {}).get("plugin")
        except (yaml.YAMLError, AttributeError):
            listed = None
    if listed is None:
        tap = manifest(FolderFiles(root)).get("tap")
        listed = tap.get("plugin") if isinstance(tap, dict) else None
    names = [listed] if isinstance(listed, str) else listed if isinstance(listed, list) else []
    return [n for n in names if isinstance(n, str) and not n.startswith(("!", ".", "/")) and _NAME.match(n)]


def locked_core(lock_text: str) -> str | None:
    """The `@tapjs/core` version a lock file holds (npm's, yarn 1's or pnpm's); None: no tap 18+ there."""
    try:
        packages = json.loads(lock_text).get("packages") or {}
        version = (packages.get(f"node_modules/{CORE}") or {}).get("version")
        return version if isinstance(version, str) else None
    except (ValueError, AttributeError):
        pass
    found = (re.search(rf'^"?{re.escape(CORE)}@[^\n]*:\n\s+version:? "?(\d+\.\d+\.\d+)', lock_text, re.M)  # yarn
             or re.search(rf"[/'\s]{re.escape(CORE)}@(\d+\.\d+\.\d+)", lock_text))  # pnpm
    return found.group(1) if found else None


def missing_plugins(root: Path, lock_text: str) -> list[str]:
    """The configured plugins (with a version range, when given) that the lock does not install: tap would
    fetch them at its first run. None for a project without tap 18+."""
    if locked_core(lock_text) is None:
        return []
    out = []
    for plugin in configured_plugins(root):
        name = _NAME.match(plugin).group(1)
        if not re.search(rf"(^|[\s/'\"]){re.escape(name)}(@|[\"':])", lock_text, re.M):
            out.append(plugin)
    return out


def plugin_release(rows: list[dict], core: str, wanted: str = "") -> str | None:
    """The newest release (of `rows`: version and peerDependencies) made for `core`, as tap chooses; when the
    registry has none, the newest made for a `@tapjs/core` of the same minor (tap releases its plugins with
    each core; a mirror may lack that one). `wanted`: the config's own range, which must hold too."""
    import nodesemver

    def fits(row: dict, same_minor: bool) -> bool:
        peer = (row.get("peerDependencies") or {}).get(CORE)
        version = str(row.get("version", ""))
        if not re.match(r"\d+\.\d+\.\d+$", version) or (wanted and not nodesemver.satisfies(version, wanted)):
            return False
        if not isinstance(peer, str):
            return True
        if same_minor:
            return peer.lstrip("^~=").split(".")[:2] == core.split(".")[:2]
        return bool(nodesemver.satisfies(core, peer, loose=True))

    for same_minor in (False, True):
        found = [str(r["version"]) for r in rows if isinstance(r, dict) and fits(r, same_minor)]
        if found:
            return max(found, key=lambda v: tuple(int(p) for p in v.split(".")))
    return None


def split(plugin: str) -> tuple[str, str]:
    """(name, range) of a configured plugin: `@tapjs/clock@^3` -> ("@tapjs/clock", "^3")."""
    found = _NAME.match(plugin)
    return (found.group(1), found.group(2) or "") if found else (plugin, "")


# In the build container, after the install, from the workspace: the fetched plugins go where tap puts them
# (.tap/plugins/node_modules, which then moves out and is linked back like every node_modules), and tap's own
# generator builds its Test class with the plugin list its config gives (defaults included), as `tap build`
# does without its registry look-up.
BUILD_TAP = """mkdir -p .tap/plugins && cp -a {stage}/node_modules .tap/plugins/ && node --input-type=module -e '
import {{ TapConfig }} from "@tapjs/config";
import {{ spawnSync }} from "node:child_process";
import {{ createRequire }} from "node:module";
import {{ dirname, join }} from "node:path";
const config = await TapConfig.load();
const manifest = createRequire(process.cwd() + "/x").resolve("@tapjs/test/package.json");
const bin = createRequire(manifest)(manifest).bin["generate-tap-test-class"];
const run = spawnSync(process.execPath, [join(dirname(manifest), bin), ...config.pluginList], {{ stdio: "inherit" }});
process.exit(run.status ?? 1);
'"""
