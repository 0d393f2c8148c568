"""The fake engine (tests/serving/fake_engine.py) on PATH, plus fake `nvidia-smi` / `rocm-smi`. State
files go to a tmp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.serving.fake_engine import install_fake_engine

NVIDIA_SMI = '#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo "$i, NVIDIA H200, 143771"; done\n'


@pytest.fixture
def fake_bin(tmp_path, monkeypatch) -> Path:
    """A bin dir first on PATH holding a fake `vllm`; state files under tmp_path/state."""
    bin_dir = tmp_path / "bin"
    install_fake_engine(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("M3_AGENT_STATE_DIR", str(tmp_path / "state"))
    return bin_dir


@pytest.fixture
def fake_nvidia_smi(fake_bin) -> Path:
    """A `nvidia-smi` that reports 8x H200."""
    smi = fake_bin / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    return smi


@pytest.fixture
def cleanup_endpoints(fake_bin):
    """Stop whatever a test left recorded, so no process outlives it."""
    names: list[str] = ["default"]
    yield names
    from m3_agent.serving import launcher

    for name in names:
        launcher.stop(name, grace_s=1)
