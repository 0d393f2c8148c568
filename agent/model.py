"""The model client: where a request to MiniMax-M3 is built, sent, retried and read back.

Speaks the OpenAI-compatible API of vLLM / SGLang serving M3 through the openai SDK:
sampling defaults from the model card, `chat_template_kwargs.thinking_mode` per request,
reasoning read from `message.reasoning` (or `reasoning_content`), usage with cached tokens.
"""

from __future__ import annotations

import re
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, FieldSerializationInfo, SecretStr, field_serializer
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from m3_agent.agent.context.tokens import EstimateCounter, ServerCounter, TokenCounter
from m3_agent.agent.endpoint import NO_KEY, EndpointClient, ServedModel, refused_key, served_models
from m3_agent.agent.thinking import ThinkingMode
from m3_agent.errors import EndpointError, M3AgentError, UsageError

# vLLM 0.33 and SGLang drop a stray leading </mm:think> but vLLM keeps the newlines after it, and keeps
# the closer itself when whitespace precedes it or when the server runs without a reasoning parser
_STRAY_THINK_CLOSE = re.compile(r"^\s*</mm:think>\s*|^\n+")
_RAW_THINK = re.compile(r"^\s*<mm:think>(.*?)</mm:think>\s*", re.DOTALL)
# The context-overflow 400s of vLLM, SGLang and llama-cpp-python (their texts, from their code).
_OVERFLOW = re.compile(r"context length|maximum context|context window|context size"
                       r"|cannot be greater than max_model_len", re.IGNORECASE)
# Each gives the window (`limit`) and, where the text says it, the prompt alone (`inp`): never a total of
# prompt and completion (llama-cpp-python and SGLang report that total as what was "requested").
_OVERFLOW_NUMBERS = [re.compile(p, re.IGNORECASE | re.DOTALL) for p in (
    # vLLM 0.33 (renderers/params.py); "at least" when the tokenizer stopped counting
    r"maximum context length is (?P<limit>\d+) tokens\. However, your prompt contains (?:at least )?"
    r"(?P<inp>\d+) input tokens",
    # vLLM before 0.11
    r"passed (?P<inp>\d+) input tokens.*?context length is only (?P<limit>\d+)",
    # llama-cpp-python's server (server/errors.py) and vLLM before 0.6: the total, then the messages' share
    r"maximum context length is (?P<limit>\d+) tokens.*?requested \d+ tokens \((?P<inp>\d+) in the messages",
    # SGLang (managers/tokenizer_manager.py): the input alone, then input + max_new_tokens
    r"input \((?P<inp>\d+) tokens\) is longer than the model's context length \((?P<limit>\d+)",
    r"maximum context length of (?P<limit>\d+) tokens\. You requested a total of \d+ tokens: (?P<inp>\d+) tokens "
    r"from the input",
    # llama.cpp's own llama-server: the prompt's tokens
    r"request \((?P<inp>\d+) tokens\) exceeds the available context size \((?P<limit>\d+) tokens",
    # vLLM 0.33, max_tokens alone over the window; any other text that names the window (vLLM's character check)
    r"cannot be greater than max_model_len=(?P<limit>\d+)",
    r"(?:maximum )?context (?:length|window) (?:is |of )?\(?(?P<limit>\d+)",
)]


