"""A package index of a test's own: PEP 691 JSON with upload times, served on loopback, and pip configured
to use it (`PIP_CONFIG_FILE`, which pip reads instead of the user's configuration)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import io
import json
import os
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path


def make_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of `name` whose module tells its version; `requires`: its Requires-Dist lines."""
    dist = f"{name}-{version}.dist-info"
    needs = "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{name}.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{needs}",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={_b64(hashlib.sha256(t.encode()).digest())},{len(t.encode())}\n"
                     for p, t in files.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(p, t)
    return path


def make_sdist(folder: Path, name: str, version: str, setup_py: str) -> Path:
    """An sdist of `name` with `setup_py` as its setup.py (no pyproject.toml: setuptools' legacy build)."""
    path = folder / f"{name}-{version}.tar.gz"
    files = {"setup.py": setup_py, "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}.py": f"VERSION = {version!r}\n"}
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{rel}")
            info.size = len(data)
            tar.addfile(info, fileobj=io.BytesIO(data))
    return path


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class Index(http.server.ThreadingHTTPServer):
    """PEP 691 JSON simple index of `files` (filename -> (path, upload time)) on loopback; a context manager
    that serves while open."""

    def __init__(self, files: dict[str, tuple[Path, str]]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = files

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/simple/"

    def __enter__(self) -> Index:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        files: dict[str, tuple[Path, str]] = self.server.files
        parts = [p for p in self.path.split("?")[0].split("/") if p]
        if parts[:1] == ["files"] and len(parts) == 2 and parts[1] in files:
            return self._reply(files[parts[1]][0].read_bytes(), "application/octet-stream")
        if parts[:1] != ["simple"] or len(parts) != 2:
            return self.send_error(404)
        project = parts[1]
        listed = [{"filename": f, "url": f"/files/{f}", "upload-time": when,
                   "hashes": {"sha256": hashlib.sha256(p.read_bytes()).hexdigest()}}
                  for f, (p, when) in sorted(files.items()) if norm(f.split("-")[0]) == project]
        if not listed:
            return self.send_error(404)
        body = json.dumps({"meta": {"api-version": "1.1"}, "name": project, "files": listed}).encode()
        self._reply(body, "application/vnd.pypi.simple.v1+json")

    def _reply(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def pip_configured(settings: str, folder: Path) -> Iterator[Path]:
    """pip configured with `settings` (lines of its [global] section) while open, through a file in `folder`."""
    conf = folder / "pip.conf"
    conf.write_text(f"[global]\n{settings}")
    saved = os.environ.get("PIP_CONFIG_FILE")
    os.environ["PIP_CONFIG_FILE"] = str(conf)
    try:
        yield conf
    finally:
        if saved is None:
            os.environ.pop("PIP_CONFIG_FILE", None)
        else:
            os.environ["PIP_CONFIG_FILE"] = saved
