"""The public library API (`agent.api`) and the `serve` side of endpoint resolution."""

from __future__ import annotations

import m3_agent.api as api
from m3_agent.settings import load_settings
from m3_agent.agent.access import resolve_endpoint
from m3_agent.serving.endpoint import Served
from m3_agent.standin.server import StandinServer


def test_every_public_name_resolves():
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert missing == []
    assert api.Agent.run.__doc__ and api.fix_issue.__doc__ and api.run_eval.__doc__


class Echo(api.Tool):
    """A tool defined by an embedding program."""

    name = "echo"
    description = "Echo the text back."

    class Args(api.ToolArgs):
        text: str

    def run(self, args, sandbox) -> api.ToolResult:
        return api.ToolResult(output=args.text, ok=True)


def test_build_agent_uses_the_layered_configuration_plus_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("M3_AGENT_LIMITS__MAX_TURNS", raising=False)
    (tmp_path / "m3-agent.toml").write_text('[model]\nbase_url = "http://127.0.0.1:9/v1"\n[limits]\nmax_turns = 12\n'
                                            '[thinking]\npolicy = "disabled"\n')
    events = []
    agent = api.build_agent(tmp_path, overrides={"limits.max_turns": 3}, tools=[*api.default_tools(), Echo()],
                            callbacks=[events.append])
    assert (agent.config.model.base_url, agent.config.limits.max_turns) == ("http://127.0.0.1:9/v1", 3)
    assert agent.config.thinking.policy == "disabled"
    assert agent.config.sandbox.image == api.DEFAULT_IMAGE
    assert [t.name for t in agent.tools][-1] == "echo"
    assert agent.tools[-1].schema()["function"]["parameters"]["required"] == ["text"]
    assert agent.callbacks == [events.append]
    assert agent.model is None and agent.env_factory == agent.docker_sandbox  # the defaults: M3 client, Docker


def test_build_agent_takes_the_parts_an_embedding_program_brings(tmp_path, git_repo):
    (tmp_path / "m3-agent.toml").write_text('[model]\nbase_url = "http://127.0.0.1:9/v1"\n')
    agent = api.build_agent(tmp_path, env_factory=api.LocalEnvironment)
    with agent.env_factory(git_repo({"a.py": "x = 1\n"})) as env:
        assert isinstance(env, api.Environment) and not env.isolated
        assert env.exec("cat a.py").stdout == "x = 1\n"


def test_serve_reuses_a_healthy_endpoint_and_says_so(tmp_path):
    notices = []
    with StandinServer({"turns": []}) as srv:
        settings, _ = load_settings(tmp_path, {"--serve": "h200-tp8", "--base-url": srv.base_url + "/"}, environ={})
        assert resolve_endpoint(settings.model.base_url, serving=Served(settings.serve, notices.append)).base_url == srv.base_url
    assert notices and notices[0].startswith("serve: ") and srv.base_url in notices[0]
