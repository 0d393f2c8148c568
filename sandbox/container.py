"""`Sandbox`: one hardened container with a repository in `/workspace` and a fast exec server inside.

    with Sandbox(SandboxConfig(), repo=Path("repo")) as sb:
        r = sb.exec("pytest -q", timeout=60)
        sb.write_file("pkg/mod.py", "x = 1\\n")
        patch = sb.diff()
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors

from m3_agent.errors import GitError, SandboxDied, SandboxUnavailable, UsageError
from m3_agent.sandbox import cleanup, server
from m3_agent.sandbox.channel import MOUNT_POINT, Channel, ChannelClosed, SharedSocket
from m3_agent.sandbox.config import WORKSPACE, ExecResult, SandboxConfig
from m3_agent.sandbox.engine import docker_client, image_exists, remove_container
from m3_agent.sandbox.image import ENV_PREFIX, GENERATED, SYSTEM_PATH
from m3_agent.sandbox.env.nodeenv import NODE_BIN, NODE_MODULES, WORKSPACE_BIN

HOME = "/home/sandbox"
SERVER_SOURCE = Path(server.__file__).read_text()
# The server's source travels in its environment (popped at once), its argv[0] is a name of its own,
# and no command line in the container says "python": `pkill -f python` in a command does not take
# the sandbox down with it. -I -S: no site import and no PYTHON* variables, for a quick start.
# The first python3 found runs the server, whatever its version (>= 3.9, see server.py): an instance image's own
# environments may be old. M3_AGENT_WORKDIR, when set, is linked as /workspace first, as root:
# mount="image", where the repository is copied into an in-memory `workdir` (SWE-bench's /testbed, where
# the image's environment expects it) and /workspace points there, so the tools' paths hold.
SERVER_COMMAND = ["bash", "-c", 'if [ -n "${M3_AGENT_WORKDIR:-}" ]; then { [ -L /workspace ] || rmdir /workspace '
                  '2>/dev/null || [ ! -e /workspace ]; } && ln -sfn "$M3_AGENT_WORKDIR" /workspace || exit 125; fi; '
                  'for p in $M3_AGENT_PY; do if command -v "$p" >/dev/null; then '
                  'exec -a m3-agent-server "$p" -I -S -c "$M3_AGENT_BOOT"; fi; done; '
                  'echo "m3-agent: tried $M3_AGENT_PY: not found" >&2; exit 127']
SERVER_ENV = {
    "M3_AGENT_PY": "/usr/bin/python3 /usr/local/bin/python3 /opt/miniconda3/bin/python3 python3",
    "M3_AGENT_BOOT": 'import os; exec(compile(os.environ.pop("M3_AGENT_SERVER"), "m3-agent-server", "exec"))',
    "M3_AGENT_SERVER": SERVER_SOURCE,
}
# Only the server (root, uid 0) holds these, and only until it has switched uids and emptied the
# bounding set: commands never have any capability.
SERVER_CAPS = ["SETUID", "SETGID", "SETPCAP"]
ANSWER_MARGIN_S = 30.0  # how much longer than a command's timeout the host waits for the server's answer
TAR_CHUNK = 1 << 20
READ_AHEAD_CHUNKS = 64  # at most this many MiB of tar data wait in memory
DIFF_LIMIT = 256 * 1024 * 1024
READ_LIMIT = 64 * 1024 * 1024  # read_file refuses larger files: a model-made 1 GB file must not land in our memory
PATCH_FILE = "/tmp/.m3-agent-restore.patch"
READ_ERRORS = {"missing": FileNotFoundError, "directory": IsADirectoryError}  # the server's error kinds; else OSError

TESTBED_BIN = "/opt/miniconda3/envs/testbed/bin"  # a SWE-bench instance image's environment

# Everything a command sees in its environment: nothing is inherited from the host.
BASE_ENV = {
    # The repository's environment first (sandbox.env.build), then a SWE-bench image's testbed env.
    "PATH": f"{ENV_PREFIX}/bin:{TESTBED_BIN}:{NODE_BIN}:{WORKSPACE_BIN}:{SYSTEM_PATH}",
    "npm_config_cache": f"{HOME}/.npm",  # npm and npx write their cache and logs here, never in the image
    "HOME": HOME,
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TERM": "dumb",
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "PYTHONUNBUFFERED": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}

# Make /workspace a repository with a base commit (pinned by a ref in copy mode, so no history rewrite
# inside can garbage-collect it); the user's global ignore keeps interpreter caches out of diffs.
GIT_INIT = r"""set -e
if ! git rev-parse -q --verify HEAD >/dev/null 2>&1; then
  if [ -f .git ]; then rm -f .git; fi
  if [ ! -d .git ]; then git init -q; fi
  git add -A
  git commit -q --allow-empty --no-verify -m "m3-agent: base"
