"""Configuration layering: defaults < config file < M3_AGENT_* environment < flags, one nested model, with provenance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from m3_agent.agent.config import AgentConfig
from m3_agent.errors import UsageError
from m3_agent.redact import mask
from m3_agent.settings import FLAGS, PATHS, Settings, display_rows, env_name, load_settings
from tests.fix.test_fix_sources import cli_main  # noqa: F401, F811 - the in-process CLI fixture


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_apply_when_nothing_is_configured(tmp_path):
    settings, sources = load_settings(tmp_path, environ={})
    assert settings.limits.max_turns == AgentConfig().limits.max_turns
    assert settings.model.base_url is None
    assert set(sources.values()) == {"default"}
    assert set(sources) == set(PATHS)


def test_every_section_of_the_agent_config_is_a_settings_section():
    sections = {p.split(".")[0] for p in PATHS if "." in p}
    assert sections == {"model", "sandbox", "context", "thinking", "stall", "limits", "tests", "prompts", "fix", "eval"}
    assert {p for p in PATHS if "." not in p} == {"serve", "output_cap_chars", "test_cmd"}
    assert all(path in PATHS for path in FLAGS.values())


def test_file_tables_are_the_sections_with_kebab_or_snake_keys(tmp_path):
    write(tmp_path / "m3-agent.toml", 'serve = "h200-tp8"\n[model]\nbase-url = "http://127.0.0.1:9/v1"\nmax_tokens = 2048\n'
          '[limits]\nmax-turns = 7\n[stall]\nrepeat_actions = 5\n[sandbox]\nenv = {A = "1"}\n[fix]\nimages = "off"\n')
    settings, sources = load_settings(tmp_path, environ={})
    assert settings.model.base_url == "http://127.0.0.1:9/v1" and settings.model.max_tokens == 2048
    assert (settings.limits.max_turns, settings.stall.repeat_actions) == (7, 5)
    assert settings.sandbox.env == {"A": "1"} and settings.fix.images == "off" and settings.serve == "h200-tp8"
    assert sources["limits.max_turns"] == "m3-agent.toml" and sources["serve"] == "m3-agent.toml"
    assert sources["thinking.policy"] == "default"


def test_pyproject_table_is_used_only_without_m3_agent_toml(tmp_path):
    write(tmp_path / "pyproject.toml",
          '[project]\nname = "x"\n[tool.m3-agent.limits]\nmax_turns = 11\n[tool.m3-agent.thinking]\npolicy = "enabled"\n')
    settings, sources = load_settings(tmp_path, environ={})
    assert (settings.limits.max_turns, settings.thinking.policy) == (11, "enabled")
    assert sources["limits.max_turns"] == "pyproject.toml (tool.m3-agent)"

    write(tmp_path / "m3-agent.toml", "[limits]\nmax_turns = 5\n")
    settings, sources = load_settings(tmp_path, environ={})
    assert settings.limits.max_turns == 5
    assert settings.thinking.policy == "controller"  # the pyproject table is not merged underneath
    assert sources["thinking.policy"] == "default"


def test_pyproject_without_the_table_is_ignored(tmp_path):
    write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n')
    _, sources = load_settings(tmp_path, environ={})
    assert set(sources.values()) == {"default"}


def test_environment_names_follow_the_sections(tmp_path):
    assert env_name("limits.max_turns") == "M3_AGENT_LIMITS__MAX_TURNS"
    env = {"M3_AGENT_MODEL__BASE_URL": "http://127.0.0.1:9/v1", "m3_agent_stall__enabled": "false",
           "M3_AGENT_CONTEXT__INCLUDE": '["src/**"]', "M3_AGENT_SERVE": "h200-tp8"}
    settings, sources = load_settings(tmp_path, environ=env)
    assert settings.model.base_url == "http://127.0.0.1:9/v1" and sources["model.base_url"] == "env M3_AGENT_MODEL__BASE_URL"
    assert settings.stall.enabled is False and sources["stall.enabled"] == "env m3_agent_stall__enabled"
    assert settings.context.include == ["src/**"] and settings.serve == "h200-tp8"


def test_environment_overrides_file_and_flags_override_environment(tmp_path):
    write(tmp_path / "m3-agent.toml", "[limits]\nmax_turns = 7\n[sandbox]\ncpus = 1.5\n[fix]\nimages = 'off'\n")
    env = {"M3_AGENT_LIMITS__MAX_TURNS": "9", "M3_AGENT_FIX__IMAGES": "on"}
    settings, sources = load_settings(tmp_path, environ=env)
    assert settings.limits.max_turns == 9 and sources["limits.max_turns"] == "env M3_AGENT_LIMITS__MAX_TURNS"
    assert settings.fix.images == "on" and sources["fix.images"] == "env M3_AGENT_FIX__IMAGES"
    assert settings.sandbox.cpus == 1.5 and sources["sandbox.cpus"] == "m3-agent.toml"

    flags = {"--max-turns": 3, "--images": None, "--time-limit": 60, "model.top_k": 20}
    settings, sources = load_settings(tmp_path, flags, environ=env)
    assert settings.limits.max_turns == 3 and sources["limits.max_turns"] == "flag --max-turns"
    assert settings.limits.max_wall_s == 60 and sources["limits.max_wall_s"] == "flag --time-limit"
    assert settings.model.top_k == 20 and sources["model.top_k"] == "override model.top_k"
    assert settings.fix.images == "on"  # a flag left unset (None) does not override


def test_github_token_from_standard_variables_in_order(tmp_path):
    settings, sources = load_settings(tmp_path, environ={"GH_TOKEN": "gh-token", "GITHUB_TOKEN": "github-token"})
    assert settings.fix.github_token.get_secret_value() == "github-token"
    assert sources["fix.github_token"] == "env GITHUB_TOKEN"

    settings, sources = load_settings(tmp_path, environ={"GH_TOKEN": "gh-token"})
    assert sources["fix.github_token"] == "env GH_TOKEN"

    settings, sources = load_settings(
        tmp_path, environ={"GH_TOKEN": "gh-token", "M3_AGENT_FIX__GITHUB_TOKEN": "own-token"}
    )
    assert settings.fix.github_token.get_secret_value() == "own-token"
    assert sources["fix.github_token"] == "env M3_AGENT_FIX__GITHUB_TOKEN"


def test_unknown_key_in_file_names_the_file_and_where_the_setting_lives(tmp_path):
    write(tmp_path / "m3-agent.toml", "[limits]\nmax_turn = 3\n")
    with pytest.raises(UsageError, match=r"^m3-agent.toml: unknown setting 'limits.max_turn'$"):
        load_settings(tmp_path, environ={})
    write(tmp_path / "m3-agent.toml", "max_turns = 3\n")  # the flat layout of earlier versions
    with pytest.raises(UsageError, match=r"unknown setting 'max_turns' \(did you mean limits.max_turns\?\)"):
        load_settings(tmp_path, environ={})
    write(tmp_path / "m3-agent.toml", "[agent]\nmax_tokens = 3\n")
    with pytest.raises(UsageError, match=r"unknown setting 'agent'"):
        load_settings(tmp_path, environ={})
    write(tmp_path / "m3-agent.toml", 'model = "MiniMaxAI/MiniMax-M3"\n')
    with pytest.raises(UsageError, match=r"^m3-agent.toml: 'model' is a section: give it as a table, \[model\]$"):
        load_settings(tmp_path, environ={})


def test_flat_environment_names_are_refused_with_the_nested_name(tmp_path):
    with pytest.raises(UsageError, match=r"env M3_AGENT_MAX_TURNS: settings are nested: .*M3_AGENT_LIMITS__MAX_TURNS"):
        load_settings(tmp_path, environ={"M3_AGENT_MAX_TURNS": "9"})
    with pytest.raises(UsageError, match=r"env M3_AGENT_SANDBOX_IMAGE: .*M3_AGENT_SANDBOX__IMAGE"):
        load_settings(tmp_path, environ={"M3_AGENT_SANDBOX_IMAGE": "team:1"})
    # Variables that are not settings (the pack cache, the serve state) are left alone.
    load_settings(tmp_path, environ={"M3_AGENT_CACHE_DIR": "/tmp/x", "M3_AGENT_STATE_DIR": "/tmp/y"})


def test_bad_value_is_one_line_naming_the_layer_it_came_from(tmp_path):
    with pytest.raises(UsageError, match=r"^env M3_AGENT_LIMITS__MAX_TURNS: limits.max_turns: .*integer") as e:
        load_settings(tmp_path, environ={"M3_AGENT_LIMITS__MAX_TURNS": "many"})
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match=r"^flag --thinking: thinking.policy: "):
        load_settings(tmp_path, {"--thinking": "sometimes"}, environ={})
    write(tmp_path / "m3-agent.toml", "[sandbox]\nmemory = 'lots'\n")
    with pytest.raises(UsageError, match=r"^m3-agent.toml: sandbox.memory: .*not a size"):
        load_settings(tmp_path, environ={})
    write(tmp_path / "m3-agent.toml", "[context]\ninclude = ['a', 3]\n")
    with pytest.raises(UsageError, match=r"^m3-agent.toml: context.include.1: "):
        load_settings(tmp_path, environ={})
    with pytest.raises(UsageError, match=r"^unknown setting '--turns'"):
        load_settings(tmp_path, {"--turns": 3}, environ={})
    write(tmp_path / "m3-agent.toml", "[limits]\nmax_turns = [")
    with pytest.raises(UsageError, match="cannot read config file"):
        load_settings(tmp_path, environ={})


def test_explicit_config_file_replaces_the_lookup(tmp_path):
    write(tmp_path / "m3-agent.toml", "[limits]\nmax_turns = 7\n")
    other = write(tmp_path / "team.toml", "[limits]\nmax_turns = 21\n")
    settings, sources = load_settings(tmp_path, config_file=other, environ={})
    assert settings.limits.max_turns == 21 and sources["limits.max_turns"] == str(other)
    settings, _ = load_settings(tmp_path, environ={"M3_AGENT_CONFIG": str(other)})
    assert settings.limits.max_turns == 21
    with pytest.raises(UsageError, match="config file not found"):
        load_settings(tmp_path, config_file=tmp_path / "missing.toml", environ={})


def test_secrets_are_masked_in_display_rows(tmp_path):
    token = "ghp_0123456789abcdefWXYZ"
    settings, sources = load_settings(tmp_path, {"model.api_key": "short"}, environ={"GITHUB_TOKEN": token})
    rows = {name: (shown, src) for name, shown, src in display_rows(settings, sources)}
    assert rows["fix.github_token"] == ("****WXYZ", "env GITHUB_TOKEN")
    assert rows["model.api_key"] == ("****", "override model.api_key")
    assert token not in repr(settings)
    assert mask("") == "" and mask("abc") == "****"


def test_no_api_key_shows_as_unset_not_as_a_masked_key(tmp_path):
    settings, sources = load_settings(tmp_path, environ={})
    rows = {name: (shown, src) for name, shown, src in display_rows(settings, sources)}
    assert rows["model.api_key"] == ("-", "default")
    assert rows["fix.github_token"] == ("-", "default")


def test_the_api_key_flag_and_where_the_key_came_from(tmp_path):
    settings, _ = load_settings(tmp_path, {"--api-key": "m3-flag-key-0123456789"}, environ={})
    assert settings.source_of("model.api_key") == "flag --api-key"
    assert settings.model_key().shown == "****6789 (flag --api-key)"
    settings, _ = load_settings(tmp_path, environ={"M3_AGENT_MODEL__API_KEY": "m3-env-key-0123456789"})
    assert settings.source_of("model.api_key") == "env M3_AGENT_MODEL__API_KEY"
    assert settings.agent_config(api_key=SecretStr("resolved")).model.api_key.get_secret_value() == "resolved"
    assert settings.model.api_key.get_secret_value() == "m3-env-key-0123456789"  # the settings stay as loaded
    assert Settings().source_of("model.api_key") == "setting model.api_key"  # built without load_settings


def test_the_agent_config_is_the_settings_sections_with_the_resolved_endpoint(tmp_path):
    write(tmp_path / "m3-agent.toml", '[model]\nbase_url = "http://127.0.0.1:9/v1"\nmax_tokens = 1024\n'
          '[context]\ninclude = ["src/**"]\nexclude = ["**/*.min.js"]\nmax_file_bytes = 4096\n'
          '[sandbox]\npids_limit = 64\n[thinking]\npolicy = "enabled"\n')
    settings, _ = load_settings(tmp_path, {"model.api_key": "k", "--time-limit": 30}, environ={})
    config = settings.agent_config(base_url="http://127.0.0.1:10/v1")
    assert type(config) is AgentConfig
    assert (config.model.base_url, config.model.api_key.get_secret_value(), config.model.max_tokens) == (
        "http://127.0.0.1:10/v1", "k", 1024)
    assert settings.model.base_url == "http://127.0.0.1:9/v1"  # the settings stay as loaded
    assert (config.context.include, config.context.exclude, config.context.max_file_bytes) == (
        ["src/**"], ["**/*.min.js"], 4096)
    assert (config.limits.max_wall_s, config.thinking.policy) == (30, "enabled")
    assert (config.sandbox.pids_limit, config.sandbox.network) == (64, "none")


def test_settings_built_directly_read_nothing_from_the_environment(monkeypatch):
    monkeypatch.setenv("M3_AGENT_LIMITS__MAX_TURNS", "3")
    assert Settings().limits.max_turns == AgentConfig().limits.max_turns


def test_config_show_prints_values_sources_and_masks_secrets(tmp_path, cli_main):
    write(tmp_path / "m3-agent.toml", "[limits]\nmax_turns = 7\n")
    token = "ghp_secretsecretsecret1234"
    code, out, err = cli_main("config", "show", "--repo", str(tmp_path), "--json",
                              env={"GITHUB_TOKEN": token, "M3_AGENT_THINKING__POLICY": "enabled"})
    assert code == 0, err
    assert token not in out
    shown = {row["name"]: row for row in json.loads(out)}
    assert shown["limits.max_turns"] == {"name": "limits.max_turns", "value": "7", "source": "m3-agent.toml"}
    assert shown["thinking.policy"]["source"] == "env M3_AGENT_THINKING__POLICY"
    assert shown["fix.github_token"]["value"] == "****1234"
    assert set(shown) == set(PATHS)

    code, out, err = cli_main("config", "show", "--repo", str(tmp_path), env={"GITHUB_TOKEN": token})
    assert code == 0, err
    assert token not in out
    line = next(ln for ln in out.splitlines() if "limits.max_turns" in ln)
    assert "7" in line and "m3-agent.toml" in line


def test_config_show_bad_file_is_a_one_line_usage_error(tmp_path, cli_main):
    write(tmp_path / "m3-agent.toml", "nonsense = 1\n")
    code, _, err = cli_main("config", "show", "--repo", str(tmp_path))
    assert code == 2
    assert "m3-agent.toml: unknown setting 'nonsense'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_config_show_lists_the_prompts_and_a_file_changes_one(tmp_path, cli_main):
    write(tmp_path / "m3-agent.toml", '[prompts]\nreprompt = "No call. Use one of {tools}."\n'
          '[prompts.stall_advice]\nmonologue = "Stop repeating yourself."\n')
    code, out, err = cli_main("config", "show", "--repo", str(tmp_path), "--json")
    assert code == 0, err
    shown = {row["name"]: row for row in json.loads(out)}
    assert {n for n in shown if n.startswith("prompts.")} == {
        "prompts.system", "prompts.instance", "prompts.reprompt", "prompts.cut_off", "prompts.nudge",
        "prompts.stall_advice", "prompts.restart"}
    assert shown["prompts.reprompt"] == {"name": "prompts.reprompt", "value": "No call. Use one of {tools}.",
                                         "source": "m3-agent.toml"}
    assert shown["prompts.system"]["value"].startswith("You are m3-agent") and shown["prompts.system"]["source"] == "default"
    settings, _ = load_settings(tmp_path)
    assert settings.agent_config().prompts.advice("monologue") == "Stop repeating yourself."


@pytest.mark.parametrize("layer", ["file", "env"])
def test_a_prompt_with_an_unknown_placeholder_is_refused_when_the_config_is_read(tmp_path, cli_main, layer):
    env = {}
    if layer == "file":
        write(tmp_path / "m3-agent.toml", '[prompts]\nnudge = "Stalled: {rule} at turn {turn}"\n')
    else:
        env["M3_AGENT_PROMPTS__NUDGE"] = "Stalled: {rule} at turn {turn}"
    code, _, err = cli_main("config", "show", "--repo", str(tmp_path), env=env)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    where = "m3-agent.toml" if layer == "file" else "env M3_AGENT_PROMPTS__NUDGE"
    assert f"{where}: prompts.nudge: Value error, unknown placeholder {{turn}}" in err
    assert "{rule}, {evidence}, {advice}" in err


def test_table_setting_from_the_environment_is_json(tmp_path):
    settings, sources = load_settings(tmp_path, environ={"M3_AGENT_SANDBOX__ENV": '{"PIP_INDEX_URL": "http://mirror"}'})
    assert settings.sandbox.env == {"PIP_INDEX_URL": "http://mirror"}
    assert sources["sandbox.env"] == "env M3_AGENT_SANDBOX__ENV"
    with pytest.raises(UsageError, match="env M3_AGENT_CONTEXT__EXCLUDE: not JSON"):
        load_settings(tmp_path, environ={"M3_AGENT_CONTEXT__EXCLUDE": "*.min.js"})


def test_explicit_pyproject_reads_its_table(tmp_path):
    other = tmp_path / "shared"
    other.mkdir()
    write(other / "pyproject.toml", "[tool.m3-agent.limits]\nmax_turns = 4\n")
    settings, sources = load_settings(tmp_path, config_file=other / "pyproject.toml", environ={})
    assert settings.limits.max_turns == 4 and sources["limits.max_turns"] == str(other / "pyproject.toml")


def test_pack_reads_the_context_table(git_repo, tmp_path):
    import os
    import subprocess
    import sys

    repo = git_repo({"a.py": "print(1)\n", "notes.txt": "secret-notes\n"})
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("M3_AGENT_")}
    env["M3_AGENT_CACHE_DIR"] = str(tmp_path / "cache")

    def packed() -> str:
        out = tmp_path / "pack.txt"
        subprocess.run([sys.executable, "-m", "m3_agent.cli", "pack", "--repo", str(repo), "-o", str(out)],
                       check=True, capture_output=True, env=env)
        return out.read_text()

    assert "secret-notes" in packed()
    write(repo / "m3-agent.toml", '[context]\nexclude = ["notes.txt"]\n')
    assert "secret-notes" not in packed() and "print(1)" in packed()


@pytest.mark.parametrize("name", ["shared_share", "delta"])
def test_a_batch_knob_still_under_context_is_an_error_that_names_its_new_place(tmp_path, name):
    value = "0.5" if name == "shared_share" else "false"
    (tmp_path / "m3-agent.toml").write_text(f"[context]\n{name} = {value}\n")
    with pytest.raises(UsageError, match=rf"'context.{name}' moved to 'eval.{name}'.*\[eval\]"):
        load_settings(tmp_path)
    (tmp_path / "m3-agent.toml").write_text(f"[eval]\n{name} = {value}\n")
    settings, sources = load_settings(tmp_path)
    assert str(getattr(settings.eval, name)).lower() == value and sources[f"eval.{name}"] == "m3-agent.toml"
    with pytest.raises(UsageError, match=rf"env M3_AGENT_CONTEXT__{name.upper()}: .*M3_AGENT_EVAL__{name.upper()}"):
        load_settings(tmp_path, environ={f"M3_AGENT_CONTEXT__{name.upper()}": value})
    with pytest.raises(UsageError, match=rf"'context.{name}' moved to 'eval.{name}'"):
        load_settings(tmp_path, {f"context.{name}": value}, environ={})
    with pytest.raises(ValueError, match=rf"context.{name} moved.*eval.{name}"):
        AgentConfig.model_validate({"context": {name: value}})


def test_setting_flags_are_typer_options_with_the_settings_type_and_description():
    import typer
    from typer.testing import CliRunner

    from m3_agent.settings import setting_flags

    app, seen = typer.Typer(), {}

    @app.command()
    @setting_flags("--max-turns", "--push", "--ready", "--output-dir")
    def command(quiet: bool = typer.Option(False, "--quiet"), *, flags: dict) -> None:
        seen.update(flags, quiet=quiet)

    result = CliRunner().invoke(app, ["--max-turns", "7", "--push", "--draft", "--quiet"])
    assert result.exit_code == 0, result.output
    assert seen == {"--max-turns": 7, "--push": True, "--ready": False, "--output-dir": None, "quiet": True}
    settings, sources = load_settings(".", {k: v for k, v in seen.items() if k.startswith("--")}, environ={})
    assert (settings.limits.max_turns, settings.fix.push, sources["limits.max_turns"]) == (7, True, "flag --max-turns")
    assert CliRunner().invoke(app, ["--max-turns", "many"]).exit_code == 2  # typed as the setting is
    help_text = " ".join(CliRunner().invoke(app, ["--help"], env={"COLUMNS": "300"}).output.split())
    assert "--ready --draft" in help_text.replace("/", " ") and "--no-push" in help_text
    for path in ("limits.max_turns", "fix.output_dir"):
        description = Settings.model_fields[path.split(".")[0]].annotation.model_fields[path.split(".")[1]].description
        assert description and description in help_text


def test_the_settings_load_no_packer_and_the_packer_names_still_import(tmp_path):
    # `env build` and `config` read the settings, whose agent section takes two of the packer's defaults: that must
    # not load the packer, its cache (sqlite) and its relevance signals.
    code = ("import sys; import m3_agent.settings; "
            "sys.exit(1 if {'m3_agent.agent.context.pack', 'm3_agent.agent.context.cache'} & set(sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == 0
    from m3_agent.agent.context import Packer, budget_for_window, pack_repository
    from m3_agent.agent.context.pack import pack_repository as defined

    assert pack_repository is defined and callable(budget_for_window) and Packer.__module__.endswith(".pack")
    import m3_agent.agent.context as context

    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        getattr(context, "nothing")
