"""GPU detection through real `nvidia-smi` / `rocm-smi` executables (fakes on PATH) and their parsers."""

from __future__ import annotations

import json

from m3_agent.serving.gpus import auto_profile, detect_gpus, gpu_kind, parse_nvidia_smi, parse_rocm_smi, summary

ROCM_JSON = {
    f"card{i}": {
        "Card Series": "AMD Instinct MI300X",
        "VRAM Total Memory (B)": str(206_141_652_992),
        "VRAM Total Used Memory (B)": "0",
    }
    for i in range(8)
}


def test_nvidia_smi_rows_become_gpus_in_the_planners_units():
    gpus = parse_nvidia_smi("0, NVIDIA H200, 143771\n1, NVIDIA H200, 143771\nbad line\n")
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].kind == "H200" and gpus[0].memory_gb == 140.4 and gpus[0].vendor == "nvidia"


def test_rocm_smi_json_becomes_gpus():
    gpus = parse_rocm_smi(json.dumps({**ROCM_JSON, "system": {"Driver version": "6.8"}}))
    assert len(gpus) == 8 and gpus[3].index == 3
    assert gpus[0].kind == "MI300X" and gpus[0].memory_gb == 192.0 and gpus[0].vendor == "amd"
    assert parse_rocm_smi("not json") == []


def test_kind_prefers_the_longest_name():
    assert gpu_kind("NVIDIA H200 NVL") == "H200"
    assert gpu_kind("NVIDIA H20") == "H20"
    assert gpu_kind("AMD Instinct MI325X") == "MI325X"
    assert gpu_kind("NVIDIA GeForce RTX 4090") is None


def test_detect_runs_nvidia_smi_from_path(fake_nvidia_smi):
    gpus = detect_gpus()
    assert len(gpus) == 8 and {g.kind for g in gpus} == {"H200"}
    assert summary(gpus) == "8x NVIDIA H200 (140.4 GB)"
    assert auto_profile(gpus) == "h200-tp8"


def test_detect_falls_back_to_rocm_smi(fake_bin):
    smi = fake_bin / "rocm-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(ROCM_JSON)}\nEOF\n")
    smi.chmod(0o755)
    gpus = detect_gpus()
    assert len(gpus) == 8 and gpus[0].vendor == "amd"
    assert auto_profile(gpus) == "amd-tp8"


def test_no_tools_means_no_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpus() == []
    assert auto_profile([]) is None
    assert "no GPU found" in summary([])


def test_auto_profile_by_count():
    two = parse_nvidia_smi("0, NVIDIA H200, 143771\n1, NVIDIA H200, 143771")
    assert auto_profile(two) == "h200x2-fp8"
    assert auto_profile(parse_nvidia_smi("0, NVIDIA H100 80GB HBM3, 81559")) is None