class ModelConfig(BaseModel):
    """How to reach and sample the model: the `[model]` section of the configuration."""

    model_config = ConfigDict(extra="forbid")

    base_url: str | None = Field(None, description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    api_key: SecretStr = Field(SecretStr(NO_KEY), description="API key sent to the endpoint (better: M3_AGENT_MODEL__API_KEY; one `serve start` launched sends its own)")
    warn_plain_http: bool = Field(True, description="warn once per run when the repository goes to another "
                                  "machine over http:// (unencrypted)")
    name: str | None = Field(None, description="served model name; None = the first one /v1/models lists")
    temperature: float = 1.0  # model card defaults (seed 002)
    top_p: float = 0.95
    top_k: int = 40
    max_tokens: int = Field(8192, ge=1, description="completion tokens per request; at most a quarter of the "
                            "context window when the window is known")
    context_window: int | None = Field(None, ge=1, description="the server's context window in tokens, when its "
                                       "/v1/models does not say it (vLLM's max_model_len); None = from the server, "
                                       "else the window `serve start` gave it, else from its first "
                                       "context-length error")
    request_timeout_s: float = Field(600.0, gt=0)
    retry_attempts: int = Field(8, ge=1)
    retry_max_s: float = Field(300.0, gt=0)
    retry_initial_s: float = Field(1.0, gt=0)
    retry_max_wait_s: float = Field(30.0, gt=0)

    @field_serializer("api_key", when_used="json")
    def _dump_key(self, key: SecretStr, info: FieldSerializationInfo) -> str:
        # Masked in JSON (trajectories) unless a caller hands the config on, e.g. to a worker process.
        return key.get_secret_value() if (info.context or {}).get("secrets") else str(key)


class Usage(BaseModel):
    """Token accounting, per request or summed over a run."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, other: Usage) -> None:
        """Accumulate another usage into this one."""
        for name in Usage.model_fields:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cache_hit_share(self) -> float:
        """Share of prompt tokens served from the server's prefix cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class ToolCall(BaseModel):
    """One tool call as the server parsed it; `arguments` is the raw JSON string."""

    id: str
    name: str
    arguments: str | None = None
    repair: str | None = None  # how the loop read it when the server sent it as text (tools.text_calls)


class ModelReply(BaseModel):
    """What one chat-completions request returned."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = Field(default_factory=Usage)
    latency_s: float = 0.0
    attempts: int = 1

    def as_message(self) -> dict[str, Any]:
        """The assistant message to append to history.

        Reasoning goes back in both `reasoning` (read by vLLM) and `reasoning_content` (read by
        SGLang) so interleaved thinking survives on either server.
        """
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning"] = self.reasoning
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments or ""}}
                for c in self.tool_calls
            ]
        return msg


class ContextOverflowError(M3AgentError):
    """The request did not fit the server's context window (HTTP 400)."""

    exit_code = 3

    def __init__(self, message: str, *, input_tokens: int | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.input_tokens = input_tokens
        self.limit = limit


class ToolChoiceRefused(M3AgentError):
    """The server failed a request that asked for a tool call (`tool_choice` other than "auto").

    llama-cpp-python's server answers `"required"` with HTTP 500; others name the field in a 400. The loop
    asks with "auto" from then on.
    """


class ThinkingRejected(M3AgentError):
    """The server rejected the thinking-mode parameter (`chat_template_kwargs`) with a 400 that names it."""


THINKING_FIELDS = ("chat_template_kwargs", "thinking_mode")


def rejects_thinking(status: int | None, message: str) -> bool:
    """A 400/422 that names the thinking-mode field: a server without M3's chat template refuses it."""
    return status in (400, 422) and any(field in (message or "") for field in THINKING_FIELDS)


def refuses_tool_choice(status: int | None, message: str) -> bool:
    """A refused `tool_choice`: HTTP 500 (not retried; a 503 of a warming server still is), or a 400/422
    that names the field."""
    return status == 500 or (status in (400, 422) and "tool_choice" in (message or ""))


def is_context_overflow(status: int | None, message: str) -> bool:
    """vLLM's and SGLang's context-length errors: status 400 and the telltale wording."""
    return status == 400 and bool(_OVERFLOW.search(message or ""))


def overflow_from(message: str) -> ContextOverflowError:
    """The overflow a server's 400 text describes: its window, and the prompt's own tokens where it says them."""
    for pattern in _OVERFLOW_NUMBERS:
        m = pattern.search(message)
        if m:
            fields = m.groupdict()
            inp = int(fields["inp"]) if fields.get("inp") else None
            return ContextOverflowError(f"context window exceeded: {message}", input_tokens=inp,
                                        limit=int(fields["limit"]))
    return ContextOverflowError(f"context window exceeded: {message}")


def _retryable(exc: BaseException) -> bool:
    import openai

    # Connection problems, timeouts, 429, 5xx (incl. the 503 of a warming server), no choices. Never 400/401/404.
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 429 or exc.status_code >= 500
    return isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError, _EmptyReply))


