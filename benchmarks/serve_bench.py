"""Side-by-side: `m3-agent serve bench` (built-in load generator) vs `vllm bench serve`, same stand-in.

Both tools run as separate processes against one stand-in server process (a scripted test double
that streams a fixed reply after a fixed delay), on the same workload. Reported per tool: the
metrics each measured, its wall time and its CPU time. Because the server's behaviour is known (a
`DELAY_S` wait before the first token), TTFT has a floor both tools must see.

The peer is installed by this script from PyPI into a venv under the cache folder
($M3_BENCH_CACHE, default ~/.cache/m3-agent/bench-peers), never into the project's environment.
`vllm bench serve` needs a tokenizer; a small local one is built with `tokenizers` (no hub access).

    .venv/bin/python benchmarks/serve_bench.py [--num-prompts 256] [--concurrency 32]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from m3_agent.serving.bench import vllm_bench_argv
from m3_agent.serving.loadgen import LoadConfig

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("M3_BENCH_CACHE", Path.home() / ".cache" / "m3-agent" / "bench-peers"))
PEER_VENV = CACHE / "vllm-venv"
TOKENIZER_DIR = CACHE / "bench-tokenizer"
DELAY_S = 0.05
REPLY_WORDS = 128  # the stand-in streams this many words (~256 toy tokens with the spaces) per request
WORDS = [f"w{i}" for i in range(5000)]


def log(msg: str) -> None:
    print(f"[serve_bench] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_peer() -> tuple[Path | None, str]:
    """The peer's `vllm` executable, installing it on first use; (None, why) when it cannot be had."""
    exe = PEER_VENV / "bin" / "vllm"
    if exe.exists():
        return exe, ""
    log(f"installing the peer (vllm) into {PEER_VENV}: large, once")
    CACHE.mkdir(parents=True, exist_ok=True)
    if not (PEER_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    pip = [str(PEER_VENV / "bin" / "python"), "-m", "pip"]
    r = subprocess.run([*pip, "install", "-q", "vllm"], capture_output=True, text=True)
    if r.returncode != 0 or not exe.exists():
        return None, f"pip install vllm failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
    # Their native ops are built against another torch than the one resolved here and fail on import;
    # the benchmark client never uses them, and transformers skips them when absent.
    subprocess.run([*pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], capture_output=True)
    return exe, ""


def ensure_tokenizer() -> Path:
    """A small word-level tokenizer folder that transformers' AutoTokenizer can load offline."""
    if (TOKENIZER_DIR / "tokenizer.json").exists():
        return TOKENIZER_DIR
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    tok.save(str(TOKENIZER_DIR / "tokenizer.json"))
    (TOKENIZER_DIR / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "[UNK]",
                "eos_token": "[EOS]",
                "model_max_length": 1048576,
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            }
        )
    )
    return TOKENIZER_DIR


def start_standin(port: int, script_path: Path) -> subprocess.Popen:
    script = {
        "model": "minimax-m3",
        "max_model_len": 1048576,
        "turns": [{"content": " ".join(WORDS[:REPLY_WORDS]), "delay_s": DELAY_S, "repeat": 10**9}],
    }
    script_path.write_text(json.dumps(script))
    # socketserver's listen backlog is 5: 32 connections opened at once then get reset now and then.
    # A real server's is in the thousands (uvicorn: 2048), so the benchmark's server gets 128.
    code = (
        "import time; from http.server import ThreadingHTTPServer; ThreadingHTTPServer.request_queue_size = 128; "
        "from m3_agent.standin.server import StandinServer; "
        f"s = StandinServer({str(script_path)!r}, port={port}).start(); "
        "print('ready', flush=True); time.sleep(10**6)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def timed(
    argv: list[str], env: dict | None = None, timeout: float = 1800
) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run argv; return it with its wall time and the CPU seconds it (and its children) used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return r, wall, cpu


KEYS = [
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--skip-peer", action="store_true")
    a = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        server = start_standin(port, Path(tmp) / "script.json")
        try:
            log("m3-agent serve bench (built-in load generator)")
            workload = (f"--input-len {a.input_len} --output-len {a.output_len} --concurrency {a.concurrency} "
                        f"--num-prompts {a.num_prompts}").split()
            r, wall, cpu = timed([sys.executable, "-m", "m3_agent.serving", "bench", "--base-url", f"{base}/v1",
                                  "--model", "minimax-m3", *workload, "--tool", "builtin", "--json"])
            if r.returncode != 0:
                raise SystemExit(f"m3-agent bench failed: {r.stderr.strip()[-500:]}")
            ours = json.loads(r.stdout.strip().splitlines()[-1])
            results["m3_agent"] = {**{k: ours[k] for k in KEYS}, "wall_s": wall, "cpu_s": cpu}

            peer, why = (None, "skipped (--skip-peer)") if a.skip_peer else ensure_peer()
            if peer is None:
                results["vllm_bench_serve"] = {"error": why}
            else:
                log("vllm bench serve (peer)")
                tok = ensure_tokenizer()
                out_dir = Path(tmp) / "vllm"
                out_dir.mkdir()
                env = {**os.environ, "OPENAI_API_KEY": "EMPTY", "HF_HUB_OFFLINE": "1"}
                cfg = LoadConfig(base_url=f"{base}/v1", model="minimax-m3", input_len=a.input_len,
                                 output_len=a.output_len, concurrency=a.concurrency, num_prompts=a.num_prompts)
                # The same command `m3-agent serve bench --tool vllm` runs, with the peer venv's executable.
                argv = vllm_bench_argv(cfg, result_dir=str(out_dir), result_file="r.json", tokenizer=str(tok))
                r, wall, cpu = timed([str(peer), *argv[1:]], env=env)
                saved = out_dir / "r.json"
                if r.returncode != 0 or not saved.exists():
                    results["vllm_bench_serve"] = {"error": (r.stderr or r.stdout).strip()[-800:]}
                else:
                    data = json.loads(saved.read_text())
                    data["failed"] = data.get("num_prompts", a.num_prompts) - data.get("completed", 0)
                    results["vllm_bench_serve"] = {**{k: data.get(k) for k in KEYS}, "wall_s": wall, "cpu_s": cpu}
        finally:
            os.killpg(server.pid, 15)
            server.wait(timeout=10)

    ours, peer_r = results["m3_agent"], results["vllm_bench_serve"]
    for name, res in results.items():
        if "error" in res:
            log(f"{name}: unavailable: {res['error']}")
            continue
        log(
            f"{name:17} out {res['output_throughput']:9.1f} tok/s  total {res['total_token_throughput']:9.1f} tok/s  "
            f"TTFT {res['mean_ttft_ms']:7.1f} ms (p99 {res['p99_ttft_ms']:7.1f})  ITL {res['mean_itl_ms']:6.2f} ms  "
            f"wall {res['wall_s']:5.1f}s  cpu {res['cpu_s']:5.1f}s"
        )
    summary = {
        "benchmark": "serve_bench",
        "server": "m3-agent stand-in (scripted test double)",
        "workload": {
            "input_len": a.input_len,
            "output_len": a.output_len,
            "concurrency": a.concurrency,
            "num_prompts": a.num_prompts,
            "scripted_first_token_delay_ms": DELAY_S * 1000,
        },
        "m3_agent": ours,
        "vllm_bench_serve": peer_r,
    }
    if "error" not in peer_r:
        summary["ratio_m3_agent_over_peer"] = {
            k: (ours[k] / peer_r[k] if peer_r.get(k) else None)
            for k in ("output_throughput", "mean_ttft_ms", "mean_itl_ms", "wall_s", "cpu_s")
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
