"""Configuration: one nested model, `Settings`, layered from files, the environment and flags.

`Settings` is the agent's own `AgentConfig` (sections `model`, `sandbox`, `context`, `thinking`,
`stall`, `limits`) plus what only the commands use: `serve`, the `[fix]` section and the `[eval]`
section (batch reuse: `shared_share`, `delta`, which were `[context]` settings: a file, variable or
flag that still names them there is an error that names their new place). Every layer
names settings by the same path, `section.field`:

1. defaults (the field defaults of each section's model)
2. the config file: `m3-agent.toml` at the repository root, or, when that file is absent, the
   `[tool.m3-agent]` table of the repository's `pyproject.toml` (never both: like ruff); its tables
   are the sections (`[limits] max_turns = 30`)
3. environment variables `M3_AGENT_<SECTION>__<FIELD>` (e.g. `M3_AGENT_LIMITS__MAX_TURNS`), and
   `GITHUB_TOKEN` / `GH_TOKEN` for `fix.github_token`
4. command-line flags (`--max-turns` sets `limits.max_turns`: `FLAGS` lists them)

`load_settings` returns the effective `Settings` together with where each value came from;
`m3-agent config show` prints that table with secrets masked.
"""

from __future__ import annotations

import json
import os
import sys
from operator import attrgetter
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any, Literal, Optional, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError
from pydantic.fields import FieldInfo

from m3_agent.agent.config import MOVED_TO_EVAL, AgentConfig
from m3_agent.agent.model import NO_KEY
from m3_agent.errors import UsageError, first_validation_error
from m3_agent.redact import mask
from m3_agent.agent.access import ApiKey, Launcher, plain_http_warning, resolve_endpoint

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_PREFIX = "M3_AGENT_"
ENV_NESTING = "__"
CONFIG_FILE = "m3-agent.toml"
PYPROJECT_TABLE = "tool.m3-agent"
# Checked in this order when M3_AGENT_FIX__GITHUB_TOKEN is unset; the first one set wins.
GITHUB_TOKEN_ENVS = ("GITHUB_TOKEN", "GH_TOKEN")

# The commands' flags and the setting each one sets (flags kept their names when settings nested);
# `setting_flags` makes them typer options, each with its setting's type and description.
FLAGS = {
    "--base-url": "model.base_url",
    "--api-key": "model.api_key",
    "--model": "model.name",
    "--serve": "serve",
    "--max-turns": "limits.max_turns",
    "--test-cmd": "test_cmd",
    "--time-limit": "limits.max_wall_s",
    "--thinking": "thinking.policy",
    "--sandbox-image": "sandbox.image",
    "--image": "sandbox.image",
    "--keep-broken-env": "sandbox.keep_broken_env",
    "--images": "fix.images",
    "--include-uncommitted": "fix.include_uncommitted",
    "--github-api-url": "fix.github_api_url",
    "--output-dir": "fix.output_dir",
    "--push": "fix.push",
    "--remote": "fix.remote",
    "--pr": "fix.pr",
    "--ready": "fix.ready",
    "--pr-anyway": "fix.pr_anyway",
    "--comment": "fix.comment",
    "--trajectory-url": "fix.trajectory_url",
}
OFF_SWITCHES = {"--ready": "--draft"}  # a yes/no flag's other half, when it is not --no-<flag>


class FixConfig(BaseModel):
    """What only `m3-agent fix` uses: the `[fix]` section."""

    model_config = ConfigDict(extra="forbid")

    images: Literal["auto", "on", "off"] = Field(
        "auto", description="issue images as image inputs: auto = send, resend as text if the endpoint refuses"
    )
    github_api_url: str | None = Field(
        None, description="GitHub REST API base; None = derived from the origin remote (GHE: https://HOST/api/v3)"
    )
    github_token: SecretStr | None = Field(None, description="GitHub token (also read from GITHUB_TOKEN / GH_TOKEN)")
    include_uncommitted: bool = Field(False, description="copy uncommitted changes of the working tree into the run")
    output_dir: Path = Field(Path(".m3-agent"), description="patches and trajectories; relative to the repository")
    branch_prefix: str = Field("m3-agent/issue-", min_length=1, description="result branch name prefix")
    push: bool = Field(False, description="push the fix branch to `remote` (never forced; a name taken there gets -2, ...)")
    remote: str = Field("origin", min_length=1, description="the remote the fix branch is pushed to")
    pr: bool = Field(False, description="open a pull request for the fix (pushes first); runs not resolved comment instead")
    ready: bool = Field(False, description="open the pull request ready for review instead of as a draft")
    pr_anyway: bool = Field(False, description="open the pull request for unverified and failing runs too")
    comment: bool = Field(False, description="comment on the issue with what happened: the pull request, or why not")
    trajectory_url: str | None = Field(
        None, description="where the trajectory can be read, linked from the comment and pull request; {file} = its name"
    )
    github_max_wait_s: float = Field(120.0, ge=0, description="longest wait for GitHub's rate limit, per request")