fi
if [ -n "$M3_KEEP_BASE" ]; then git update-ref refs/m3-agent/base HEAD; fi
mkdir -p "$HOME/.config/git"
printf '%s\n' '__pycache__/' '*.py[co]' '.pytest_cache/' > "$HOME/.config/git/ignore"
# An environment image's generated files (sandbox.env.build): back in the workspace, never in its diff.
if [ -d "$M3_GENERATED" ]; then
  cp -Rn --preserve=timestamps "$M3_GENERATED/." .
  mkdir -p .git/info
  if [ -f "$M3_GENERATED.exclude" ]; then cat "$M3_GENERATED.exclude"; else
    (cd "$M3_GENERATED" && find . -type f | sed 's|^\.||'); fi >> .git/info/exclude
fi
# A compiled project's build (sandbox.env.toolchain) rebuilds what is newer than its outputs: a file as it was
# at the build gets an old time, any other the time of now, so a build tree of another commit is rebuilt.
if [ -n "$M3_KEEP_BASE" ] && [ -f "$M3_GENERATED.sources" ]; then
  cut -c67- "$M3_GENERATED.sources" | tr '\n' '\0' | xargs -0 -r touch -c
  sha256sum -c "$M3_GENERATED.sources" 2>/dev/null | sed -n 's/: OK$//p' | tr '\n' '\0' | xargs -0 -r touch -c -d @1
fi
# Its node_modules (sandbox.env.nodeenv), kept outside the workspace: linked in, never in its diff.
if [ -f "$M3_NODE_MODULES/.links" ]; then
  while read -r d; do
    if [ ! -e "$d/node_modules" ]; then mkdir -p "$d" && ln -s "$M3_NODE_MODULES/${d#./}/node_modules" "$d/node_modules"; fi
  done < "$M3_NODE_MODULES/.links"
  mkdir -p .git/info && echo node_modules >> .git/info/exclude
