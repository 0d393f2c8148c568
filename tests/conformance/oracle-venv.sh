#!/usr/bin/env bash
# Build (once) the virtualenv that holds the conformance tier's oracles: vLLM's and SGLang's own
# parser, protocol and CLI modules, without their GPU dependency trees. Prints its python's path.
#
#   bash tests/conformance/oracle-venv.sh            # vLLM 0.33.0, SGLang 0.5.23
#   M3_ORACLE_VLLM=0.34.0 bash tests/conformance/oracle-venv.sh   # another vLLM: its own venv
#
# Reused while its stamp matches this script and the versions, so a warm run costs a few ms.
# torch comes first and pinned: the machines carry a CPU build of torch 2.13.0, and any other torch
# request would pull a multi-GB CUDA build; vLLM and SGLang go in with --no-deps for the same reason,
# and every later install is constrained to that torch.
set -euo pipefail

VLLM_VERSION=${M3_ORACLE_VLLM:-0.33.0}
SGLANG_VERSION=${M3_ORACLE_SGLANG:-0.5.23}
TORCH_VERSION=${M3_ORACLE_TORCH:-2.13.0}
CACHE=${M3_ORACLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/m3-agent}
VENV="$CACHE/oracle-venv-vllm$VLLM_VERSION-sglang$SGLANG_VERSION"
PY=${M3_ORACLE_BASE_PYTHON:-python3}

# What the parser, protocol and CLI modules import (found by importing them and adding what failed).
# transformers is pinned inside both engines' ranges. The last line: what vLLM's API server app needs to be
# built on CPU (its API-key middleware is tested through it), and the router the --replicas plan prints.
DEPS=(
  packaging regex cachetools psutil sentencepiece numpy requests tqdm blake3 py-cpuinfo
  "transformers==5.19.0" huggingface_hub tokenizers safetensors protobuf "fastapi<0.137" aiohttp
  openai pydantic orjson prometheus_client pillow msgspec cloudpickle uvloop partial-json-parser
  ijson "mistral_common>=1.11.6" oss-harmony pybase64 pyzmq pyyaml jsonschema einops cbor2
  setproctitle "xgrammar==0.2.8" "llguidance>=1.7,<1.8" watchfiles ipython uvicorn
  "prometheus-fastapi-instrumentator>=8.0.0" "model-hosting-container-standards>=0.1.14,<1.0.0" "sglang-router==0.3.2"
)

stamp_want=$( { cat "$0"; echo "$VLLM_VERSION $SGLANG_VERSION $TORCH_VERSION"; } | sha256sum | cut -d' ' -f1)
mkdir -p "$CACHE"
# One build at a time: a second test run starting meanwhile waits, then finds the venv built.
exec 9>"$CACHE/.oracle-venv.lock"
flock 9
if [ "$(cat "$VENV/.m3-oracle-stamp" 2>/dev/null)" = "$stamp_want" ]; then
  echo "$VENV/bin/python"
  exit 0
fi

log() { printf '[oracle-venv] %s\n' "$*" >&2; }
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$CACHE"
log "building $VENV (vLLM $VLLM_VERSION, SGLang $SGLANG_VERSION, torch $TORCH_VERSION CPU)"
"$PY" -m venv "$VENV"
pip_q() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' >&2 || true; }
constraints="$VENV/constraints.txt"
echo "torch==$TORCH_VERSION" > "$constraints"
pip_q "torch==$TORCH_VERSION"
pip_q --no-deps "vllm==$VLLM_VERSION" "sglang==$SGLANG_VERSION"
pip_q -c "$constraints" "${DEPS[@]}"
# the pip_q calls swallow pip's exit code (its resolver warnings are expected): check the result
"$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF' || { log "the oracle venv is incomplete"; exit 1; }
import importlib.metadata as md, sys
assert md.version("vllm") == sys.argv[1], md.version("vllm")
assert md.version("torch").split("+")[0] == sys.argv[2], md.version("torch")
import vllm.parser.minimax_m3, vllm.reasoning.minimax_m3_reasoning_parser  # noqa: E401
import vllm.entrypoints.openai.chat_completion.protocol, vllm.entrypoints.cli.serve  # noqa: E401
import sglang.srt.server_args, sglang_router.router_args  # noqa: E401
import vllm.entrypoints.launchers.app  # noqa: F401
EOF
echo "$stamp_want" > "$VENV/.m3-oracle-stamp"
log "built in $(( $(date +%s) - start ))s"
echo "$VENV/bin/python"
