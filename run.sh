#!/usr/bin/env bash
# One entry point for a fresh Debian machine (as root, or with sudo):
#   bash run.sh demo   set everything up, then run `m3-agent fix` on the bundled demo repo
#   bash run.sh test   set everything up (with the conformance oracles and the real-model tier's
#                      llama.cpp server), then run the whole test suite
# Each step is idempotent: a second run skips what is done.
set -euo pipefail
cd "$(dirname "$0")"

log() { printf '\033[1m[m3-agent setup]\033[0m %s\n' "$*" >&2; }
die() { printf 'm3-agent setup: error: %s\n' "$*" >&2; exit "${2:-1}"; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 && SUDO="sudo" || SUDO=""
fi
APT_UPDATED=0
apt_install() {
  command -v apt-get >/dev/null 2>&1 || die "need these packages and apt-get is missing: $*" 4
  if [ "$APT_UPDATED" = 0 ]; then
    log "apt-get update"
    $SUDO apt-get update -qq
    APT_UPDATED=1
  fi
  log "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

ensure_python() {
  local py
  py=$(command -v python3 || true)
  if [ -z "$py" ] || ! "$py" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null; then
    apt_install python3 python3-venv python3-pip
  fi
  if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    apt_install python3-venv
  fi
  command -v git >/dev/null 2>&1 || apt_install git
  # JavaScript repositories' packages are fetched on the host with npm (sandbox/nodeenv.py)
  command -v npm >/dev/null 2>&1 || apt_install npm
}

ensure_venv() {
  local stamp=.venv/.m3-agent-installed want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv"
    python3 -m venv .venv
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing m3-agent and its dependencies into .venv"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[dev]'
    echo "$want" > "$stamp"
  fi
  # Byte-compile the project (skips what is up to date): commands start faster, even where
  # PYTHONDONTWRITEBYTECODE keeps Python from caching what it compiles.
  .venv/bin/python -m compileall -q m3_agent agent sandbox tools evals fix serving >/dev/null
}

docker_up() { docker info >/dev/null 2>&1; }

ensure_docker() {
  if ! command -v debootstrap >/dev/null 2>&1; then
    apt_install debootstrap  # the offline sandbox-image path needs it when no registry answers
  fi
  if docker_up; then return; fi
  if ! command -v dockerd >/dev/null 2>&1; then
    apt_install docker.io
  fi
  if ! docker_up; then
    log "starting the Docker engine (no bridge: sandboxes run with network none)"
    $SUDO sh -c 'nohup dockerd --bridge=none --iptables=false --ip6tables=false >/var/log/m3-agent-dockerd.log 2>&1 &'
    for _ in $(seq 1 60); do docker_up && break; sleep 1; done
  fi
  docker_up || die "the Docker engine did not start; see /var/log/m3-agent-dockerd.log" 4
}

# The eval report's screenshot test renders the page in Debian's headless Chromium; its plot labels
# are sized for a monospace font, so the DejaVu fonts come too. Only `test` and `setup` need them.
ensure_browser() {
  if ! command -v chromium >/dev/null 2>&1 || ! dpkg -s fonts-dejavu-core >/dev/null 2>&1; then
    ( apt_install chromium fonts-dejavu-core ) || log "chromium could not be installed: the report's browser test will fail"
  fi
}

ensure_image() {
  .venv/bin/m3-agent sandbox build
}

# The conformance tier's oracles (vLLM's and SGLang's own code) in a cached venv outside the repo:
# a few minutes the first time, milliseconds once built. Its python is handed to the tests.
ensure_oracle() {
  local py
  py=$(bash tests/conformance/oracle-venv.sh) || die "could not build the conformance oracle venv (see above)" 4
  export M3_ORACLE_PYTHON="$py"
}

# The real-model tier's server (llama-cpp-python serving SmolLM2-135M, compiled for the CPU with
# Debian's gcc and cmake) in a cached venv outside the repo: about 10 minutes the first time,
# under a second once built. `serve start --profile cpu-tiny` uses the same venv.
ensure_llama() {
  if ! command -v cmake >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1 || ! command -v make >/dev/null 2>&1; then
    apt_install cmake g++ make
  fi
  bash serving/llama-server-venv.sh >/dev/null || die "could not build the llama.cpp server venv (see above)" 4
}

setup() {
  ensure_python
  ensure_venv
  ensure_docker
  ensure_image
}

case "${1:-}" in
  demo)
    setup
    exec .venv/bin/python examples/demo/run_demo.py
    ;;
  test)
    setup
    ensure_browser
    ensure_oracle
    ensure_llama
    shift
    exec .venv/bin/python -m pytest -q "$@"
    ;;
  setup)
    setup
    ensure_browser
    ;;
  *)
    echo "usage: bash run.sh demo | test [pytest args] | setup" >&2
    exit 2
    ;;
esac
