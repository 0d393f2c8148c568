"""One client for an M3 endpoint: its URLs, the key it gets, and the route every request takes.

    client = EndpointClient("http://gpu-node:8000/v1", api_key=key)
    client.models(); client.card(); client.tokenize(model, text); client.health(); client.metrics()
    openai.OpenAI(base_url=client.base_url, http_client=client.sdk_http())    # chat, as agent/model.py does

Every request m3-agent sends to a model server goes through here: chat completions (the openai SDK
on `sdk_http()`), `/v1/models`, `/tokenize`, `/health`, `/metrics`. One proxy policy for all of
them (`proxy_for`): a loopback host always goes direct; any other host goes through HTTP_PROXY /
HTTPS_PROXY unless NO_PROXY names it. A 401 is `EndpointAuthError` (exit 8), naming the key masked.
"""

from __future__ import annotations

import base64
import http.client
import ipaddress
import json
import ssl
import threading
import urllib.request
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel

from m3_agent.errors import EndpointAuthError, EndpointError, UsageError
from m3_agent.redact import mask

NO_KEY = "EMPTY"  # the placeholder the SDK sends when no key is set; a server without a key ignores it


def shown_key(value: str | None, source: str | None = None) -> str:
    """The key a request carried, as a message may show it: masked, and where it came from."""
    if not value or value == NO_KEY:
        return "no key"
    return f"the key {mask(value)} (from {source})" if source else f"the key {mask(value)}"


def refused_key(url: str, key: str | None, source: str | None) -> EndpointAuthError:
    """The one-line error for a 401 from `url`: which key went, from where, and what to do."""
    return EndpointAuthError(
        f"the model server at {url} refused the request (HTTP 401): sent {shown_key(key, source)}; "
        "give the endpoint's key with --api-key or M3_AGENT_MODEL__API_KEY "
        "(an endpoint `m3-agent serve start` launched: its key is in the serve state)"
    )


class ServedModel(BaseModel):
    """One model a server lists in `GET /v1/models`: its id and, from vLLM, its context window."""

    id: str
    max_model_len: int | None = None


def served_models(answer: Any) -> list[ServedModel]:
    """The models a `/v1/models` answer lists, in its order; entries without an id are skipped."""
    data = answer.get("data") if isinstance(answer, dict) else None
    models = []
    for card in data if isinstance(data, list) else []:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            window = card.get("max_model_len")
            models.append(ServedModel(id=card["id"], max_model_len=window if isinstance(window, int) and window > 0
                                      else None))
    return models


def is_loopback(host: str) -> bool:
    """True when only this machine can reach `host`: 127.0.0.0/8, ::1 or `localhost`."""
    name = host.strip().strip("[]").lower()
    try:
        return name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name (or "" / a wildcard someone spelled oddly): assume others reach it


