"""Thinking-mode policy: the fixed policies, each controller rule, its precedence and overrides."""

from __future__ import annotations

import pydantic
import pytest

from m3_agent.agent.thinking import LoopState, ThinkingConfig, ThinkingPolicy


def routine_after_edit(turn: int = 5) -> LoopState:
    return LoopState(turn=turn, last_tools=["file_edit"], last_tool_errors=0, last_tests_failed=None,
                     last_edit_ok=True, stalled=False, format_errors_in_row=0)


@pytest.mark.parametrize("policy", ["enabled", "disabled", "adaptive"])
def test_fixed_policy_sends_the_same_mode_whatever_the_state(policy):
    p = ThinkingPolicy(ThinkingConfig(policy=policy))
    states = [LoopState(turn=1), routine_after_edit(), LoopState(turn=7, stalled=True),
              LoopState(turn=3, last_tools=["bash"], last_tool_errors=2, last_tests_failed=True)]
    decisions = [p.decide(s) for s in states]
    assert {mode for mode, _ in decisions} == {policy}
    assert all(policy in reason for _, reason in decisions)


def test_default_policy_is_the_controller():
    assert ThinkingPolicy().config.policy == "controller"
    assert ThinkingPolicy().decide(LoopState(turn=1))[0] == "enabled"
    assert ThinkingPolicy().decide(routine_after_edit())[0] == "disabled"


def test_controller_plans_the_first_turn():
    mode, reason = ThinkingPolicy().decide(LoopState(turn=1))
    assert (mode, reason) == ("enabled", "plan the first turn")


def test_controller_thinks_after_failing_tests():
    state = LoopState(turn=4, last_tools=["test_runner"], last_tests_failed=True)
    mode, reason = ThinkingPolicy().decide(state)
    assert mode == "enabled" and "tests failed" in reason


def test_controller_thinks_after_tool_errors():
    state = LoopState(turn=4, last_tools=["file_edit", "file_read"], last_tool_errors=1, last_edit_ok=False)
    mode, reason = ThinkingPolicy().decide(state)
    assert mode == "enabled" and "1 tool error" in reason


def test_controller_thinks_on_a_stall_even_when_the_turn_looks_routine():
    state = routine_after_edit()
    state.stalled = True
    assert ThinkingPolicy().decide(state) == ("enabled", "stall detected")


def test_controller_thinks_after_format_errors():
    state = LoopState(turn=6, last_tools=["file_edit"], format_errors_in_row=2)
    mode, reason = ThinkingPolicy().decide(state)
    assert mode == "enabled" and "2 format error" in reason


def test_controller_skips_thinking_for_routine_turns_after_an_edit_or_a_read():
    policy = ThinkingPolicy()
    assert policy.decide(routine_after_edit())[0] == "disabled"
    read = LoopState(turn=3, last_tools=["file_read", "file_read"])
    mode, reason = policy.decide(read)
    assert mode == "disabled" and "routine" in reason


def test_controller_uses_the_default_when_no_rule_applies():
    policy = ThinkingPolicy()
    # A passing test run, a bash command, and a turn with no tool call are not routine edits or reads.
    for state in [LoopState(turn=3, last_tools=["test_runner"], last_tests_failed=False),
                  LoopState(turn=3, last_tools=["bash"]),
                  LoopState(turn=3, last_tools=[])]:
        assert policy.decide(state) == ("adaptive", "no rule applied")


def test_an_edit_that_also_ran_failing_tests_is_not_routine():
    state = routine_after_edit()
    state.last_tools = ["file_edit", "test_runner"]
    state.last_tests_failed = True
    assert ThinkingPolicy().decide(state)[0] == "enabled"
    off = ThinkingPolicy(ThinkingConfig(after_test_failure=False))
    assert off.decide(state) == ("adaptive", "no rule applied")


def test_periodic_replanning():
    policy = ThinkingPolicy(ThinkingConfig(think_every_n_turns=4))
    modes = {t: policy.decide(routine_after_edit(turn=t))[0] for t in range(2, 11)}
    assert [t for t, m in modes.items() if m == "enabled"] == [5, 9]
    assert ThinkingPolicy().decide(routine_after_edit(turn=5))[0] == "disabled"


@pytest.mark.parametrize("knob, state", [
    ("plan_first_turn", LoopState(turn=1)),
    ("after_test_failure", LoopState(turn=4, last_tools=["test_runner"], last_tests_failed=True)),
    ("after_tool_error", LoopState(turn=4, last_tools=["bash"], last_tool_errors=3)),
    ("after_format_error", LoopState(turn=4, format_errors_in_row=1)),
    ("on_stall", LoopState(turn=4, last_tools=["bash"], stalled=True)),
])
def test_each_controller_rule_can_be_switched_off(knob, state):
    assert ThinkingPolicy().decide(state)[0] == "enabled"
    mode, reason = ThinkingPolicy(ThinkingConfig(**{knob: False}, default="disabled")).decide(state)
    assert (mode, reason) == ("disabled", "no rule applied")


def test_routine_and_default_modes_are_configurable():
    cfg = ThinkingConfig(routine="adaptive", default="enabled")
    policy = ThinkingPolicy(cfg)
    assert policy.decide(routine_after_edit())[0] == "adaptive"
    assert policy.decide(LoopState(turn=3, last_tools=["bash"]))[0] == "enabled"


def test_read_tools_are_configurable():
    state = LoopState(turn=3, last_tools=["grep_repo"])
    assert ThinkingPolicy().decide(state)[0] == "adaptive"
    assert ThinkingPolicy(ThinkingConfig(read_tools=["grep_repo"])).decide(state)[0] == "disabled"


def test_rule_precedence_stall_first_then_errors_then_tests():
    state = LoopState(turn=1, last_tool_errors=1, last_tests_failed=True, format_errors_in_row=1, stalled=True)
    p = ThinkingPolicy()
    assert p.decide(state)[1] == "stall detected"
    state.stalled = False
    assert p.decide(state)[1] == "plan the first turn"
    state.turn = 2
    assert "tool error" in p.decide(state)[1]
    state.last_tool_errors = 0
    assert "tests failed" in p.decide(state)[1]
    state.last_tests_failed = False
    assert "format error" in p.decide(state)[1]


@pytest.mark.parametrize("bad", [{"policy": "sometimes"}, {"routine": "off"}, {"think_every_n_turns": 0},
                                 {"plan_frist_turn": False}])
def test_bad_config_is_rejected(bad):
    with pytest.raises(pydantic.ValidationError):
        ThinkingConfig(**bad)


def test_config_loads_from_plain_data():
    cfg = ThinkingConfig.model_validate({"policy": "controller", "routine": "adaptive", "think_every_n_turns": 3})
    assert ThinkingPolicy(cfg).decide(routine_after_edit(turn=4)) == ("enabled", "re-plan every 3 turns")


def test_thinking_mode_is_defined_once_for_the_policy_and_the_client():
    import typing

    from m3_agent.agent import model, thinking

    assert model.ThinkingMode is thinking.ThinkingMode
    assert set(typing.get_args(thinking.ThinkingMode)) == {"enabled", "disabled", "adaptive"}