class ReuseConfig(BaseModel):
    """How `eval run` makes a batch's first requests share the server's prefix cache: the `[eval]` section.

    Only `eval run` reads it (`m3_agent.evals.reuse`); plain `fix` packs without it."""

    model_config = ConfigDict(extra="forbid")

    shared_share: float = Field(0.0, ge=0.0, lt=1.0, description="share of a budgeted pack filled with the same "
                                "files for every issue (instances of one repository: the server's prefix cache "
                                "serves it across them; the rest is ranked by the issue)")
    delta: bool = Field(True, description="delta packs: an instance whose whole repository fits shows the files "
                        "of its run's root commit, then the diffs to its own commit (a run's instances then "
                        "share nearly all of their first request)")


# Settings that moved: (old dotted path -> new one); naming the old one is an error that names the new one.
MOVED = {f"context.{name}": f"eval.{name}" for name in sorted(MOVED_TO_EVAL)}


def _moved(path: str, where: str) -> UsageError:
    new = MOVED[path]
    return UsageError(f"{where}: '{path}' moved to '{new}' (only `eval run` uses it): "
                      f"set {new.split('.')[1]} in the [eval] table, or {env_name(new)}")


class Settings(AgentConfig):
    """The agent's config plus the commands' own settings; build it with `load_settings`."""

    serve: str | None = Field(
        None, description="serving profile: reuse a healthy endpoint for it (model.base_url, if set) or launch one"
    )
    fix: FixConfig = Field(default_factory=FixConfig)
    eval: ReuseConfig = Field(default_factory=ReuseConfig)
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)  # set by load_settings

    def source_of(self, path: str) -> str:
        """Where the value at `path` came from: `flag --api-key`, `env NAME`, a file, `default`."""
        return self._sources.get(path, f"setting {path}")

    def model_key(self) -> ApiKey:
        """The configured API key with where it came from (a 401 names both, the key masked)."""
        return ApiKey(value=self.model.api_key, source=self.source_of("model.api_key"))

    def agent_config(self, *, base_url: str | None = None, api_key: SecretStr | None = None,
                     context_window: int | None = None) -> AgentConfig:
        """The `AgentConfig` part, with the resolved endpoint (`base_url`) and its key in place of the settings'.

        `context_window` (the window `serve start` recorded for that endpoint) applies when
        `[model] context_window` is unset."""
        values = self.model_dump(include=set(AgentConfig.model_fields))  # a copy: settings stay as loaded
        if context_window is not None and values["model"].get("context_window") is None:
            values["model"]["context_window"] = context_window
        if base_url is not None:
            values["model"]["base_url"] = base_url
        if api_key is not None:
            values["model"]["api_key"] = api_key
        return AgentConfig.model_validate(values)

    def resolved_agent_config(self, serving: Launcher, *, check: bool = True,
                              warn: Callable[[str], None] | None = None) -> AgentConfig:
        """`agent_config` for the endpoint `model.base_url` names or `serving` brings up, with its key and window;
        `check`: fail now on one that does not answer or refuses the key; `warn`: told of plain http."""
        endpoint = resolve_endpoint(self.model.base_url, key=self.model_key(), serving=serving)
        if check:
            endpoint.check()
        if warn and self.model.warn_plain_http and (warning := plain_http_warning(endpoint.base_url)):
            warn(warning)
        return self.agent_config(base_url=endpoint.base_url, api_key=endpoint.key_secret, context_window=endpoint.window)


def setting_paths(model: type[BaseModel] = Settings, prefix: str = "") -> dict[str, FieldInfo]:
    """Every setting of `model` by dotted path (sections walked), with its pydantic field, in field order."""
    paths: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):  # a section
            paths.update(setting_paths(field.annotation, f"{prefix}{name}."))
        else:
            paths[prefix + name] = field
    return paths


PATHS = setting_paths()
SECTIONS = frozenset(p.rsplit(".", 1)[0] for p in PATHS if "." in p)


