"""Every request to the endpoint takes one route: through HTTP_PROXY unless NO_PROXY names the host, loopback direct.

A real forward proxy on loopback relays to the stand-in whatever host a request names, and logs it.
The endpoint is addressed as `m3-endpoint.invalid`, a name only that proxy can route (`.invalid`
never resolves): a call that went direct fails, a call that went through the proxy succeeds and
is in its log. Each call below is one of the paths m3-agent talks to a model server by: the model
client (openai SDK: /v1/models, /v1/chat/completions), token counting (/tokenize), `fix`'s and
`eval`'s endpoint check, the launcher's probe (`serve status`, the health wait: /health, /v1/models),
admission (/metrics) and the pack budget.
"""

from __future__ import annotations

import base64
import http.client
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from m3_agent.agent.context.tokens import budget_for_server
from m3_agent.agent.endpoint import EndpointClient, is_loopback, proxy_for
from m3_agent.agent.model import ModelClient, ModelConfig
from m3_agent.errors import EndpointAuthError, EndpointError
from m3_agent.evals.admission import capacity_from_metrics
from m3_agent.serving import launcher
from m3_agent.agent.access import Endpoint
from m3_agent.standin.server import StandinServer

NAME = "m3-endpoint.invalid"
LOGINS: list[str | None] = []  # the Proxy-Authorization header of each request the proxy relayed
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


class _Forward(BaseHTTPRequestHandler):
    """A forward proxy: takes `GET http://host:port/path`, logs it, relays it to 127.0.0.1:port."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str, str]]
    logins: list[str | None]

    def _relay(self) -> None:
        url = urlsplit(self.path)
        self.seen.append((self.command, url.hostname or "", url.path))
        self.logins.append(self.headers.get("Proxy-Authorization"))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        upstream = http.client.HTTPConnection("127.0.0.1", url.port, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "proxy-connection")}
        upstream.request(self.command, url.path + (f"?{url.query}" if url.query else ""), body or None, headers)
        answer = upstream.getresponse()
        data = answer.read()
        upstream.close()
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.getheader("Content-Type") or "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _relay

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def proxy(monkeypatch):
    """A forward proxy on loopback set as HTTP_PROXY (NO_PROXY empty); yields its log of (method, host, path)."""
    seen: list[tuple[str, str, str]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Forward,), {"seen": seen, "logins": LOGINS}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.upper(), raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{server.server_address[1]}")
    yield seen
    server.shutdown()
    server.server_close()


def every_call(base_url: str) -> dict[str, object]:
    """Each way m3-agent reaches an endpoint, once: what it gave back, or the error it raised."""
    def outcome(call):
        try:
            return call()
        except EndpointError as e:
            return e

    client = ModelClient(ModelConfig(base_url=base_url, retry_attempts=1))
    return {
        "chat": outcome(lambda: client.complete([{"role": "user", "content": "hi"}]).content),
        "tokenize": outcome(lambda: client.endpoint.tokenize("MiniMaxAI/MiniMax-M3", "def f(): pass")),
        "token counter": outcome(lambda: client.token_counter().kind),
        "check": outcome(lambda: Endpoint(base_url=base_url).check()),
        "probe": launcher.probe(base_url)[0],
        "metrics": capacity_from_metrics(base_url) is not None,
        "budget": outcome(lambda: budget_for_server(base_url) > 0),
    }


def test_the_proxy_s_own_credentials_go_with_every_call(proxy, monkeypatch):
    LOGINS.clear()
    port = os.environ["HTTP_PROXY"].rsplit(":", 1)[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://m3%40team:s3cret@127.0.0.1:{port}")  # user m3@team, quoted
    with StandinServer({"performance": {}, "turns": [{"content": "hello"}]}) as srv:
        assert every_call(f"http://{NAME}:{srv.port}/v1")["chat"] == "hello"
    assert len(LOGINS) == len(proxy) >= 8
    assert set(LOGINS) == {"Basic " + base64.b64encode(b"m3@team:s3cret").decode()}


def test_through_a_proxy_every_call_takes_the_proxy_and_with_no_proxy_every_call_goes_direct(proxy, monkeypatch):
    with StandinServer({"performance": {}, "turns": [{"content": "hello"}]}) as srv:  # performance: a KV capacity
        via_proxy = every_call(f"http://{NAME}:{srv.port}/v1")
        tokens = EndpointClient(srv.base_url).tokenize("MiniMaxAI/MiniMax-M3", "def f(): pass")
        assert via_proxy == {"chat": "hello", "tokenize": tokens, "token counter": "server", "check": None,
                             "probe": "ready", "metrics": True, "budget": True}
        assert {path for _, _, path in proxy} == {"/v1/models", "/v1/chat/completions", "/tokenize", "/health",
                                                  "/metrics"}
        assert {host for _, host, _ in proxy} == {NAME}
        relayed = len(proxy)

        monkeypatch.setenv("NO_PROXY", f"example.com,{NAME}")
        direct = every_call(f"http://{NAME}:{srv.port}/v1")
        assert len(proxy) == relayed  # nothing went through the proxy
        assert direct.pop("probe") == "loading" and direct.pop("metrics") is False
        assert direct.pop("token counter") == "estimate"  # no /tokenize reached: the fallback counter
        assert all(isinstance(v, EndpointError) for v in direct.values()), direct  # the name resolves nowhere


def test_loopback_goes_direct_even_with_a_proxy_set(proxy):
    with StandinServer({"max_model_len": 200_000, "turns": [{"content": "hello"}]}) as srv:
        for host in ("127.0.0.1", "localhost"):
            assert proxy_for(f"http://{host}:{srv.port}/v1") is None
        assert every_call(srv.base_url)["chat"] == "hello"
        assert every_call(f"http://localhost:{srv.port}/v1")["probe"] == "ready"
    assert proxy == []


def test_the_proxy_policy_reads_http_proxy_https_proxy_and_no_proxy(monkeypatch):
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.upper(), raising=False)
    assert proxy_for("http://gpu-node:8000/v1") is None  # no proxy configured: direct
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.corp:3128")
    monkeypatch.setenv("HTTPS_PROXY", "http://tls-proxy.corp:3128")
    monkeypatch.setenv("NO_PROXY", ".internal,10.1.2.3")
    assert proxy_for("http://gpu-node:8000/v1") == "http://proxy.corp:3128"
    assert proxy_for("https://m3.example.com/v1") == "http://tls-proxy.corp:3128"
    assert proxy_for("http://gpu.internal:8000/v1") is None and proxy_for("http://10.1.2.3:8000") is None
    monkeypatch.setenv("HTTP_PROXY", "proxy.corp:3128")  # no scheme: curl and httpx read it as http://
    assert proxy_for("http://gpu-node:8000/v1") == "http://proxy.corp:3128"
    assert [is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "LOCALHOST", "10.0.0.1", "gpu")] == [
        True, True, True, True, True, False, False]


def test_a_refused_key_is_the_same_error_on_every_path():
    with StandinServer({"turns": [{"content": "hi"}]}, api_key="m3-right-key-0123456789") as srv:
        client = EndpointClient(srv.base_url, api_key="m3-wrong-key-9876543210", key_source="--api-key")
        for call in (client.models, client.check, lambda: client.card("MiniMaxAI/MiniMax-M3")):
            with pytest.raises(EndpointAuthError, match=r"HTTP 401\): sent the key \*\*\*\*3210 \(from --api-key\)"):
                call()
        assert client.health()  # /health needs no key on vLLM
        assert EndpointClient(srv.base_url, api_key="m3-right-key-0123456789").models()[0].id == "MiniMaxAI/MiniMax-M3"