fi
git rev-parse HEAD
"""

# Back to the base commit (ignored files, e.g. build output copied from the host, stay), then the patch.
RESTORE = r"""set -e
git reset -q --hard BASE
git clean -fdq
if [ -s "$M3_PATCH" ]; then git apply --binary --whitespace=nowarn "$M3_PATCH"; fi
rm -f "$M3_PATCH"
"""

DIFF = r"""set -e
idx=$(mktemp)
trap 'rm -f "$idx"' EXIT
if [ -f .git/index ]; then cp -p .git/index "$idx"; else rm -f "$idx"; fi  # -p: git's racy-entry check needs its mtime
export GIT_INDEX_FILE="$idx"
git add -A
git diff --cached --binary --no-color --no-ext-diff BASE
"""


class Sandbox:
    """A hardened container holding a copy of `repo` (or an empty git repo) at /workspace.

    Use as a context manager, or call `start()` and `close()`. Raises SandboxUnavailable when the
    engine or the image is missing, and SandboxDied (a subclass) when the container has died: then
    `recreate(patch)` gives a fresh sandbox with the workspace restored to base commit + `patch`.
    """

    kind = "docker"
    isolated = True

    def __init__(self, config: SandboxConfig | None = None, repo: Path | None = None) -> None:
        self.config = config or SandboxConfig()
        self.repo = Path(repo) if repo is not None else None
        if self.repo is not None and not self.repo.is_dir():
            raise UsageError(f"repository {self.repo} is not a directory: pass an existing folder")
        if self.config.mount in ("bind", "image") and self.repo is None:
            raise UsageError(f"mount={self.config.mount!r} needs a repository: pass repo=")
        self.id: str | None = None
        self.base_commit: str | None = None
        self._client: docker.DockerClient | None = None
        self._channel: Channel | None = None
        self._lock = threading.Lock()
        self.death: str | None = None  # why the container is dead (None while it is not known to be)
        self._closed = False
        uid, _, gid = self.config.user.partition(":")
        self._ids = f"uid={uid},gid={gid or uid}"  # the command user, as tmpfs options

    # lifecycle

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Sandbox:
        """Create and start the container, copy the repository in, record the base commit."""
        if self.id is not None:
            return self
        client = self._client = docker_client()
        cfg = self.config
        if not image_exists(client, cfg.image):
            raise SandboxUnavailable(f"sandbox image {cfg.image} not found: run `m3-agent sandbox build`")
        tar = _TarStream(self.repo) if self.repo is not None and cfg.mount != "bind" else None
        try:
            self._create_and_attach(client)
            if tar is not None:  # through the exec server: tmpfs is not reachable by `docker cp`
                header, _ = self._request({"op": "put_tar", "dest": self._workspace()}, chunks=tar.chunks(),
                                          answer_timeout=cfg.start_timeout)
                if not header.get("ok"):
                    raise SandboxUnavailable(f"copying {self.repo} into the sandbox failed: "
                                             f"{header.get('error', '')[-300:]}")
            init = self.exec(GIT_INIT, timeout=cfg.start_timeout,
                             env={"M3_GENERATED": GENERATED, "M3_NODE_MODULES": NODE_MODULES, **({"M3_KEEP_BASE": "1"} if tar else {})})
            if init.exit_code != 0:
                raise SandboxUnavailable(f"cannot prepare /workspace as a git repository: {init.stderr.strip()[-300:]}")
            self.base_commit = init.stdout.strip().splitlines()[-1]
        except BaseException:
            self.close()
            raise
        finally:
            if tar is not None:
                tar.close()
        return self

    def _create_and_attach(self, client: docker.DockerClient) -> None:
        cfg = self.config
        # The engine listens on a Unix socket of this machine: a host directory can be shared with the container.
        local = client.api.base_url == "http+docker://localhost" and os.name == "posix"
        shared = SharedSocket() if cfg.transport == "auto" and local else None
        try:
            with cleanup.signals_held():  # the id and the tracking come with the container, or nothing does
                self.id = self._create(client, shared)
                cleanup.track(self)
            sock = client.api.attach_socket(self.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
            client.api.start(self.id)
            self._channel = Channel.establish(getattr(sock, "_sock", sock), shared, cfg.start_timeout)
        except docker.errors.APIError as e:
            raise SandboxUnavailable(f"cannot start the sandbox container: {e.explanation or e}") from None
        except ChannelClosed as e:
            raise SandboxUnavailable(f"the sandbox did not come up: {e}") from None
        finally:
            if shared is not None:
                shared.close()

    def _create(self, client: docker.DockerClient, shared: SharedSocket | None) -> str:
        """Create (not start) the container; its id."""
        cfg = self.config
        # mount='image': SERVER_COMMAND links /workspace to the image's workdir, as root, before the server starts
        setup = {"M3_AGENT_WORKDIR": cfg.workdir} if cfg.mount == "image" else {}
        return client.api.create_container(
            cfg.image,
            command=SERVER_COMMAND,
            user="0:0",  # the server's uid; it runs every command as cfg.user (see server.drop_privileges)
            working_dir=self._workspace(),
            environment={**BASE_ENV, **cfg.env, **(shared.env if shared else {}), **SERVER_ENV, **setup,
                         "M3_AGENT_USER": cfg.user},
            labels={**cfg.labels, **cleanup.owner_labels()},
            stdin_open=True,
            detach=False,
            host_config=client.api.create_host_config(**self._host_config(shared)),
        )["Id"]

    def _host_config(self, shared: SharedSocket | None) -> dict:
        cfg = self.config
        tmpfs = {
            "/tmp": f"rw,exec,nosuid,nodev,size={cfg.tmp_size},mode=1777",
            HOME: f"rw,exec,nosuid,nodev,size=256m,{self._ids},mode=0755",
        }
        binds = {}
        if cfg.mount != "bind":
            tmpfs[self._workspace()] = f"rw,exec,nosuid,nodev,size={cfg.workspace_size},{self._ids},mode=0755"
        else:
            binds[str(self.repo.resolve())] = {"bind": WORKSPACE, "mode": "rw"}
        if shared is not None:
            binds[shared.dir] = {"bind": MOUNT_POINT, "mode": "ro"}
        return dict(
            network_mode=cfg.network,
            cap_drop=["ALL"],
            cap_add=SERVER_CAPS,
            security_opt=["no-new-privileges"],
            log_config={"type": "none"},  # the attach stream carries the server's output: nothing to keep on disk
            pids_limit=cfg.pids_limit,
            mem_limit=cfg.memory,
            memswap_limit=cfg.memory,
            nano_cpus=int(cfg.cpus * 1e9),
            read_only=cfg.read_only and cfg.mount != "image",  # the /workspace link is made on the root fs
            tmpfs=tmpfs,
            binds=binds or None,
            init=True,
            auto_remove=True,
            ipc_mode="private",
            **({"runtime": cfg.runtime} if cfg.runtime else {}),
        )

    def _workspace(self) -> str:
        """Where the repository is in the container: the image's workdir for mount='image'."""
        return self.config.workdir if self.config.mount == "image" else WORKSPACE

    def close(self) -> None:
        """Stop and remove the container (idempotent)."""
        cleanup.untrack(self)
        self.kill(self._client)
        if self._client is not None:
            self._client.close()

    def kill(self, client: docker.DockerClient | None = None) -> None:
        """Remove the container (once) through `client`, or a connection of its own when None (from a signal
        handler or at exit); close the channel."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.id is not None:
                engine = client or docker.from_env(timeout=10)
                remove_container(engine, self.id)  # before the socket closes, so auto-remove does not race it
                if client is None:
                    engine.close()
        except (docker.errors.DockerException, OSError):
            pass  # engine unreachable: the socket closed below still makes the container stop and auto-remove
        finally:
            if self._channel is not None:
                self._channel.close()

    # commands and files

    def exec(self, cmd: str, timeout: float | None = None, cwd: str | None = None,
             env: dict | None = None) -> ExecResult:
        """Run `cmd` with bash in the container (cwd defaults to /workspace; relative cwd is under it).

        On timeout the command's whole process tree is killed; the sandbox stays usable.
        """
        return self._exec(cmd, timeout, cwd, env, self.config.output_limit)

    def _exec(self, cmd: str, timeout: float | None, cwd: str | None, env: dict | None,
              limit: int) -> ExecResult:
        timeout = self.config.timeout if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, not {timeout}")
        req = {"op": "exec", "cmd": cmd, "timeout": timeout, "cwd": cwd,
               "env": {str(k): str(v) for k, v in (env or {}).items()}, "limit": limit}
        header, data = self._request(req, answer_timeout=timeout + ANSWER_MARGIN_S)
        data = data or b""
        n_out = header["stdout_len"]
        return ExecResult(
            stdout=data[:n_out].decode(errors="replace"),
            stderr=data[n_out:].decode(errors="replace"),
            exit_code=header["exit_code"],
            timed_out=header["timed_out"],
            truncated=header["truncated"],
            duration_s=round(header["duration_s"], 6),
        )

    def write_file(self, path: str, data: str | bytes) -> None:
        """Write a file (relative paths are under /workspace), creating parent directories."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        chunks = [raw[i : i + TAR_CHUNK] for i in range(0, len(raw), TAR_CHUNK)]
        header, _ = self._request({"op": "write", "path": str(path)}, chunks=chunks)
        if not header.get("ok"):
            raise OSError(header.get("error", f"cannot write {path}"))

    def read_file(self, path: str, limit: int = READ_LIMIT) -> bytes:
        """The bytes of a file (relative paths are under /workspace); FileNotFoundError when missing,
        OSError when it is over `limit` bytes."""
        header, data = self._request({"op": "read", "path": str(path), "limit": int(limit)})
        if header.get("ok"):
            return data or b""
        error = READ_ERRORS.get(header.get("kind"), OSError)
        raise error(header.get("error", f"cannot read {path}"))

    def diff(self) -> str:
        """`git diff` of /workspace against the base commit, new untracked (not ignored) files included.

        The base commit is HEAD of the repository copied in (a fresh commit when it had none), so
        changes uncommitted on the host at copy time are part of the diff. The real index is untouched.
        """
        r = self._exec(DIFF.replace("BASE", self.base_commit or "HEAD"), self.config.timeout, None, None, DIFF_LIMIT)
        if r.exit_code != 0 or r.truncated:
            raise GitError(f"git diff against the base commit failed in the sandbox (was .git changed?): "
                           f"{r.stderr.strip()[-300:]}")
        return r.stdout

    # recovery

    def restore(self, patch: str) -> None:
        """Make /workspace the base commit plus `patch` (a `diff()`), as in a sandbox that died.

        Copy mode only: in bind mode the workspace is the host directory, which outlives the container.
        Raises GitError when the patch does not apply.
        """
        if self.config.mount == "bind":
            raise UsageError("restore() is for mount='copy' or 'image': a bind-mounted workspace keeps its files")
        self.write_file(PATCH_FILE, patch)
        r = self.exec(RESTORE.replace("BASE", self.base_commit or "HEAD"), env={"M3_PATCH": PATCH_FILE})
        if r.exit_code != 0:
            raise GitError(f"cannot restore the workspace (base commit + patch): {r.stderr.strip()[-300:]}")

    def recreate(self, patch: str | None = None) -> Sandbox:
        """A fresh, started sandbox like this one (same config and repository), the workspace restored
        to the base commit plus `patch` in copy mode; this one is closed first. Raises what `start()`
        and `restore()` raise."""
        self.close()
        fresh = Sandbox(self.config, self.repo).start()
        try:
            if patch and self.config.mount != "bind":
                fresh.restore(patch)
        except BaseException:
            fresh.close()
            raise
        return fresh

    # plumbing

    def _request(self, req: dict, chunks: list[bytes] | Iterator[bytes] | None = None,
                 answer_timeout: float = 120.0) -> tuple[dict, bytes | None]:
        with self._lock:
            if self._closed or self._channel is None:
                raise SandboxUnavailable("the sandbox is closed: start a new one")
            if self.death is not None:
                raise SandboxDied(self.death)
            try:
                self._channel.send(req, chunks)
                return self._channel.receive(answer_timeout)
            except ChannelClosed as e:
                self.death = self._death_note(str(e))
                raise SandboxDied(self.death) from None
            except BaseException:  # half a request sent or half an answer read: the stream is out of step
                self.death = f"sandbox {str(self.id)[:12]} is unusable: a request was interrupted; start a new sandbox"
                raise

    def _death_note(self, why: str) -> str:
        state = ""
        try:
            info = self._client.api.inspect_container(self.id)["State"]
            state = f", OOM-killed={info.get('OOMKilled')}, exit={info.get('ExitCode')}"
        except (docker.errors.DockerException, OSError, TypeError, KeyError):
            pass  # the container is often gone already (auto-remove): the note says what we know
        diag = self._channel.diagnostics.splitlines()[-1:] if self._channel else []
        detail = f" ({diag[0][:200]})" if diag else ""
        return f"sandbox {str(self.id)[:12]} is dead: {why}{state}{detail}; start a new sandbox"