class _EmptyReply(Exception):
    """The server answered 200 with no choices."""


def split_reasoning(content: str | None, reasoning: str | None) -> tuple[str, str | None]:
    """Normalise content: strip a stray `</mm:think>`, lift raw `<mm:think>` blocks into reasoning."""
    text = content or ""
    raw = _RAW_THINK.match(text)
    if raw:
        reasoning = (reasoning or "") + raw.group(1).strip()
        text = text[raw.end():]
    text = _STRAY_THINK_CLOSE.sub("", text, count=1)
    return text, reasoning or None


class ModelClient:
    """A thin, retrying client for an M3 endpoint."""

    def __init__(self, config: ModelConfig) -> None:
        import openai  # imported on first use: it is most of the CLI's start-up time

        if not config.base_url:
            raise UsageError("no model endpoint: set model.base_url (flag --base-url)")
        self.config = config
        key = config.api_key.get_secret_value() or NO_KEY
        self.endpoint = EndpointClient(config.base_url, api_key=key, key_source="model.api_key")
        self._client = openai.OpenAI(
            base_url=config.base_url,
            api_key=key,
            timeout=config.request_timeout_s,
            max_retries=0,  # retries are ours (tenacity), bounded in attempts and time
            http_client=self.endpoint.sdk_http(),  # the endpoint's one route (agent/endpoint.py: proxy_for)
        )
        self._model = config.name
        self._served: list[ServedModel] | None = None

    def close(self) -> None:
        self._client.close()

    def _call(self, fn, what: str):
        import openai

        c = self.config
        retrying = Retrying(retry=retry_if_exception(_retryable),
                            wait=wait_random_exponential(multiplier=c.retry_initial_s, max=c.retry_max_wait_s),
                            stop=stop_after_attempt(c.retry_attempts) | stop_after_delay(c.retry_max_s), reraise=False)
        try:
            return retrying(fn), retrying.statistics["attempt_number"]
        except RetryError as e:
            attempts, last = e.last_attempt.attempt_number, e.last_attempt.exception()  # retried on exceptions only
            raise EndpointError(
                f"{what} failed after {attempts} attempts at {self.config.base_url}: {_describe(last)}. "
                "Check that the M3 server is up (GET /health) and the --base-url is right."
            ) from None
        except openai.BadRequestError as e:
            msg = _error_message(e)
            if is_context_overflow(e.status_code, msg):
                raise overflow_from(msg) from None
            raise EndpointError(f"{what} rejected by the server (400): {msg}") from None
        except openai.AuthenticationError:
            raise refused_key(self.config.base_url or "", self.config.api_key.get_secret_value(),
                              "model.api_key") from None
        except openai.NotFoundError as e:
            raise EndpointError(
                f"{what}: not found (404): {_error_message(e)}. Check --base-url (it usually ends in /v1) "
                "and the model name."
            ) from None
        except openai.APIStatusError as e:
            raise EndpointError(f"{what} failed ({e.status_code}): {_error_message(e)}") from None

    def _models(self) -> list[ServedModel]:
        if self._served is None:
            answer, _ = self._call(lambda: self._client.get("/models", cast_to=object), "listing models")
            self._served = served_models(answer)
        return self._served

    @property
    def model(self) -> str:
        """The served model's id: configured, or the first one `/v1/models` lists."""
        if self._model is None:
            models = self._models()
            if not models:
                raise EndpointError(f"the server at {self.config.base_url} lists no models")
            self._model = models[0].id
        return self._model

    def token_counter(self) -> TokenCounter:
        """How the packed repository is counted: the server's own `/tokenize`, else (SGLang has none)
        the estimate."""
        try:
            return ServerCounter(self.config.base_url, model=self.model, api_key=self.config.api_key.get_secret_value())
        except EndpointError:
            return EstimateCounter()

    def max_model_len(self) -> int | None:
        """The context window the server reports (vLLM's `max_model_len` in `/v1/models`)."""
        return next((m.max_model_len for m in self._models() if m.id == self.model), None)

    def complete(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        thinking_mode: ThinkingMode | None = None,
        max_tokens: int | None = None,
        tool_choice: str = "auto",
    ) -> ModelReply:
        """Send one chat-completions request; retries transient failures; never returns None.

        `tool_choice` other than "auto" (e.g. "required") is sent once: a server that fails it raises
        `ToolChoiceRefused` instead of being retried, so the caller can ask again with "auto".
        """
        c = self.config
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": c.temperature,
                                "top_p": c.top_p, "max_tokens": max_tokens or c.max_tokens, "top_k": c.top_k}
        if thinking_mode is not None:
            body["chat_template_kwargs"] = {"thinking_mode": thinking_mode}
        if tools:
            body["tools"] = tools
            body["tool_choice"] = tool_choice

        import openai
        from openai.types.chat import ChatCompletion

        def send():
            # Posted as-is: create() re-validates the whole growing history on every turn (most of the
            # loop's own overhead); the SDK's HTTP client, error types and timeouts still apply.
            try:
                resp = self._client.post("/chat/completions", body=body, cast_to=ChatCompletion)
            except openai.APIStatusError as e:
                _refusal(e, body, c.base_url)
                raise
            if not resp.choices:
                raise _EmptyReply("the server returned no choices")
            return resp

        t0 = time.monotonic()
        resp, attempts = self._call(send, "chat completion")
        return _reply_from(resp, latency_s=time.monotonic() - t0, attempts=attempts)


