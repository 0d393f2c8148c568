"""Configuration: one settings model, layered from files, the environment and flags.

Precedence, lowest to highest:

1. defaults (the field defaults below)
2. the config file: `m3-agent.toml` at the repository root, or, when that file is absent,
   the `[tool.m3-agent]` table of the repository's `pyproject.toml` (never both: like ruff)
3. environment variables `M3_AGENT_<FIELD>` (and `GITHUB_TOKEN` / `GH_TOKEN` for `github_token`)
4. command-line flags

`load_settings` returns the effective `Settings` together with where each value came from;
`m3-agent config show` prints that table with secrets masked.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from m3_agent.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_PREFIX = "M3_AGENT_"
CONFIG_FILE = "m3-agent.toml"
PYPROJECT_TABLE = "tool.m3-agent"
# Checked in this order when M3_AGENT_GITHUB_TOKEN is unset; the first one set wins.
GITHUB_TOKEN_ENVS = ("GITHUB_TOKEN", "GH_TOKEN")
# Flags whose name is not the setting's name with dashes.
FLAG_NAMES = {"time_limit_s": "--time-limit"}


class Settings(BaseSettings):
    """Every setting of `m3-agent fix` and the library, with its default.

    Built directly (`Settings()`), it reads defaults and `M3_AGENT_*` variables only; use
    `load_settings` for the full layering (file, environment, flags) and provenance.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # The model endpoint.
    base_url: str | None = Field(None, description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    api_key: SecretStr = Field(SecretStr("EMPTY"), description="API key sent to the endpoint")
    model: str | None = Field(None, description="served model name; None = the first one /v1/models lists")
    serve: str | None = Field(
        None, description="serving profile: reuse a healthy endpoint for it (base_url, if set) or launch one"
    )
    images: Literal["auto", "on", "off"] = Field(
        "auto", description="issue images as image inputs: auto = send, resend as text if the endpoint refuses"
    )

    # The agent loop.
    thinking: Literal["controller", "enabled", "disabled", "adaptive"] = Field(
        "controller", description="thinking mode policy: per-turn controller, or one fixed mode"
    )
    max_turns: int = Field(40, ge=1, description="turn limit")
    time_limit_s: float | None = Field(None, gt=0, description="wall-clock limit of one run, seconds")
    token_limit: int | None = Field(None, gt=0, description="total token limit of one run")
    stall_detection: bool = Field(True, description="stop runs that loop without progress")

    # The sandbox.
    sandbox_image: str | None = Field(None, description="Docker image the tools run in; None = the project image")
    sandbox_memory: str = Field("4g", description="container memory limit")
    sandbox_cpus: float = Field(2.0, gt=0, description="container CPU limit")

    # Issues and git.
    github_api_url: str | None = Field(
        None, description="GitHub REST API base; None = derived from the origin remote (GHE: https://HOST/api/v3)"
    )
    github_token: SecretStr | None = Field(None, description="GitHub token (also read from GITHUB_TOKEN / GH_TOKEN)")
    include_uncommitted: bool = Field(False, description="copy uncommitted changes of the working tree into the run")
    output_dir: Path = Field(Path(".m3-agent"), description="patches and trajectories; relative to the repository")
    branch_prefix: str = Field("m3-agent/issue-", min_length=1, description="result branch name prefix")
    pack_include: list[str] = Field(default_factory=list, description="globs: pack only matching files")
    pack_exclude: list[str] = Field(default_factory=list, description="globs: never pack matching files")
    pack_max_file_bytes: int | None = Field(None, gt=0, description="skip larger files when packing; None = default")

    # Everything else the agent loop takes, for advanced use: `[agent]` / `[agent.stall]` tables.
    agent: dict[str, Any] = Field(default_factory=dict, description="extra AgentConfig fields (advanced)")


# Table-valued settings: their environment variable holds JSON.
JSON_FIELDS = frozenset({"agent", "pack_include", "pack_exclude"})


def _normalise_keys(table: dict[str, Any], where: str) -> dict[str, Any]:
    """Accept `max-turns` as well as `max_turns`; reject unknown keys with the file named."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in Settings.model_fields:
            known = ", ".join(sorted(Settings.model_fields))
            raise UsageError(f"{where}: unknown setting '{key}' (known: {known})")
        out[name] = value
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"cannot read config file {path}: {e}") from e


def read_config_file(root: Path, explicit: Path | str | None = None) -> tuple[dict[str, Any], str] | None:
    """The file layer for `root` and its label: `explicit`, else `m3-agent.toml`, else pyproject's table.

    None when no file applies. Keys are normalised (`max-turns` -> `max_turns`) and checked.
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
            return None
        data, label = tool["m3-agent"], f"pyproject.toml ({PYPROJECT_TABLE})"
    else:
        return None
    if not isinstance(data, dict):
        raise UsageError(f"{label}: {PYPROJECT_TABLE} must be a table")
    return _normalise_keys(data, label), label


def read_env(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, tuple[Any, str]]:
    """Settings found in the environment: {field: (raw value, "env NAME")}."""
    env = os.environ if environ is None else environ
    found: dict[str, tuple[Any, str]] = {}
    upper = {k.upper(): (k, v) for k, v in env.items()}
    for name in Settings.model_fields:
        var = ENV_PREFIX + name.upper()
        if var in upper and upper[var][1] != "":
            given, value = upper[var]
            if name in JSON_FIELDS:
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise UsageError(f"env {given}: not JSON ({e.msg}): give a JSON object") from None
            found[name] = (value, f"env {given}")
    if "github_token" not in found:
        for var in GITHUB_TOKEN_ENVS:
            if env.get(var):
                found["github_token"] = (env[var], f"env {var}")
                break
    return found


def load_settings(
    root: Path | str = ".",
    flags: dict[str, Any] | None = None,
    *,
    config_file: Path | str | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """The effective settings for repository `root` and where each value came from.

    `flags` maps field names to values given on the command line (None = not given).
    `config_file` replaces the file lookup (also `M3_AGENT_CONFIG`). Bad keys or values raise
    UsageError naming the layer they came from.
    """
    env = os.environ if environ is None else environ
    layered: dict[str, tuple[Any, str]] = {}
    file_layer = read_config_file(Path(root), config_file or env.get(ENV_PREFIX + "CONFIG"))
    if file_layer:
        table, label = file_layer
        layered.update({k: (v, label) for k, v in table.items()})
    layered.update(read_env(env))
    for name, value in (flags or {}).items():
        if name not in Settings.model_fields:
            raise UsageError(f"unknown setting '{name}'")
        if value is not None:
            layered[name] = (value, f"flag {FLAG_NAMES.get(name, '--' + name.replace('_', '-'))}")
    values = {k: v for k, (v, _) in layered.items()}
    try:
        settings = _LayeredSettings(**values)
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "?"
        where = layered.get(field, (None, "default"))[1]
        raise UsageError(f"{where}: {field}: {first['msg']}") from None
    sources = {name: layered[name][1] if name in layered else "default" for name in Settings.model_fields}
    return settings, sources


class _LayeredSettings(Settings):
    """Settings built from the constructor only: `load_settings` has already read every layer."""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, **_sources):
        """Only the values given: no second, implicit read of the environment."""
        return (init_settings,)


def mask(value: str) -> str:
    """A secret as it may be shown: its last four characters at most."""
    if not value:
        return ""
    return "****" + value[-4:] if len(value) >= 12 else "****"


def display_rows(settings: Settings, sources: dict[str, str]) -> list[tuple[str, str, str]]:
    """(name, shown value, source) for every setting, secrets masked."""
    rows = []
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            shown = mask(value.get_secret_value())
        elif value is None:
            shown = "-"
        else:
            shown = str(value)
        rows.append((name, shown, sources.get(name, "default")))
    return rows