def _hint(name: str) -> str:
    """Where a setting named `name` lives now, when it is a field of some section."""
    homes = [p for p in PATHS if p.rsplit(".", 1)[-1] == name]
    return f" (did you mean {' or '.join(homes)}?)" if homes else ""


def _flatten(table: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """A file's tables as {dotted path: value}; `max-turns` is read as `max_turns`; unknown keys fail."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        path = prefix + key.replace("-", "_")
        if path in SECTIONS and isinstance(value, dict):
            out.update(_flatten(value, where, path + "."))
        elif path in PATHS:
            out[path] = value
        elif path in SECTIONS:
            raise UsageError(f"{where}: '{path}' is a section: give it as a table, [{path}]")
        elif path in MOVED:
            raise _moved(path, where)
        else:
            raise UsageError(f"{where}: unknown setting '{path}'{_hint(path.rsplit('.', 1)[-1])}")
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"cannot read config file {path}: {e}") from e


def read_config_file(root: Path, explicit: Path | str | None = None) -> dict[str, tuple[Any, str]]:
    """The file layer for `root`: `explicit`, else `m3-agent.toml`, else pyproject's table; {} when none applies.

    The tables are flattened to dotted paths and checked: {dotted path: (value, the file's label)}.
    """
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise UsageError(f"config file not found: {path}")
        data, label = _read_toml(path), str(path)
        if path.name == "pyproject.toml":
            data = data.get("tool", {}).get("m3-agent", {})
    elif (root / CONFIG_FILE).is_file():
        data, label = _read_toml(root / CONFIG_FILE), CONFIG_FILE
    elif (root / "pyproject.toml").is_file():
        tool = _read_toml(root / "pyproject.toml").get("tool", {})
        if not isinstance(tool, dict) or "m3-agent" not in tool:
            return {}
        data, label = tool["m3-agent"], f"pyproject.toml ({PYPROJECT_TABLE})"
    else:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{label}: {PYPROJECT_TABLE} must be a table")
    return {path: (value, label) for path, value in _flatten(data, label).items()}


def env_name(path: str) -> str:
    """The environment variable of a setting: `limits.max_turns` -> `M3_AGENT_LIMITS__MAX_TURNS`."""
    return ENV_PREFIX + path.replace(".", ENV_NESTING).upper()


def _env_value(path: str, given: str, value: str) -> Any:
    """A variable's value: JSON for list- and dict-valued settings, else the text as it is."""
    annotation = PATHS[path].annotation
    kinds = {get_origin(a) or a for a in (annotation, *get_args(annotation))}
    if not kinds & {list, dict}:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise UsageError(f"env {given}: not JSON ({e.msg}): give a JSON list or object") from None


def _refuse_flat_names(upper: dict[str, tuple[str, str]]) -> None:
    """Fail on `M3_AGENT_MAX_TURNS`-style names of settings that now live in a section."""
    for var, (given, _) in upper.items():
        name = var[len(ENV_PREFIX):].lower()
        if not var.startswith(ENV_PREFIX) or ENV_NESTING in name or name in PATHS:
            continue
        # `max_turns` (a field's name), `sandbox_image` (section and field joined) or `model` (a section)
        homes = [p for p in PATHS if name in (p.rsplit(".", 1)[-1], p.replace(".", "_")) or p.startswith(name + ".")]
        if homes:
            example = " or ".join(env_name(p) for p in homes[:2])
            raise UsageError(f"env {given}: settings are nested: use M3_AGENT_<SECTION>__<FIELD>, e.g. {example}")


def read_env(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, tuple[Any, str]]:
    """Settings found in the environment: {dotted path: (raw value, "env NAME")}.

    A variable named like a setting of the flat layout (`M3_AGENT_MAX_TURNS`) is an error that names
    the nested variable, so that an old CI configuration does not go silently unread.
    """
    env = os.environ if environ is None else environ
    upper = {k.upper(): (k, v) for k, v in env.items() if v != ""}
    found: dict[str, tuple[Any, str]] = {}
    for path in PATHS:
        if env_name(path) in upper:
            given, value = upper[env_name(path)]
            found[path] = (_env_value(path, given, value), f"env {given}")
    _refuse_flat_names(upper)
    for path in MOVED:
        if env_name(path) in upper:
            raise _moved(path, f"env {upper[env_name(path)][0]}")
    token_var = next((var for var in GITHUB_TOKEN_ENVS if env.get(var)), None)
    if token_var and "fix.github_token" not in found:
        found["fix.github_token"] = (env[token_var], f"env {token_var}")
    return found


def read_flags(flags: dict[str, Any] | None) -> dict[str, tuple[Any, str]]:
    """Flags given (value not None), keyed by flag (`--max-turns`) or dotted path: {path: (value, label)}."""
    found: dict[str, tuple[Any, str]] = {}
    for key, value in (flags or {}).items():
        path = FLAGS.get(key, key)
        if path in MOVED:
            raise _moved(path, f"override {key}")
        if path not in PATHS:
            raise UsageError(f"unknown setting '{key}'{_hint(key)}")
        if value is not None:
            found[path] = (value, f"flag {key}" if key.startswith("-") else f"override {key}")
    return found


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        *sections, name = path.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return out


def _validated(layered: dict[str, tuple[Any, str]]) -> Settings:
    """One validation of the merged layers; the first error names the layer its value came from."""
    try:
        return Settings.model_validate(_nested({path: value for path, (value, _) in layered.items()}))
    except ValidationError as e:
        path, message = first_validation_error(e, top="?")
        known = [p for p in layered if path == p or path.startswith(p + ".")]
        where = layered[known[0]][1] if known else "default"
        raise UsageError(f"{where}: {path}: {message}") from None


def load_settings(
    root: Path | str = ".",
    flags: dict[str, Any] | None = None,
    *,
    config_file: Path | str | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """The effective settings for repository `root` and where each value came from.

    `flags` maps flags (`--max-turns`, see FLAGS) or dotted paths (`limits.max_turns`) to values
    (None = not given). `config_file` replaces the file lookup (also `M3_AGENT_CONFIG`). Bad keys or
    values raise a one-line UsageError naming the layer they came from. The sources map every
    dotted path to `default`, the file's name, `env NAME`, `flag --name` or `override path`.
    """
    env = os.environ if environ is None else environ
    layered = read_config_file(Path(root), config_file or env.get(ENV_PREFIX + "CONFIG"))
    layered.update(read_env(env))
    layered.update(read_flags(flags))
    settings = _validated(layered)
    sources = {path: layered[path][1] if path in layered else "default" for path in PATHS}
    settings._sources = dict(sources)
    return settings, sources


def _shown(value: Any) -> str:
    if isinstance(value, SecretStr):  # no key (the SDK's placeholder) shows as unset, not as a masked key
        secret = value.get_secret_value()
        return mask(secret) if secret and secret != NO_KEY else "-"
    if value is None:
        return "-"
    text = " ".join(str(value).split())  # one line: the system prompt is a paragraph
    return text if len(text) <= 80 else text[:79] + "…"


def display_rows(settings: Settings, sources: dict[str, str]) -> list[tuple[str, str, str]]:
    """(dotted path, shown value, source) for every setting, secrets masked."""
    return [(path, _shown(attrgetter(path)(settings)), sources.get(path, "default")) for path in PATHS]


def flag_parameter(flag: str) -> str:
    """The Python parameter name a flag gets in a command: `--max-turns` -> `max_turns`."""
    return flag.lstrip("-").replace("-", "_")


def setting_flags(*flags: str, repeated: Mapping[str, str] | None = None,
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a typer command's setting flags once, here: each flag of `FLAGS` becomes an option with
    its setting's type and field description. The command receives the values as `flags`
    ({flag: value}, None: not given), ready for `load_settings`; a yes/no setting gets `--no-<flag>`.
    A flag of `repeated` may be given more than once (its value a list; the text says what for).
    """
    import functools
    import inspect

    import typer

    def option(flag: str) -> inspect.Parameter:
        field = PATHS[FLAGS[flag]]
        kinds = [a for a in get_args(field.annotation) or (field.annotation,) if a is not type(None)]
        kind = kinds[0] if len(kinds) == 1 and kinds[0] in (bool, int, float, Path) else str
        names = f"{flag}/{OFF_SWITCHES.get(flag, '--no-' + flag[2:])}" if kind is bool else flag
        many = (repeated or {}).get(flag)
        return inspect.Parameter(flag_parameter(flag), inspect.Parameter.KEYWORD_ONLY,
                                 annotation=Optional[list[kind] if many else kind], default=typer.Option(
                                     None, names, help=f"{field.description}; {many}" if many else field.description,
                                     show_default=False))

    def declare(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        params = [p for p in signature.parameters.values() if p.name != "flags"] + [option(f) for f in flags]

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            given = {f: values.pop(flag_parameter(f)) for f in flags}
            return command(**values, flags=given)

        run.__signature__ = signature.replace(parameters=params)  # what typer reads
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return declare