def proxy_for(url: str) -> str | None:
    """The proxy a request to `url` goes through: None (direct) for loopback and NO_PROXY hosts."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if is_loopback(host) or urllib.request.proxy_bypass_environment(parts.netloc.rpartition("@")[2]):
        return None
    proxy = urllib.request.getproxies_environment().get(parts.scheme)
    return proxy if not proxy or "://" in proxy else f"http://{proxy}"  # `HTTP_PROXY=host:3128` is an http proxy


class EndpointClient:
    """JSON requests to one server over keep-alive connections (one per thread), on `proxy_for`'s route.

    `base_url` is the server root or ends in /v1; `timeout` bounds each connection's operations.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, key_source: str | None = None,
                 timeout: float = 30.0) -> None:
        self.root = base_url.rstrip("/").removesuffix("/v1")
        parts = urlsplit(self.root)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"not an http(s) URL: {base_url!r}")
        self.base_url = self.root + "/v1"
        self.api_key = api_key if api_key and api_key != NO_KEY else None
        self.key_source = key_source
        self.timeout = timeout
        self.proxy = proxy_for(self.root)
        self._target, self._prefix = parts, parts.path
        hop = urlsplit(self.proxy or "")  # `http://user:pass@proxy:3128`: the proxy's own credentials
        login = f"{unquote(hop.username)}:{unquote(hop.password or '')}" if hop.username else None
        self._proxy_auth = {"Proxy-Authorization": "Basic " + base64.b64encode(login.encode()).decode()} if login else {}
        self._headers = {"User-Agent": "m3-agent", "Content-Type": "application/json",
                         **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
                         **(self._proxy_auth if parts.scheme == "http" else {})}  # https: in the CONNECT
        self._local = threading.local()

    def sdk_http(self) -> Any:
        """The HTTP client for the openai SDK, on the same route (the SDK's own defaults otherwise)."""
        import openai

        # trust_env=False: the route is `proxy_for`'s; TLS trusts what `send` trusts (the system's CAs, SSL_CERT_FILE)
        return openai.DefaultHttpxClient(proxy=self.proxy, trust_env=False, verify=ssl.create_default_context())

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            hop = urlsplit(self.proxy) if self.proxy else self._target
            cls = http.client.HTTPSConnection if self._target.scheme == "https" else http.client.HTTPConnection
            conn = cls(hop.hostname, hop.port, timeout=self.timeout)
            if self.proxy and self._target.scheme == "https":
                conn.set_tunnel(self._target.hostname, self._target.port, self._proxy_auth)  # CONNECT
            self._local.conn = conn
        return conn

    def send(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        """One request (`path` from the server root): its status and body; EndpointError when nothing answers."""
        data = None if body is None else json.dumps(body).encode()
        # a forward proxy for http:// takes the absolute URL; a tunnel or a direct connection the path
        url = (self.root if self.proxy and self._target.scheme == "http" else self._prefix) + path
        for attempt in range(2):  # a keep-alive connection the server closed gets one fresh retry
            conn = self._conn()
            try:
                conn.request(method, url, body=data, headers=self._headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._local.conn = None
                if attempt == 0 and isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)):
                    continue
                raise EndpointError(f"{method} {self.root}{path} failed: {e}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def json(self, method: str, path: str, body: dict | None = None) -> Any:
        """The decoded JSON of a 200 answer; EndpointAuthError on 401, EndpointError otherwise."""
        status, raw = self.send(method, path, body)
        if status == 401:
            raise refused_key(self.root + path, self.api_key, self.key_source)
        if status != 200:
            raise EndpointError(f"{method} {self.root}{path} answered HTTP {status}: "
                                f"{raw[:200].decode(errors='replace')}")
        try:
            return json.loads(raw)
        except ValueError:
            raise EndpointError(f"{method} {self.root}{path} answered non-JSON: {raw[:200]!r}") from None

    def models(self) -> list[ServedModel]:
        """`GET /v1/models`: the served models, in the server's order."""
        return served_models(self.json("GET", "/v1/models"))

    def card(self, model: str | None = None) -> ServedModel:
        """The `ServedModel` the server lists for `model`, or its first when None."""
        card = next((m for m in self.models() if model is None or m.id == model), None)
        if card is None:
            raise EndpointError(f"{self.root}/v1/models does not list {model or 'any model'}")
        return card

    def tokenize(self, model: str, text: str) -> int:
        """`POST /tokenize` (vLLM): the token count of `text`, without special tokens."""
        answer = self.json("POST", "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
        if not isinstance(answer, dict) or not isinstance(answer.get("count"), int):
            raise EndpointError(f"{self.root}/tokenize answered without a count")
        return answer["count"]

    def health(self) -> bool | None:
        """`GET /health` answers 200 (it needs no key on vLLM and SGLang); False while loading or unreachable;
        None when the server has no such route (404: llama-cpp-python's)."""
        try:
            status = self.send("GET", "/health")[0]
        except EndpointError:
            return False
        return None if status == 404 else status == 200

    def metrics(self) -> str | None:
        """The Prometheus text of `GET /metrics`; None when the server has no such page or does not answer."""
        try:
            status, raw = self.send("GET", "/metrics")
        except EndpointError:
            return None
        return raw.decode("utf-8", "replace") if status == 200 else None

    def check(self) -> None:
        """Fail fast: EndpointError when nothing answers, EndpointAuthError when the key is refused.

        Any other answer passes: a server still loading (503) and path problems get the loop's full
        message and retries.
        """
        try:
            status, _ = self.send("GET", "/v1/models")
        except EndpointError as e:
            raise EndpointError(f"cannot reach the model server at {self.base_url}: {e}. "
                                "Start it (m3-agent serve start) or check --base-url") from None
        if status == 401:
            raise refused_key(self.base_url, self.api_key, self.key_source)
