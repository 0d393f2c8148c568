"""Which GPUs this machine has, read from `nvidia-smi` or `rocm-smi`."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from typing import Literal

from pydantic import BaseModel

from m3_agent.serving.planner import GPU_MEMORY_GB


class GPU(BaseModel):
    """One GPU as the vendor tool reports it; `kind` is the planner's name for it when known."""

    index: int
    name: str
    memory_gb: float
    vendor: Literal["nvidia", "amd"]
    kind: str | None = None


def gpu_kind(name: str) -> str | None:
    """The planner's GPU name inside a vendor's product name ("NVIDIA H200 NVL" -> "H200")."""
    upper = name.upper()
    # Longest first, so "H200" wins over "H20" and "MI325X" is not read as something shorter.
    for kind in sorted(GPU_MEMORY_GB, key=len, reverse=True):
        if kind in upper:
            return kind
    return None


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def parse_nvidia_smi(text: str) -> list[GPU]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits` (MiB)."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        try:
            mib = float(parts[2])
        except ValueError:
            continue
        gpus.append(GPU(index=int(parts[0]), name=parts[1], memory_gb=round(mib / 1024, 1), vendor="nvidia",
                        kind=gpu_kind(parts[1])))
    return gpus


def parse_rocm_smi(text: str) -> list[GPU]:
    """`rocm-smi --showproductname --showmeminfo vram --json`: one object per card."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return []
    gpus = []
    for card, fields in sorted(data.items()):
        if not card.lower().startswith("card") or not isinstance(fields, dict):
            continue
        low = {k.lower(): str(v) for k, v in fields.items()}
        name = next((low[k] for k in ("card series", "card model", "marketing name", "card sku") if low.get(k)), "")
        total = low.get("vram total memory (b)")
        if total is None or not total.isdigit():
            continue
        index = int("".join(c for c in card if c.isdigit()) or 0)
        gpus.append(GPU(index=index, name=name, memory_gb=round(int(total) / 1024**3, 1), vendor="amd",
                        kind=gpu_kind(name)))
    return gpus


def detect_gpus() -> list[GPU]:
    """The GPUs `nvidia-smi` reports, else those `rocm-smi` reports, else none."""
    out = _run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"])
    if out:
        found = parse_nvidia_smi(out)
        if found:
            return found
    out = _run(["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"])
    return parse_rocm_smi(out) if out else []


def summary(gpus: list[GPU]) -> str:
    """ "8x NVIDIA H200 (141 GB)" style description."""
    if not gpus:
        return "no GPU found (nvidia-smi / rocm-smi)"
    counts = Counter((g.name, g.memory_gb) for g in gpus)
    return ", ".join(f"{n}x {name} ({mem:g} GB)" for (name, mem), n in counts.items())


# Which profile to use for a machine, by GPU kind and count (first match wins).
_AUTO_PROFILES = [
    ({"H200", "H20", "GH200"}, 8, "h200-tp8"),
    ({"B200", "B300"}, 8, "b200"),
    ({"MI300X", "MI325X", "MI350X", "MI355X"}, 8, "amd-tp8"),
    ({"H200", "GH200"}, 4, "h200x4-fp8"),
    ({"H200", "GH200"}, 2, "h200x2-fp8"),
]


def auto_profile(gpus: list[GPU]) -> str | None:
    """The profile that fits this machine's GPUs, None when no profile is made for it."""
    if not gpus:
        return None
    kind = gpus[0].kind
    for kinds, count, name in _AUTO_PROFILES:
        if kind in kinds and len(gpus) >= count:
            return name
    return None