def _refusal(e: Any, body: dict[str, Any], url: str | None) -> None:
    """Raise what the loop works around: a refused tool_choice, a rejected thinking parameter (not retried)."""
    message, status = _error_message(e), e.status_code
    said = f"(HTTP {status}: {message})"
    if body.get("tool_choice", "auto") != "auto" and refuses_tool_choice(status, message):
        raise ToolChoiceRefused(f"the server at {url} refused tool_choice {body['tool_choice']!r} {said}") from None
    if "chat_template_kwargs" in body and rejects_thinking(status, message) and not is_context_overflow(status, message):
        raise ThinkingRejected(f"the server at {url} rejected the thinking-mode parameter {said}") from None


def _reply_from(resp: Any, *, latency_s: float, attempts: int) -> ModelReply:
    choice = resp.choices[0]
    msg = choice.message
    extra = msg.model_extra or {}
    reasoning = extra.get("reasoning") or extra.get("reasoning_content")
    content, reasoning = split_reasoning(msg.content, reasoning)
    calls = [
        ToolCall(id=tc.id or f"call_{i}", name=tc.function.name or "", arguments=tc.function.arguments)
        for i, tc in enumerate(msg.tool_calls or [])
    ]
    usage = Usage(requests=1)
    u = resp.usage
    if u is not None:
        usage.prompt_tokens = u.prompt_tokens or 0
        usage.completion_tokens = u.completion_tokens or 0
        usage.cached_tokens = getattr(u.prompt_tokens_details, "cached_tokens", None) or 0
        usage.reasoning_tokens = getattr(u.completion_tokens_details, "reasoning_tokens", None) or 0
    return ModelReply(content=content, reasoning=reasoning, tool_calls=calls, finish_reason=choice.finish_reason,
                      usage=usage, latency_s=latency_s, attempts=attempts)


def _error_message(e: Any) -> str:
    body = e.body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("message"):
            return str(body["message"])
    return str(e.message)


def _describe(exc: BaseException) -> str:
    import openai

    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}: {_error_message(exc)}"
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause or "").lower() or (
            cause is not None and type(cause).__name__ == "ConnectError"
        ):
            return "connection refused"
        return f"connection error ({type(cause).__name__ if cause else exc.__class__.__name__}: {cause or exc})"
    return str(exc) or type(exc).__name__
