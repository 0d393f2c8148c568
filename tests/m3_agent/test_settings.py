"""Configuration layering: defaults < config file < M3_AGENT_* environment < flags, with provenance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m3_agent.settings import Settings, display_rows, load_settings, mask
from m3_agent.errors import UsageError
from tests.fix.test_fix_sources import cli_main  # noqa: F401, F811 - the in-process CLI fixture


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_apply_when_nothing_is_configured(tmp_path):
    settings, sources = load_settings(tmp_path, environ={})
    assert settings.max_turns == Settings.model_fields["max_turns"].default
    assert settings.base_url is None
    assert set(sources.values()) == {"default"}
    assert set(sources) == set(Settings.model_fields)


def test_m3_agent_toml_is_read_with_kebab_or_snake_keys(tmp_path):
    write(tmp_path / "m3-agent.toml", 'base_url = "http://127.0.0.1:9/v1"\nmax-turns = 7\n[agent]\nmax_tokens = 2048\n')
    settings, sources = load_settings(tmp_path, environ={})
    assert settings.base_url == "http://127.0.0.1:9/v1"
    assert settings.max_turns == 7
    assert settings.agent == {"max_tokens": 2048}
    assert sources["max_turns"] == "m3-agent.toml"
    assert sources["thinking"] == "default"


def test_pyproject_table_is_used_only_without_m3_agent_toml(tmp_path):
    write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n[tool.m3-agent]\nmax_turns = 11\nthinking = "enabled"\n')
    settings, sources = load_settings(tmp_path, environ={})
    assert (settings.max_turns, settings.thinking) == (11, "enabled")
    assert sources["max_turns"] == "pyproject.toml (tool.m3-agent)"

    write(tmp_path / "m3-agent.toml", "max_turns = 5\n")
    settings, sources = load_settings(tmp_path, environ={})
    assert settings.max_turns == 5
    assert settings.thinking == "controller"  # the pyproject table is not merged underneath
    assert sources["thinking"] == "default"


def test_pyproject_without_the_table_is_ignored(tmp_path):
    write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n')
    _, sources = load_settings(tmp_path, environ={})
    assert set(sources.values()) == {"default"}


def test_environment_overrides_file_and_flags_override_environment(tmp_path):
    write(tmp_path / "m3-agent.toml", "max_turns = 7\nsandbox_cpus = 1.5\nimages = 'off'\n")
    env = {"M3_AGENT_MAX_TURNS": "9", "m3_agent_images": "on"}
    settings, sources = load_settings(tmp_path, environ=env)
    assert settings.max_turns == 9 and sources["max_turns"] == "env M3_AGENT_MAX_TURNS"
    assert settings.images == "on" and sources["images"] == "env m3_agent_images"
    assert settings.sandbox_cpus == 1.5 and sources["sandbox_cpus"] == "m3-agent.toml"

    settings, sources = load_settings(tmp_path, {"max_turns": 3, "images": None, "time_limit_s": 60}, environ=env)
    assert settings.max_turns == 3 and sources["max_turns"] == "flag --max-turns"
    assert sources["time_limit_s"] == "flag --time-limit"
    assert settings.images == "on"  # a flag left unset (None) does not override


def test_github_token_from_standard_variables_in_order(tmp_path):
    settings, sources = load_settings(tmp_path, environ={"GH_TOKEN": "gh-token", "GITHUB_TOKEN": "github-token"})
    assert settings.github_token.get_secret_value() == "github-token"
    assert sources["github_token"] == "env GITHUB_TOKEN"

    settings, sources = load_settings(tmp_path, environ={"GH_TOKEN": "gh-token"})
    assert sources["github_token"] == "env GH_TOKEN"

    settings, sources = load_settings(
        tmp_path, environ={"GH_TOKEN": "gh-token", "M3_AGENT_GITHUB_TOKEN": "own-token"}
    )
    assert settings.github_token.get_secret_value() == "own-token"
    assert sources["github_token"] == "env M3_AGENT_GITHUB_TOKEN"


def test_unknown_key_in_file_names_the_file(tmp_path):
    write(tmp_path / "m3-agent.toml", "max_turn = 3\n")
    with pytest.raises(UsageError, match=r"m3-agent.toml: unknown setting 'max_turn'"):
        load_settings(tmp_path, environ={})


def test_bad_value_names_the_layer_it_came_from(tmp_path):
    with pytest.raises(UsageError, match=r"env M3_AGENT_MAX_TURNS: max_turns: .*integer"):
        load_settings(tmp_path, environ={"M3_AGENT_MAX_TURNS": "many"})
    with pytest.raises(UsageError, match=r"flag --thinking: thinking:"):
        load_settings(tmp_path, {"thinking": "sometimes"}, environ={})
    write(tmp_path / "m3-agent.toml", "max_turns = [")
    with pytest.raises(UsageError, match="cannot read config file"):
        load_settings(tmp_path, environ={})


def test_explicit_config_file_replaces_the_lookup(tmp_path):
    write(tmp_path / "m3-agent.toml", "max_turns = 7\n")
    other = write(tmp_path / "team.toml", "max_turns = 21\n")
    settings, sources = load_settings(tmp_path, config_file=other, environ={})
    assert settings.max_turns == 21 and sources["max_turns"] == str(other)
    settings, _ = load_settings(tmp_path, environ={"M3_AGENT_CONFIG": str(other)})
    assert settings.max_turns == 21
    with pytest.raises(UsageError, match="config file not found"):
        load_settings(tmp_path, config_file=tmp_path / "missing.toml", environ={})


def test_secrets_are_masked_in_display_rows(tmp_path):
    token = "ghp_0123456789abcdefWXYZ"
    settings, sources = load_settings(tmp_path, {"api_key": "short"}, environ={"GITHUB_TOKEN": token})
    rows = {name: (shown, src) for name, shown, src in display_rows(settings, sources)}
    assert rows["github_token"] == ("****WXYZ", "env GITHUB_TOKEN")
    assert rows["api_key"] == ("****", "flag --api-key")
    assert token not in repr(settings)
    assert mask("") == "" and mask("abc") == "****"


def test_config_show_prints_values_sources_and_masks_secrets(tmp_path, cli_main):
    write(tmp_path / "m3-agent.toml", "max_turns = 7\n")
    token = "ghp_secretsecretsecret1234"
    code, out, err = cli_main("config", "show", "--repo", str(tmp_path), "--json",
                                env={"GITHUB_TOKEN": token, "M3_AGENT_THINKING": "enabled"})
    assert code == 0, err
    assert token not in out
    shown = {row["name"]: row for row in json.loads(out)}
    assert shown["max_turns"] == {"name": "max_turns", "value": "7", "source": "m3-agent.toml"}
    assert shown["thinking"]["source"] == "env M3_AGENT_THINKING"
    assert shown["github_token"]["value"] == "****1234"

    code, out, err = cli_main("config", "show", "--repo", str(tmp_path), env={"GITHUB_TOKEN": token})
    assert code == 0, err
    assert token not in out
    line = next(ln for ln in out.splitlines() if "max_turns" in ln)
    assert "7" in line and "m3-agent.toml" in line


def test_config_show_bad_file_is_a_one_line_usage_error(tmp_path, cli_main):
    write(tmp_path / "m3-agent.toml", "nonsense = 1\n")
    code, _, err = cli_main("config", "show", "--repo", str(tmp_path))
    assert code == 2
    assert "unknown setting 'nonsense'" in err
    assert "Traceback" not in err


def test_table_setting_from_the_environment_is_json(tmp_path):
    settings, sources = load_settings(tmp_path, environ={"M3_AGENT_AGENT": '{"max_tokens": 512, "stall": {"monologue": 4}}'})
    assert settings.agent == {"max_tokens": 512, "stall": {"monologue": 4}}
    assert sources["agent"] == "env M3_AGENT_AGENT"
    with pytest.raises(UsageError, match="env M3_AGENT_AGENT: not JSON"):
        load_settings(tmp_path, environ={"M3_AGENT_AGENT": "max_tokens=512"})


def test_explicit_pyproject_reads_its_table(tmp_path):
    other = tmp_path / "shared"
    other.mkdir()
    write(other / "pyproject.toml", "[tool.m3-agent]\nmax_turns = 4\n")
    settings, sources = load_settings(tmp_path, config_file=other / "pyproject.toml", environ={})
    assert settings.max_turns == 4 and sources["max_turns"] == str(other / "pyproject.toml")


def test_pack_globs_from_the_config_file_reach_the_agent(tmp_path):
    from m3_agent.settings import load_settings
    from m3_agent.fix.command import agent_config

    (tmp_path / "m3-agent.toml").write_text(
        'pack_include = ["src/**"]\npack-exclude = ["**/*.min.js"]\npack_max_file_bytes = 4096\n')
    settings, _ = load_settings(tmp_path, {}, environ={})
    config = agent_config(settings, "http://127.0.0.1:9/v1")
    assert config.pack_include == ["src/**"] and config.pack_exclude == ["**/*.min.js"]
    assert config.pack_max_file_bytes == 4096
