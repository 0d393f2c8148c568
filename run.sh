#!/usr/bin/env bash
# One entry point for a fresh Debian machine (as root, or with sudo):
#   bash run.sh demo   set everything up, then run `m3-agent fix` on the bundled demo repo
#   bash run.sh test   set everything up (with the conformance oracles and the real-model tier's
#                      llama.cpp server) and run the whole test suite; the slow builds go on in
#                      the background while the suite runs, and the tiers that need them run last
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
  # JavaScript repositories' packages are fetched on the host with npm (sandbox/env/nodeenv.py)
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

# Images the suite builds on first use when they are missing: a newer Debian's sandbox (a project that needs a
# newer Python) and the toolchain image (projects that compile). Cold, each is a debootstrap of its own,
# mostly downloads: built in the background once the default image is there (they share its build lock),
# so the tests that need them find them built.
prebuild_images() {
  nice -n 10 .venv/bin/python - <<'PY'
from m3_agent.sandbox.env.toolchain import TOOLCHAIN
from m3_agent.sandbox.image import Recipe, build_image

for recipe in (Recipe("trixie"), Recipe("bookworm", TOOLCHAIN)):
    print(build_image(recipe.image, recipe=recipe))
PY
}

# The conformance tier's oracles (vLLM's and SGLang's own code) are a cached venv outside the repo
# (tests/conformance/oracle-venv.sh): a few minutes the first time, milliseconds once built. run.sh
# builds it in the background, and the tier, which runs late, asks the script for it: the script's
# lock makes it wait for that build.

# The real-model tier's server (llama-cpp-python serving SmolLM2-135M, compiled for the CPU with
# Debian's gcc and cmake) in a cached venv outside the repo: about 4 minutes the first time,
# under a second once built. `serve start --profile cpu-tiny` uses the same venv.
ensure_build_tools() {
  if ! command -v cmake >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1 || ! command -v make >/dev/null 2>&1; then
    apt_install cmake g++ make
  fi
}

# Steps that run in the background while the rest of the set-up (and, for the llama.cpp build, the test
# suite) goes on. Each writes its output and its log to $BG_DIR and its exit status last (renamed into
# place, so a reader never sees half of it): a failure is reported with its log, never lost.
BG_DIR=""
declare -A BG_PID=()
bg_start() {  # bg_start NAME COMMAND...
  local name=$1
  shift
  [ -n "$BG_DIR" ] || BG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/m3-agent-setup.XXXXXX")
  # job control on: the step gets a process group of its own, which bg_stop_all can end whole
  set -m
  ( set +e; "$@" >"$BG_DIR/$name.out" 2>"$BG_DIR/$name.log"; echo $? >"$BG_DIR/$name.rc.tmp"
    mv "$BG_DIR/$name.rc.tmp" "$BG_DIR/$name.rc" ) &
  BG_PID[$name]=$!
  set +m
  log "started in the background: $name (log: $BG_DIR/$name.log)"
}

# bg_wait NAME WHAT: wait for a background step; on failure print WHAT, its exit status and its log's
# last lines, and return 1.
bg_wait() {
  local name=$1 what=$2 rc
  wait "${BG_PID[$name]}" || true
  unset "BG_PID[$name]"
  rc=$(cat "$BG_DIR/$name.rc" 2>/dev/null || echo "lost")
  [ "$rc" = 0 ] && return 0
  BG_KEEP=1
  printf 'm3-agent setup: error: %s (exit %s); its log, %s, ends:\n' "$what" "$rc" "$BG_DIR/$name.log" >&2
  tail -n 25 "$BG_DIR/$name.log" | sed 's/^/  | /' >&2
  return 1
}

# A set-up step that dies leaves no background build running (a half-built venv is rebuilt next time);
# the logs go too, unless a step failed.
BG_KEEP=0
bg_stop_all() {
  local pid
  for pid in "${BG_PID[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  if [ -n "$BG_DIR" ] && [ "$BG_KEEP" = 0 ]; then rm -rf "$BG_DIR"; fi
}
trap bg_stop_all EXIT

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
    # Cold, the llama.cpp build (CPU, about 4 minutes) and the oracle venv (a few minutes) start first,
    # at low priority, and overlap the rest of the set-up and the suite. The conformance and real-model
    # tiers run last (tests/conftest.py) and wait for them: the scripts' locks, and for the server's
    # build M3_LLAMA_BUILD_STATUS, which fails the tier at once with the build's log if it failed.
    ensure_python
    ensure_build_tools
    bg_start llama nice -n 10 bash serving/llama-server-venv.sh
    bg_start oracle nice -n 10 bash tests/conformance/oracle-venv.sh
    export M3_LLAMA_BUILD_STATUS="$BG_DIR/llama.rc" M3_LLAMA_BUILD_LOG="$BG_DIR/llama.log"
    ensure_venv
    ensure_docker
    ensure_image
    bg_start images prebuild_images
    ensure_browser
    shift
    rc=0
    # the slowest tests, listed in every CI log, are where the suite's time goes (a later --durations wins)
    .venv/bin/python -m pytest -q --durations=30 "$@" || rc=$?
    [ -e "$M3_LLAMA_BUILD_STATUS" ] || log "waiting for the llama.cpp server build to finish"
    bg_wait images "could not build the trixie and toolchain sandbox images" || { [ "$rc" = 0 ] && rc=4; }
    bg_wait oracle "could not build the conformance oracle venv" || { [ "$rc" = 0 ] && rc=4; }
    bg_wait llama "could not build the llama.cpp server venv" || { [ "$rc" = 0 ] && rc=4; }
    exit "$rc"
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