class _TarStream:
    """The repository as tar data from the host's `tar`, read ahead in a thread while the container starts."""

    def __init__(self, repo: Path) -> None:
        exe = shutil.which("tar")
        if exe is None:
            raise SandboxUnavailable("copying a repository into the sandbox needs `tar` on this machine: install it")
        self.repo = repo
        self._proc = subprocess.Popen([exe, "-C", str(repo), "-cf", "-", "."], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE)
        self._chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=READ_AHEAD_CHUNKS)
        self._thread = threading.Thread(target=self._read, name="m3-agent-tar", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while chunk := self._proc.stdout.read(TAR_CHUNK):
                self._chunks.put(chunk)
        finally:
            self._chunks.put(None)

    def chunks(self) -> Iterator[bytes]:
        """The tar data, chunk by chunk; raises when tar failed."""
        while (chunk := self._chunks.get()) is not None:
            yield chunk
        self._thread.join()
        err = self._proc.stderr.read().decode(errors="replace").strip()
        if self._proc.wait() not in (0, 1):  # 1: some files changed or vanished while being read
            raise SandboxUnavailable(f"tar of {self.repo} failed: {err[-300:]}")

    def close(self) -> None:
        """Stop tar if the copy was abandoned."""
        with self._proc:  # then its pipes are closed and it is reaped
            self._proc.kill()  # nothing when it has ended
            while self._thread.is_alive():  # unblock a reader waiting on a full queue
                try:
                    self._chunks.get_nowait()
                except queue.Empty:
                    self._thread.join(0.05)
