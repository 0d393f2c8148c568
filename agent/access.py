"""Who can reach a launched M3 endpoint: loopback by default, a key whenever other machines can;
what crosses the network when a client sends the repository to an endpoint elsewhere; and which
endpoint, with which key, a command talks to (`resolve_endpoint`).

`serve start` (and `--serve` on `fix` / `eval run`) binds 127.0.0.1 unless told `--host`. A host
other machines can reach, and the multi-node plans (whose servers answer other machines), need an
API key: `--api-key`, else M3_AGENT_MODEL__API_KEY (the variable the clients send their key
from, so one variable serves both ends), else a new random one. The engine takes it its own way
(`profiles.build_command`): vLLM through VLLM_API_KEY, SGLang through --api-key.
"""

from __future__ import annotations

import os
import secrets
import urllib.parse
from typing import Protocol

from pydantic import BaseModel, Field, FieldSerializationInfo, SecretStr, field_serializer

from m3_agent.agent.endpoint import NO_KEY, EndpointClient, is_loopback
from m3_agent.errors import UsageError
from m3_agent.redact import mask

LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"
KEY_ENV = "M3_AGENT_MODEL__API_KEY"  # settings.env_name("model.api_key"): the clients' variable


# What each engine's own key check leaves open (tests/conformance/test_endpoint_auth.py proves both).
ENGINE_CAVEATS = {
    "vllm": "vLLM 0.33 checks the key only under /v1, /v2, /inference and /cohere: /invocations, which runs the "
            "model, stays open (vllm issue #58144), as do /tokenize and /metrics; keep the port on a network only "
            "your team reaches, or put a proxy that checks the key in front",
    "sglang": "SGLang 0.5.23 checks the key on every path but /health, /ready and /metrics",
}


class ApiKey(BaseModel):
    """A key a launched endpoint requires, and where it came from (for status lines and errors)."""

    value: SecretStr
    source: str

    @field_serializer("value", when_used="json")
    def _value(self, value: SecretStr, info: FieldSerializationInfo) -> str:
        # in JSON the key is in clear only when the caller asks (`context={"secrets": True}`), else masked
        return value.get_secret_value() if (info.context or {}).get("secrets") else mask(value.get_secret_value())

    @property
    def shown(self) -> str:
        """The key masked, with its source: `****WXYZ (generated)`."""
        return f"{mask(self.value.get_secret_value())} ({self.source})"


def choose_key(host: str, api_key: str | None = None, *, shared: bool = False) -> ApiKey | None:
    """The key a launch on `host` requires: None on loopback unless one is given; else given, from
    M3_AGENT_MODEL__API_KEY, or new. `shared`: a multi-node plan, reachable whatever the host."""
    if api_key is not None:
        if not api_key.strip() or api_key == NO_KEY:
            raise UsageError(f"--api-key {api_key!r} is not a key: give a secret of your own, or omit it")
        return ApiKey(value=SecretStr(api_key), source="flag --api-key")
    if is_loopback(host) and not shared:
        return None
    from_env = os.environ.get(KEY_ENV, "")
    if from_env.strip() and from_env != NO_KEY:
        return ApiKey(value=SecretStr(from_env), source=f"env {KEY_ENV}")
    # a fresh key: 256 random bits, URL-safe, with a prefix that says what it is for
    return ApiKey(value=SecretStr("m3-" + secrets.token_urlsafe(32)), source="generated")


def describe_access(host: str | None, key: ApiKey | None) -> str:
    """One line on who can reach an endpoint: loopback only, or keyed (and with which key, masked)."""
    if host is None:
        return "unknown (recorded by an older m3-agent)"
    if key is not None:
        where = "loopback only" if is_loopback(host) else f"listens on {host}"
        return f"keyed: {where}; requests need the key {key.shown}"
    if is_loopback(host):
        return f"loopback only ({host}): no other machine can reach it, so no key"
    return f"OPEN: listens on {host} without a key; anyone who reaches the port can use it"


def client_host(bind_host: str) -> str:
    """The address a client on this machine dials for a server bound to `bind_host`."""
    name = bind_host.strip().strip("[]")
    if name in ("", ALL_INTERFACES, "::"):
        return LOOPBACK  # a wildcard bind answers on loopback too
    return f"[{name}]" if ":" in name else name


def plain_http_warning(base_url: str) -> str | None:
    """The warning for a repository about to go to another machine unencrypted; None when it does not."""
    u = urllib.parse.urlsplit(base_url)
    if u.scheme != "http" or is_loopback(u.hostname or ""):
        return None
    return (f"the repository goes to {u.hostname} over plain http:// ({base_url}): unencrypted, anyone on the "
            "network path can read it and the API key; use https:// or a tunnel, or silence this with "
            "warn_plain_http = false in [model] (M3_AGENT_MODEL__WARN_PLAIN_HTTP=false)")


def key_value(key: ApiKey | None) -> str | None:
    """The key in clear, for a request header (the endpoint client sends no SDK placeholder); None: none."""
    return key.value.get_secret_value() if key else None


class Endpoint(BaseModel):
    """Where the model is, and the key requests to it carry (None: no key)."""

    base_url: str
    key: ApiKey | None = None
    window: int | None = Field(None, description="the context window `serve start` gave the server there (None: "
                                                 "none recorded), for servers whose /v1/models does not say it")

    @property
    def key_secret(self) -> SecretStr | None:
        """The key as a config field takes it (`Settings.agent_config(api_key=...)`)."""
        return self.key.value if self.key else None

    def check(self, *, timeout: float = 5.0) -> None:
        """Fail fast when nothing listens here (EndpointError) or the key is refused (EndpointAuthError,
        exit 8); a server still loading (503) passes."""
        EndpointClient(self.base_url, api_key=key_value(self.key), key_source=self.key.source if self.key else None,
                       timeout=timeout).check()


class Launcher(Protocol):
    """What resolution asks of serving, which sits above the agent (`m3_agent.serving.endpoint.Served`)."""

    def ensure(self, base_url: str | None, key: ApiKey | None) -> str | None:
        """A healthy base URL of the profile `--serve` names (`base_url` reused when it answers); without a
        profile, `base_url` as it is."""

    def recorded_key(self, base_url: str) -> ApiKey | None:
        """The key `m3-agent serve start` recorded for the running server at `base_url`, if it has one."""

    def recorded_window(self, base_url: str) -> int | None:
        """The context window `m3-agent serve start` gave the running server at `base_url`, if it set one."""


def resolve_endpoint(base_url: str | None, *, key: ApiKey | None = None, serving: Launcher | None = None) -> Endpoint:
    """The endpoint to talk to: `base_url`, or the one `serving` launches or reuses.

    Its key: the serve state's when `m3-agent serve start` launched the server there, else `key` (the
    configured one). UsageError when there is no URL.
    """
    if serving is not None:
        base_url = serving.ensure(base_url, key)
    if not base_url:
        raise UsageError(
            "no model endpoint: pass --base-url URL (e.g. http://gpu-node:8000/v1) or --serve PROFILE, "
            "or set base_url in the [model] table of m3-agent.toml / M3_AGENT_MODEL__BASE_URL"
        )
    url = base_url.rstrip("/")
    return Endpoint(base_url=url, key=(serving.recorded_key(url) if serving else None) or key,
                    window=serving.recorded_window(url) if serving else None)
