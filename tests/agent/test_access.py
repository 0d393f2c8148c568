"""Who can reach a launched endpoint: the bind address, the key it requires, and how the engine gets it."""

from __future__ import annotations

import shlex

import pytest

from m3_agent.errors import UsageError
from m3_agent.agent.endpoint import is_loopback
from m3_agent.agent.access import ApiKey, choose_key, client_host, describe_access, plain_http_warning
from m3_agent.serving.profiles import Overrides, build_command, flag_value, get_profile

KEY = "m3-team-key-0123456789WXYZ"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "gpu-node", "192.168.0.5", "fe80::1"])
def test_hosts_other_machines_may_reach(host):
    assert not is_loopback(host)


def test_a_key_is_chosen_only_where_others_can_reach_and_from_where_the_user_says(monkeypatch):
    monkeypatch.setenv("M3_AGENT_MODEL__API_KEY", KEY)
    assert choose_key("127.0.0.1") is None
    given = choose_key("127.0.0.1", KEY)
    assert given.value.get_secret_value() == KEY and given.source == "flag --api-key"
    from_env = choose_key("0.0.0.0")
    assert from_env.value.get_secret_value() == KEY and from_env.source == "env M3_AGENT_MODEL__API_KEY"
    monkeypatch.setenv("M3_AGENT_MODEL__API_KEY", "EMPTY")
    made = [choose_key("10.1.2.3") for _ in range(2)]
    assert {k.source for k in made} == {"generated"}
    assert made[0].value.get_secret_value() != made[1].value.get_secret_value()
    assert len(made[0].value.get_secret_value()) >= 40
    monkeypatch.delenv("M3_AGENT_MODEL__API_KEY")
    assert choose_key("127.0.0.1", shared=True).source == "generated"  # a multi-node plan
    with pytest.raises(UsageError, match="is not a key"):
        choose_key("0.0.0.0", "EMPTY")


def test_describe_says_loopback_only_or_keyed_never_the_key():
    key = ApiKey.model_validate({"value": KEY, "source": "generated"})
    assert describe_access("127.0.0.1", None).startswith("loopback only (127.0.0.1)")
    keyed = describe_access("0.0.0.0", key)
    assert keyed.startswith("keyed: listens on 0.0.0.0") and "****WXYZ (generated)" in keyed and KEY not in keyed
    assert describe_access("0.0.0.0", None).startswith("OPEN")
    assert key.model_dump_json() == '{"value":"****WXYZ","source":"generated"}'
    assert KEY in key.model_dump_json(context={"secrets": True})


def test_a_wildcard_bind_is_dialled_on_loopback():
    assert client_host("0.0.0.0") == client_host("::") == "127.0.0.1"
    assert client_host("10.1.2.3") == "10.1.2.3" and client_host("fe80::1") == "[fe80::1]"


def _keyed(host: str = "0.0.0.0") -> Overrides:
    return Overrides(host=host, api_key=choose_key(host, KEY))


def test_a_reachable_host_without_a_key_is_refused_for_every_profile():
    with pytest.raises(UsageError, match="--host 0.0.0.0 lets other machines reach the server: it needs an API key"):
        build_command(get_profile("h200-tp8"), "native", Overrides(host="0.0.0.0"))
    with pytest.raises(UsageError, match="not through --extra-arg"):
        build_command(get_profile("h200-tp8"), "native", Overrides(extra_args=["--host=0.0.0.0"]))
    with pytest.raises(UsageError, match="not through --extra-arg"):
        build_command(get_profile("b200", "sglang"), "native", Overrides(extra_args=["--api-key", "x"]))


def test_vllm_gets_the_key_through_its_variable_never_argv():
    cmd = build_command(get_profile("h200-tp8"), "native", _keyed())
    assert flag_value(cmd.argv, "--host") == "0.0.0.0" and KEY not in " ".join(cmd.argv)
    assert cmd.key_env == "VLLM_API_KEY" and cmd.launch_env()["VLLM_API_KEY"] == KEY
    assert "VLLM_API_KEY" not in cmd.env  # the profile's variables only
    line = cmd.shell()
    assert line.startswith("VLLM_API_KEY=****WXYZ vllm serve ") and KEY not in line


def test_vllm_in_docker_publishes_on_the_host_asked_and_takes_the_key_by_name():
    cmd = build_command(get_profile("b200"), "docker", _keyed("10.1.2.3"))
    argv = cmd.argv
    assert argv[argv.index("-p") + 1] == "10.1.2.3:8000:8000" and flag_value(argv, "--host") == "0.0.0.0"
    assert argv[argv.index("VLLM_API_KEY") - 1] == "-e" and KEY not in " ".join(argv)
    assert cmd.launch_env() == {"VLLM_API_KEY": KEY}
    assert cmd.shell().startswith("VLLM_API_KEY=****WXYZ docker run ") and KEY not in cmd.shell()


def test_sglang_with_several_tokenizer_workers_is_refused_a_key_it_would_not_check():
    with pytest.raises(UsageError, match="only with one tokenizer worker, not --tokenizer-worker-num 4"):
        build_command(get_profile("b200", "sglang"), "native",
                      _keyed().model_copy(update={"extra_args": ["--tokenizer-worker-num", "4"]}))
    one = _keyed().model_copy(update={"extra_args": ["--tokenizer-worker-num", "1"]})
    assert flag_value(build_command(get_profile("b200", "sglang"), "native", one).argv, "--api-key") == KEY


@pytest.mark.parametrize("runner", ["native", "docker"])
def test_sglang_gets_the_key_as_its_flag_and_the_shell_form_masks_it(runner):
    cmd = build_command(get_profile("b200", "sglang"), runner, _keyed())
    assert flag_value(cmd.argv, "--api-key") == KEY and cmd.key_env is None
    line = cmd.shell()
    assert KEY not in line and flag_value(shlex.split(line), "--api-key") == "****WXYZ"


def test_plain_http_to_another_machine_is_the_one_case_that_warns():
    warning = plain_http_warning("http://gpu-node:8000/v1")
    assert warning.startswith("the repository goes to gpu-node over plain http:// (http://gpu-node:8000/v1)")
    assert "warn_plain_http = false" in warning and "M3_AGENT_MODEL__WARN_PLAIN_HTTP=false" in warning
    assert plain_http_warning("http://10.1.2.3:8000/v1") is not None
    for quiet in ("https://gpu-node/v1", "http://127.0.0.1:8000/v1", "http://localhost:8000/v1", "http://[::1]:8000/v1"):
        assert plain_http_warning(quiet) is None
