"""The prompts are templates in the configuration: the defaults, rendering, and refusing a template that
names a placeholder it is not given."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from m3_agent.agent.config import AgentConfig
from m3_agent.agent.prompts import PLACEHOLDERS, Prompts
from m3_agent.agent.stall import Stall

RULES = ["same_failing_tests", "repeated_action", "repeated_error", "monologue", "alternation",
         "condensation", "no_file_change"]


def nudge(stall: Stall, prompts: Prompts | None = None) -> str:
    p = prompts or Prompts()
    return p.render("nudge", rule=stall.rule, evidence=stall.evidence, advice=p.advice(stall.rule))


def test_nudge_names_the_stall_and_its_evidence():
    stall = Stall(rule="same_failing_tests", evidence="the same 1 failing test(s) in the last 3 test runs", turn=6)
    text = nudge(stall)
    assert "same_failing_tests" in text and stall.evidence in text
    assert "stopped" in text
    assert nudge(Stall(rule="no_file_change", evidence="e", turn=1)) != text


def test_every_rule_has_its_own_advice_and_an_unknown_rule_the_other_one():
    texts = {nudge(Stall(rule=r, evidence="e", turn=1)) for r in RULES}
    assert len(texts) == len(RULES)
    mystery = nudge(Stall(rule="mystery", evidence="e", turn=1))
    assert "Stall detected (mystery)" in mystery and "Step back and try a different approach." in mystery


def test_every_default_template_renders_with_its_own_placeholders():
    p = Prompts()
    for name, placeholders in PLACEHOLDERS.items():
        if name == "stall_advice":
            continue
        values = {key: f"<{key}>" for key in placeholders}
        text = p.render(name, **values)
        assert all(f"<{key}>" in text for key in placeholders) and "{" not in text.replace("{issue}", "")


@pytest.mark.parametrize(("name", "template", "unknown"), [
    ("reprompt", "Use {tools} and {tool}", "{tool}"),
    ("cut_off", "Cut off at {max_tokens}", "{max_tokens}"),
    ("instance", "{pack}{issue.title}", "{issue.title}"),
    ("system", "positional {}", "{}"),
])
def test_a_template_with_an_unknown_placeholder_is_refused(name, template, unknown):
    with pytest.raises(ValidationError, match=f"unknown placeholder {unknown}"):
        Prompts(**{name: template})


def test_a_lone_brace_and_an_advice_placeholder_are_refused_and_doubled_braces_are_literal():
    with pytest.raises(ValidationError, match="Single '}'"):
        Prompts(system="a } b")
    with pytest.raises(ValidationError, match="unknown placeholder {rule}"):
        Prompts(stall_advice={"monologue": "stop {rule}"})
    assert Prompts(cut_off="JSON: {{}}").render("cut_off") == "JSON: {}"


def test_the_prompts_are_a_section_of_the_agent_config():
    config = AgentConfig.model_validate({"prompts": {"reprompt": "Call one of {tools}."}})
    assert config.prompts.render("reprompt", tools="bash, submit") == "Call one of bash, submit."
    assert config.prompts.system == Prompts().system
