"""The one nested AgentConfig: sections are the parts' own models; one default-budget formula."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from m3_agent.agent.config import AgentConfig, ContextConfig, LimitsConfig
from m3_agent.agent.context.tokens import budget_for_window
from m3_agent.agent.model import ModelConfig
from m3_agent.agent.stall import StallConfig
from m3_agent.agent.thinking import ThinkingConfig
from m3_agent.sandbox import SandboxConfig


def test_agent_config_contains_each_parts_config_instead_of_inheriting():
    config = AgentConfig()
    assert not issubclass(AgentConfig, ModelConfig)
    parts = (config.model, config.sandbox, config.context, config.thinking, config.stall, config.limits)
    assert [type(p) for p in parts] == [ModelConfig, SandboxConfig, ContextConfig, ThinkingConfig, StallConfig,
                                        LimitsConfig]


def test_the_loop_module_still_exports_the_same_agent_config():
    from m3_agent.agent import loop

    assert loop.AgentConfig is AgentConfig


def test_flat_keys_are_refused_naming_the_field():
    with pytest.raises(ValidationError, match="max_turns"):
        AgentConfig(max_turns=3)
    with pytest.raises(ValidationError, match=r"limits\.max_turns"):
        AgentConfig.model_validate({"limits": {"max_turns": 0}})


def test_nested_config_round_trips_through_json_with_its_secret():
    config = AgentConfig(model=ModelConfig(base_url="http://127.0.0.1:9/v1", api_key="sk-0123456789"),
                         context=ContextConfig(include=["src/**"]), limits=LimitsConfig(max_wall_s=30))
    again = AgentConfig.model_validate_json(config.model_dump_json(context={"secrets": True}))
    assert again == config
    assert "sk-0123456789" not in config.model_dump_json()


def test_default_budget_is_one_formula_for_the_loop_and_pack():
    # pack's documented default: the window less 32,768 for output and 15% for the conversation.
    assert budget_for_window(1_048_576) == 1_048_576 - 32_768 - int(1_048_576 * 0.15)
    # the loop's: the window less the request's max_tokens and the context reserve (a token count) ...
    config = AgentConfig()
    budget = budget_for_window(1_048_576, output_reserve=config.model.max_tokens,
                               growth_reserve=config.context.reserve_tokens)
    assert budget == 1_048_576 - 8192 - 65_536
    # ... the reserve capped at a quarter of a small window, so that some repository still fits.
    assert budget_for_window(32_768, output_reserve=8192, growth_reserve=65_536) == 32_768 - 8192 - 8192
    # the output room too: a window smaller than the reply budget still gets a pack
    assert budget_for_window(4096, output_reserve=8192) == 4096 - 1024 - int(4096 * 0.15)


def test_a_small_window_keeps_half_for_the_pack_whatever_the_reserves_ask():
    """budget_for_window(8192, output_reserve=8192) was 0: an 8k window got an empty pack."""
    from m3_agent.agent.context.tokens import reply_budget

    assert budget_for_window(8192, output_reserve=8192) == 8192 - 2048 - 1228  # growth: 15% of the window
    assert budget_for_window(8192, output_reserve=8192, growth_reserve=65_536) == 4096
    assert reply_budget(8192, 8192) == 2048 and reply_budget(8192, 1000) == 1000 and reply_budget(3, 8192) == 1
