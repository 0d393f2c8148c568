"""The M3 stand-in server: a scripted TEST DOUBLE that speaks vLLM's wire format. Not a model.

It answers what `vllm serve MiniMaxAI/MiniMax-M3 --reasoning-parser minimax_m3 --tool-call-parser
minimax_m3 --enable-auto-tool-choice --enable-prompt-tokens-details` answers, with replies taken
from a script instead of a model, so the agent, its client and the evals can be tested for real
over HTTP without a GPU:

    from m3_agent.standin.server import StandinServer

    script = {"turns": [
        {"reasoning": "Read the file first.", "tool_calls": [{"name": "read", "arguments": {"path": "a.py"}}]},
        {"content": "Done."},
    ]}
    with StandinServer(script) as srv:          # port 0: a free loopback port
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        ...
        srv.requests                            # every JSON body POSTed to /v1/chat/completions

A script (docs/standin.md gives the format, every fault and every wire detail) is a list of
turns or an object with server settings (`model`, `max_model_len`, `block_size`, `loading_s`,
`on_exhausted`, `stray_think_close`, `reasoning_content_alias`, `quirks`, `performance`), top-level `turns`
and `conversations` (`{"match": "substring", "turns": [...]}`). Each chat-completions request
consumes the next turn of its conversation: the first whose `match` occurs in the request's first
user message, else the top-level turns. A turn is either `raw` model output, parsed as vLLM's
minimax_m3 parsers parse it (`standin/m3_output.py`; the conformance tier proves they agree), or
`reasoning`, `content` and `tool_calls`; it may carry a `fault` (`Fault`), a `delay_s` and a
`repeat` count. A fault turn is consumed by the request it fails, so a retrying client gets the next.
M3's own faults are raw text: the catalogue is `standin/m3_faults.py`.

The wire follows the vLLM version M3 is served with: reasoning is `message.reasoning` only (vLLM
removed the `reasoning_content` alias, vllm PR #33402); incoming assistant reasoning is rendered
only after the last user message, as M3's chat template does; `usage.prompt_tokens_details` is
null when nothing was cached; tool-call ids are `chatcmpl-tool-<16 hex>`, and a streamed call is a
head delta (id, name) then its whole arguments; context overflow is HTTP 400 with vLLM's text,
checked before any turn is consumed.

Token counting is a deterministic toy tokenizer, not M3's: the request is rendered in a fixed
chat-template-like form (`render_prompt`) and cut by `TOKEN_RE` (word runs, single punctuation
marks, whitespace runs); ids are given out in order of first sight, so `/detokenize` inverts
`/tokenize` on the same server. Prefix caching is block-granular like vLLM's: a chain hash per
full `block_size` block of prompt tokens; `cached_tokens` counts the leading blocks still cached.

What runs a request is an engine, the seam between this wire double and a performance model: it
says how long a request takes and how many of its prompt tokens were cached. Without `performance`
it is `InstantEngine` (every answer at once, a prefix cache that never forgets). With
`"performance": {...}` (a `standin.kvsim.Performance`) it is `standin.kvsim.KVSimulator`, loaded
only then: a KV cache with LRU eviction of free blocks, one serialized prefill lane, decode per
sequence, on a clock `time_scale` times faster than real time. `/metrics` exports the engine's
cache gauges and `vllm:cache_config_info` (num_gpu_blocks, block_size), so a client can learn the
capacity.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import re
import signal
import socket
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

import typer
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from m3_agent.errors import UsageError, first_validation_error
from m3_agent.standin.m3_output import parse_output, schema_types, split_reasoning, tool_properties

if TYPE_CHECKING:  # the performance model is imported only by a script that has one (`StandinState`)
    from m3_agent.standin.kvsim import KVSimulator
    from m3_agent.standin.simclock import ScaledClock, VirtualClock

STANDIN_HEADER = "X-M3-Standin"
# vLLM 0.33's AuthenticationMiddleware guards these path prefixes only: /health, /metrics, /tokenize stay open.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
STANDIN_HEADER_VALUE = "test double; scripted replies, not a model"
OWNED_BY = "m3-agent-standin (test double, not a model)"
EXHAUSTED_TEXT = "The stand-in script is exhausted: this is a scripted test double and has no more turns."
THINKING_MODES = ("enabled", "disabled", "adaptive")
STRAY_THINK_CLOSE = "</mm:think>\n\n"
# the /metrics counters, named as vLLM names them (each exported as vllm:<key>_total)
COUNTERS = (
    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "Number of generation tokens processed."),
)
# the /metrics gauges about cache capacity and load, named as vLLM names them
GAUGES = (
    ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    ("num_requests_running", "Number of requests in model execution batches."),
    ("num_requests_waiting", "Number of requests waiting to be processed."),
)
CACHE_CONFIG_INFO = "vllm:cache_config_info"
MEMO_MIN_CHARS = 4096  # prompt segments at least this long are tokenized once per server
MEMO_SEGMENTS = 256

# what each fault does: docs/standin.md, "Script format"
Fault = Literal["500", "503", "drop", "malformed_arguments", "truncate", "context_overflow", "run_on",
                "literal_parameter_close", "null_nullable"]


class ToolCallSpec(BaseModel):
    """One scripted tool call: parsed `arguments`, or `arguments_raw` sent verbatim."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: dict[str, Any] | None = None
    arguments_raw: str | None = None

    @model_validator(mode="after")
    def _one_argument_form(self) -> ToolCallSpec:
        if self.arguments is not None and self.arguments_raw is not None:
            raise ValueError("give either 'arguments' or 'arguments_raw', not both")
        return self


class Turn(BaseModel):
    """One scripted reply (docs/standin.md describes each field)."""

    model_config = ConfigDict(extra="forbid")

    raw: str | None = None
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallSpec] = Field(default_factory=list)
    finish_reason: str | None = None
    delay_s: float = Field(default=0.0, ge=0)
    repeat: int = Field(default=1, ge=1)
    fault: Fault | None = None
    stray_think_close: bool | None = None

    @model_validator(mode="after")
    def _raw_alone(self) -> Turn:
        if self.raw is not None and (self.reasoning is not None or self.content is not None or self.tool_calls):
            raise ValueError("a turn with 'raw' model output takes no 'reasoning', 'content' or 'tool_calls'")
        return self


class Conversation(BaseModel):
    """Turns served to requests whose first user message contains `match`."""

    model_config = ConfigDict(extra="forbid")

    match: str = Field(min_length=1)
    turns: list[Turn]


class Quirks(BaseModel):
    """How a server that is not vLLM answers (docs/standin.md, "Server quirks"); the defaults are vLLM's."""

    model_config = ConfigDict(extra="forbid")

    tool_choice_required: Literal["accept", "error_500"] = Field(
        "accept", description="error_500: answer `tool_choice: \"required\"` with HTTP 500, as llama-cpp-python does")
    context_errors: Literal["vllm", "sglang", "llama_cpp"] = Field(
        "vllm", description="whose context-length check and 400 text to play (`_overflow`)")
    list_max_model_len: bool = Field(True, description="False: /v1/models gives no max_model_len (llama-cpp-python)")
    reject_fields: list[str] = Field(default_factory=list, description="top-level request fields answered with a "
                                     "400 that names them, as a server without M3's chat template may answer")


class Script(BaseModel):
    """A whole stand-in script: server settings plus the turns to serve."""

    model_config = ConfigDict(extra="forbid")

    model: str = "MiniMaxAI/MiniMax-M3"
    max_model_len: int = Field(default=1_048_576, ge=1)
    block_size: int = Field(default=128, ge=1)
    turns: list[Turn] = Field(default_factory=list)
    conversations: list[Conversation] = Field(default_factory=list)
    on_exhausted: Literal["final", "error"] = "final"
    loading_s: float = Field(default=0.0, ge=0)
    stray_think_close: bool = False
    reasoning_content_alias: bool = False
    quirks: Quirks = Field(default_factory=Quirks)
    performance: Any = Field(None, description="a standin.kvsim.Performance; None: no performance model")

    @field_validator("performance", mode="before")
    @classmethod
    def _performance_model(cls, value: Any) -> Any:
        if value is None:
            return None
        from m3_agent.standin.kvsim import Performance  # only a script with a performance model loads it

        try:
            return Performance.model_validate(value)
        except ValidationError as e:
            loc, msg = first_validation_error(e)
            raise ValueError(f"{loc}: {msg}" if loc else msg) from None

    @model_validator(mode="after")
    def _window_fits_the_cache(self) -> Script:
        if self.performance and self.performance.kv_capacity_tokens < self.max_model_len:
            # vLLM refuses to start when one full-length request cannot fit its KV cache
            raise ValueError(f"performance.kv_capacity_tokens must hold max_model_len ({self.max_model_len})")
        return self


def load_script(source: Script | dict | list | str | Path) -> Script:
    """Build a Script from a Script, a dict, a list of turns, or a JSON file path.

    Raises UsageError with a one-line message when the file or its content is bad.
    """
    if isinstance(source, Script):
        return source
    where = "script"
    if isinstance(source, (str, Path)):
        path = Path(source)
        where = str(path)
        try:
            source = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise UsageError(f"cannot read stand-in script {path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"stand-in script {path} is not valid JSON: {e}") from None
    if isinstance(source, list):
        source = {"turns": source}
    if not isinstance(source, dict):
        raise UsageError(f"{where}: a stand-in script is a JSON object or a list of turns")
    try:
        return Script.model_validate(source)
    except ValidationError as e:
        loc, msg = first_validation_error(e, top="(top level)")
        raise UsageError(f"{where}: bad stand-in script at {loc}: {msg}") from None


# Toy tokenizer and prompt rendering --------------------------------------------------------------

TOKEN_RE = re.compile(r"\w+|[^\w\s]|\s+")  # toy tokens: word runs, single punctuation marks, whitespace runs


def _text_of(content: Any) -> str:
    """The text of a message `content`: a string, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                parts.append(f"<{part.get('type', 'part')}>")
            else:
                parts.append(str(part))
        return "".join(parts)
    return str(content)


def render_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    thinking_mode: str = "adaptive",
    add_generation_prompt: bool = True,
) -> str:
    """Render a request the way the stand-in counts it: a fixed chat-template-like form.

    Like M3's template, assistant reasoning (the `reasoning` field) is rendered only for assistant
    messages after the last user message.
    """
    out = []
    if tools:
        out.append("<|tools|>\n")
        for tool in tools:
            out.append(json.dumps(tool, sort_keys=True, ensure_ascii=False) + "\n")
        out.append("<|end|>\n")
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    for i, m in enumerate(messages):
        role = str(m.get("role", "user"))
        out.append(f"<|{role}|>\n")
        if role == "assistant" and i > last_user and m.get("reasoning"):
            out.append(f"<mm:think>{m['reasoning']}</mm:think>\n")
        out.append(_text_of(m.get("content")))
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            out.append(f"\n<tool_call>{fn.get('name', '')} {fn.get('arguments', '')}</tool_call>")
        if role == "tool" and m.get("tool_call_id"):
            out.append(f"\n<tool_call_id>{m['tool_call_id']}</tool_call_id>")
        out.append("\n<|end|>\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
        if thinking_mode == "enabled":
            out.append("<mm:think>")
        elif thinking_mode == "disabled":
            out.append("<mm:think></mm:think>\n")
    return "".join(out)


class StandinError(Exception):
    """A request the stand-in answers with a vLLM-style error body."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None,
                 *, flat: bool = False):
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.param = param
        self.flat = flat  # SGLang's shape: the ErrorResponse itself, not under "error"

    def body(self) -> dict[str, Any]:
        """vLLM's ErrorResponse shape (SGLang's when `flat`)."""
        error = {"message": str(self), "type": self.err_type, "param": self.param, "code": self.status}
        return {"object": "error", **error} if self.flat else {"error": error}


class _Dropped(Exception):
    """The scripted fault `drop`: close the connection without answering."""


def _server_error(status: int, why: str) -> StandinError:
    kind = {500: "InternalServerError", 503: "ServiceUnavailableError"}[status]
    return StandinError(status, f"{why} (m3-agent stand-in: a scripted test double)", kind)


def _cursor(turns: list[Turn]) -> Iterator[Turn]:
    """The turns in serving order, each `repeat` times (lazily: a script may repeat a turn 10**9 times)."""
    return itertools.chain.from_iterable(itertools.repeat(turn, turn.repeat) for turn in turns)


@dataclass
class _Reply:
    """What one served turn sends back, after faults and thinking mode are applied."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class InstantEngine:
    """No performance model: every request is done at once, and the prefix cache never forgets.

    An engine is the seam between the wire double and a performance model (`standin.kvsim.KVSimulator`
    has the same three methods): it says how long a request takes and how many of its prompt tokens
    were cached. Handler threads call it at once.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.lock = threading.Lock()
        self.cached: set[bytes] = set()
        self.queries = self.hits = 0

    def now(self) -> float:
        """The engine's time, when a request that arrives now was received: no clock, nothing waits."""
        return 0.0

    def run(self, hashes: list[bytes], prompt_tokens: int, completion_tokens: int, received: float) -> int:
        """Serve a request, returning once done: its cached prompt tokens, the leading blocks seen before.

        `hashes`: the chain hashes of its full prompt blocks (the ones a later prompt may share).
        """
        with self.lock:
            hit = next((i for i, h in enumerate(hashes) if h not in self.cached), len(hashes))
            self.cached.update(hashes)
            self.queries += prompt_tokens
            self.hits += hit * self.block_size
        return hit * self.block_size

    def metrics(self) -> dict[str, Any]:
        """By vLLM's names: the prefix-cache counters (tokens); no capacity, so no usage, load or block count."""
        with self.lock:
            return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits, "kv_cache_usage_perc": 0.0,
                    "num_requests_running": 0, "num_requests_waiting": 0, "num_gpu_blocks": None}


class StandinState:
    """Everything the server remembers: cursors, the request log, the vocabulary, and its engine.

    All public methods take the one lock, so handler threads can call them concurrently.
    """

    def __init__(self, script: Script, clock: ScaledClock | VirtualClock | None = None,
                 keep_requests: bool = True, api_key: str | None = None) -> None:
        self.script = script
        self.api_key_hash = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.lock = threading.Lock()
        self.keep_requests = keep_requests
        self.requests: list[dict[str, Any]] = []
        self.thinking_modes: list[str] = []
        self.turns_served = 0
        self.started_at = time.monotonic()
        self._top = _cursor(script.turns)
        self._convs = [(c.match, _cursor(c.turns)) for c in script.conversations]
        self._vocab: dict[str, int] = {}  # piece -> id, in order of first sight: id i is the i-th key
        self._memo: OrderedDict[bytes, array] = OrderedDict()  # long prompt segment -> its ids
        self._chains: OrderedDict[tuple[int, bytes], list[bytes]] = OrderedDict()  # prompt blocks -> chain hashes
        self.engine: InstantEngine | KVSimulator = InstantEngine(script.block_size)
        if script.performance is not None:
            from m3_agent.standin.kvsim import KVSimulator  # only a script with a performance model loads it

            self.engine = KVSimulator(script.performance, script.block_size, clock)
        self.metrics = {"prompt_tokens": 0, "generation_tokens": 0}  # the engine counts the prefix cache
        self.finished: dict[str, int] = {}

    # tokens ---------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Toy-tokenize `text` into ids, extending this server's vocabulary.

        Long segments between `<|` markers are remembered, so a whole-repository prompt sent again
        each turn is tokenized once; `<` is always a token of its own, so cutting there changes nothing.
        """
        with self.lock:
            ids: list[int] = []
            head, *rest = text.split("<|")
            for segment in [head, *("<|" + part for part in rest)]:
                if len(segment) < MEMO_MIN_CHARS:
                    ids += self._encode_segment(segment)
                    continue
                key = hashlib.blake2b(segment.encode("utf-8", "surrogatepass"), digest_size=16).digest()
                known = self._memo.get(key)
                if known is None:
                    known = self._memo[key] = array("q", self._encode_segment(segment))
                    if len(self._memo) > MEMO_SEGMENTS:
                        self._memo.popitem(last=False)
                self._memo.move_to_end(key)
                ids += known
            return ids

    def _encode_segment(self, text: str) -> list[int]:
        vocab = self._vocab
        return [vocab.setdefault(piece, len(vocab)) for piece in TOKEN_RE.findall(text)]

    def decode(self, ids: list[int]) -> str:
        """Inverse of `encode` for ids this server has given out."""
        with self.lock:
            pieces = list(self._vocab)
            bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < len(pieces)]
            if bad:
                raise StandinError(400, f"Token id {bad[0]} is out of vocabulary (stand-in: ids are given out by /tokenize)")
            return "".join(pieces[i] for i in ids)

    # prefix cache -----------------------------------------------------------------------------------
    def block_hashes(self, ids: list[int]) -> list[bytes]:
        """Chain hashes of the full blocks a request may take from the cache (never its last token).

        The chain of an earlier prompt that this one extends is reused (one pass of a running
        digest finds it), so a long conversation's turns do not hash their whole prefix again.
        """
        bs = self.script.block_size
        data = memoryview(array("q", ids[: (len(ids) - 1) // bs * bs])).cast("B")
        step, blake = bs * 8, hashlib.blake2b
        with self.lock:
            known = sorted((n, digest, chain) for (n, digest), chain in self._chains.items() if n <= len(data))
        hashes: list[bytes] = []
        running, pos = blake(), 0
        for n, digest, chain in known:
            running.update(data[pos:n])
            pos = n
            if running.copy().digest() == digest:
                hashes = chain
        hashes = list(hashes)
        parent = hashes[-1] if hashes else b""
        for start in range(len(hashes) * step, len(data), step):
            h = blake(parent, digest_size=16)
            h.update(data[start : start + step])
            parent = h.digest()
            hashes.append(parent)
        if hashes:
            with self.lock:
                self._chains[(len(data), blake(data).digest())] = hashes
                if len(self._chains) > MEMO_SEGMENTS:
                    self._chains.popitem(last=False)
        return hashes

    # turns ----------------------------------------------------------------------------------------
    def record(self, body: dict[str, Any]) -> None:
        """Keep a chat-completions body in the request log (unless told to keep none)."""
        if not self.keep_requests:
            return
        with self.lock:
            self.requests.append(body)

    def next_turn(self, messages: list[dict[str, Any]], mode: str) -> Turn | None:
        """The next turn of the conversation this request belongs to; None when it is exhausted.

        `mode`: the thinking mode the request asked for, kept once it reached the script.
        """
        first_user = next((m for m in messages if m.get("role") == "user"), None)
        text = _text_of(first_user.get("content")) if first_user else ""
        with self.lock:
            cursor = next((c for match, c in self._convs if match in text), None)
            if cursor is None:
                if self._convs and not self.script.turns:
                    raise StandinError(
                        400,
                        "No stand-in conversation matched the first user message: this is a scripted "
                        "test double; add a conversation whose 'match' occurs in it, or top-level 'turns'.",
                    )
                cursor = self._top
            self.thinking_modes.append(mode)
            turn = next(cursor, None)
            if turn is not None:
                self.turns_served += 1
            return turn

    def count_finished(self, prompt_tokens: int, completion_tokens: int, finish_reason: str) -> None:
        """Move the token and request counters after a served reply."""
        # the engine ends a tool-call reply with "stop"; "tool_calls" exists only in the API layer
        engine_reason = "stop" if finish_reason == "tool_calls" else finish_reason
        with self.lock:
            self.metrics["prompt_tokens"] += prompt_tokens
            self.metrics["generation_tokens"] += completion_tokens
            self.finished[engine_reason] = self.finished.get(engine_reason, 0) + 1

    def metrics_text(self) -> str:
        """Prometheus exposition text with vLLM's metric names."""
        labels = f'model_name="{self.script.model}",engine="0"'
        engine = self.engine.metrics()
        with self.lock:
            m = {**self.metrics, **engine}
            finished = dict(self.finished)
        lines = ["# m3-agent stand-in: a scripted test double, not a model"]

        def family(kind: str, name: str, help_text: str, samples: dict[str, Any]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{{{label}}} {float(value)}" for label, value in samples.items())

        for key, help_text in COUNTERS:
            family("counter", f"vllm:{key}_total", help_text, {labels: m[key]})
        reasons = ("stop", "length", "abort", *sorted(set(finished) - {"stop", "length", "abort"}))
        family("counter", "vllm:request_success_total", "Count of successfully processed requests.",
               {f'{labels},finished_reason="{r}"': finished.get(r, 0) for r in reasons})
        for key, help_text in GAUGES:
            family("gauge", f"vllm:{key}", help_text, {labels: m[key]})
        # vLLM exports every CacheConfig field as a label; num_gpu_blocks is "None" until it is known
        info = {"block_size": self.script.block_size, "cache_dtype": "auto", "enable_prefix_caching": True,
                "engine": 0, "num_gpu_blocks": m["num_gpu_blocks"]}
        family("gauge", CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig",
               {",".join(f'{k}="{v}"' for k, v in info.items()): 1})
        return "\n".join(lines) + "\n"


# Building replies --------------------------------------------------------------------------------


def _nullable_params(tools: list[dict[str, Any]] | None, name: str) -> list[str]:
    """Names of the parameters of tool `name` whose JSON schema admits null."""
    return [pname for pname, schema in tool_properties(tools, name).items() if "null" in schema_types(schema)]


def _cut_at_parameter_close(value: Any) -> Any:
    """Cut every string at a literal `</parameter>`, as M3's tool parser does."""
    if isinstance(value, str):
        return value.split("</parameter>", 1)[0]
    if isinstance(value, dict):
        return {k: _cut_at_parameter_close(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut_at_parameter_close(v) for v in value]
    return value


def _tool_call(name: str, arguments: str) -> dict[str, Any]:
    # vLLM 0.33 names M3's tool calls chatcmpl-tool-<16 hex digits>
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _reply_from_raw(turn: Turn, request: dict[str, Any], thinking_mode: str) -> _Reply:
    """A raw M3 completion, parsed as vLLM's minimax_m3 reasoning and tool parsers parse it."""
    parsed = parse_output(turn.raw or "", request.get("tools"), thinking_mode)
    calls = [_tool_call(name, json.dumps(args, ensure_ascii=False)) for name, args in parsed.tool_calls]
    reason = turn.finish_reason or ("tool_calls" if calls else "stop")
    return _Reply(reasoning=parsed.reasoning, content=parsed.content, tool_calls=calls, finish_reason=reason)


def build_reply(turn: Turn, script: Script, request: dict[str, Any], thinking_mode: str) -> _Reply:
    """Apply thinking mode, stray-think and argument faults to a turn; token counts are left at 0."""
    if turn.raw is not None:
        return _reply_from_raw(turn, request, thinking_mode)
    reply = _Reply()
    reply.reasoning = turn.reasoning if thinking_mode != "disabled" else None
    content = turn.content
    stray = turn.stray_think_close if turn.stray_think_close is not None else script.stray_think_close
    multi_turn = any(m.get("role") == "assistant" for m in request.get("messages", []))
    if stray and thinking_mode != "enabled" and multi_turn:
        # the model writes the closer; vLLM's reasoning parser drops it when it leads the output
        content = split_reasoning(STRAY_THINK_CLOSE + (content or ""), thinking_mode)[1]
    for spec in turn.tool_calls:
        if spec.arguments_raw is not None:
            arguments = spec.arguments_raw
        else:
            args = dict(spec.arguments or {})
            if turn.fault == "literal_parameter_close":
                args = _cut_at_parameter_close(args)
            if turn.fault == "null_nullable":
                for pname in _nullable_params(request.get("tools"), spec.name):
                    args[pname] = None
            arguments = json.dumps(args, ensure_ascii=False)
            if turn.fault == "malformed_arguments":
                arguments = arguments[:-1] + ', "'  # unterminated: never valid JSON
        reply.tool_calls.append(_tool_call(spec.name, arguments))
    reply.finish_reason = turn.finish_reason or ("tool_calls" if reply.tool_calls else "stop")
    if turn.fault == "truncate":
        if content:
            content = content[: max(1, len(content) // 2)]
        if reply.tool_calls:
            fn = reply.tool_calls[-1]["function"]
            fn["arguments"] = fn["arguments"][: max(1, len(fn["arguments"]) // 2)]
        reply.finish_reason = "length"
    reply.content = content or None
    return reply


def _completion_tokens(reply: _Reply) -> int:
    """Toy tokens generated: reasoning, content, and each tool call's name and arguments."""
    parts = [reply.reasoning or "", reply.content or ""]
    for call in reply.tool_calls:
        parts += [call["function"]["name"], call["function"]["arguments"]]
    return sum(len(TOKEN_RE.findall(p)) for p in parts)


# HTTP ---------------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # socketserver's 5 drops connections when a load test opens dozens at once
    daemon_threads = True


class _Handler(BaseHTTPRequestHandler):
    server_version = "m3-agent-standin/1 (test double)"
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else each reply waits ~40 ms between headers and body (real vLLM does not)
    state: StandinState  # set on the subclass made per server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Quiet: tests and the CLI print what matters themselves."""

    # plumbing ---------------------------------------------------------------------------------------
    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in {**headers, STANDIN_HEADER: STANDIN_HEADER_VALUE}.items():
            self.send_header(name, value)
        self.end_headers()

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self._head(status, {"Content-Type": content_type, "Content-Length": str(len(body))})
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json")

    def _read_json(self) -> dict[str, Any]:
        try:
            body = json.loads(self._raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StandinError(400, f"Invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise StandinError(400, "The request body must be a JSON object")
        return body

    def _authorized(self, path: str) -> bool:
        """vLLM's AuthenticationMiddleware: with a key, paths under its guarded prefixes need `Bearer KEY`."""
        want = self.state.api_key_hash
        if want is None or not path.startswith(GUARDED_PREFIXES):
            return True
        scheme, _, given = (self.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(given.encode()).digest(), want)

    def _dispatch(self, routes: dict[str, Any]) -> None:
        path = self.path.split("?", 1)[0]
        # read the whole body first so an early error leaves the kept-alive connection clean
        length = int(self.headers.get("Content-Length") or 0)
        self._raw = self.rfile.read(length) if length else b""
        if not self._authorized(path):
            self._json(401, {"error": "Unauthorized"})  # vLLM's body, before any route is looked up
            return
        try:
            handler = routes.get(path)
            if handler is None:
                raise StandinError(404, f"Route {self.command} {path} not found", "NotFoundError")
            if path != "/metrics" and time.monotonic() - self.state.started_at < self.state.script.loading_s:
                raise _server_error(503, "The model is still loading; retry later")
            handler()
        except StandinError as e:
            self._json(e.status, e.body())
        except _Dropped:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a stand-in bug must reach the client as a 500, like vLLM's catch-all
            fault = _server_error(500, f"Stand-in internal error: {type(e).__name__}: {e}")
            self._json(fault.status, fault.body())

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        """GET routes: /health, /v1/models, /metrics."""
        self._dispatch({"/health": self._health, "/v1/models": self._models, "/metrics": self._metrics})

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        """POST routes: /v1/chat/completions, /tokenize, /detokenize."""
        self._dispatch(
            {"/v1/chat/completions": self._chat, "/tokenize": self._tokenize, "/detokenize": self._detokenize}
        )

    # routes ---------------------------------------------------------------------------------------
    def _health(self) -> None:
        self._send(200, b"", "application/json")

    def _models(self) -> None:
        s, created = self.state.script, int(time.time())
        permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        card = {"id": s.model, "object": "model", "created": created, "owned_by": OWNED_BY, "root": s.model,
                "parent": None, "max_model_len": s.max_model_len, "permission": [permission]}
        if not s.quirks.list_max_model_len:
            del card["max_model_len"]
        self._json(200, {"object": "list", "data": [card]})

    def _metrics(self) -> None:
        self._send(200, self.state.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.state.script.model:
            raise StandinError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def _thinking_mode(self, body: dict[str, Any]) -> str:
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise StandinError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        mode = kwargs.get("thinking_mode", "adaptive")
        if mode not in THINKING_MODES:
            raise StandinError(
                400, f"thinking_mode must be one of {', '.join(THINKING_MODES)}, got {mode!r}", param="chat_template_kwargs"
            )
        return mode

    def _check_tool_choice(self, body: dict[str, Any]) -> None:
        choice = body.get("tool_choice")
        if choice not in (None, "none") and not body.get("tools"):
            raise StandinError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if choice == "required" and self.state.script.quirks.tool_choice_required == "error_500":
            raise _server_error(500, "Scripted quirk: this server cannot force a tool call (tool_choice 'required')")
        for name in self.state.script.quirks.reject_fields:
            if name in body:
                raise StandinError(400, f"Unrecognized request argument supplied: {name}", param=name)

    def _prompt_ids(self, body: dict[str, Any], mode: str) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise StandinError(400, "'messages' must be a list of message objects", param="messages")
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise StandinError(400, "'tools' must be a list of tool objects", param="tools")
        add_gen = bool(body.get("add_generation_prompt", True))
        return self.state.encode(render_prompt(messages, tools, mode, add_gen))

    def _tokenize(self) -> None:
        body = self._read_json()
        self._check_model(body)
        if "messages" in body:
            ids = self._prompt_ids(body, self._thinking_mode(body))
        elif isinstance(body.get("prompt"), str):
            ids = self.state.encode(body["prompt"])
        else:
            raise StandinError(400, "Give 'prompt' (a string) or 'messages'", param="prompt")
        self._json(200, {"count": len(ids), "max_model_len": self.state.script.max_model_len, "tokens": ids, "token_strs": None})

    def _detokenize(self) -> None:
        body = self._read_json()
        self._check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list):
            raise StandinError(400, "'tokens' must be a list of token ids", param="tokens")
        self._json(200, {"prompt": self.state.decode(ids)})

    def _chat(self) -> None:
        received = self.state.engine.now()
        state, script = self.state, self.state.script
        body = self._read_json()
        state.record(body)
        self._check_model(body)
        self._check_tool_choice(body)
        mode = self._thinking_mode(body)
        ids = self._prompt_ids(body, mode)
        n = len(ids)
        max_out = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        if not isinstance(max_out, int) or max_out < 0:
            raise StandinError(400, "max_tokens must be a non-negative integer", param="max_tokens")
        out_field = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
        overflow = _overflow(script.quirks.context_errors, n, max_out, script.max_model_len, out_field=out_field)
        if overflow is not None:
            raise overflow

        turn = state.next_turn(body["messages"], mode)
        if turn is None:
            if script.on_exhausted == "error":
                raise _server_error(500, "The stand-in script is exhausted")
            reply = _Reply(content=EXHAUSTED_TEXT)
        else:
            if turn.delay_s:
                time.sleep(turn.delay_s)
            if turn.fault in ("500", "503"):
                raise _server_error(int(turn.fault), f"Scripted fault {turn.fault}")
            if turn.fault == "drop":
                raise _Dropped()
            if turn.fault == "context_overflow":
                raise _overflow(script.quirks.context_errors, n, max_out, script.max_model_len, forced=True)
            if turn.fault == "run_on":  # llama-cpp-python's reply ran to the window's end, then its next step
                raise _overflow("llama_cpp", script.max_model_len, max_out, script.max_model_len, forced=True)
            reply = build_reply(turn, script, body, mode)

        reply.prompt_tokens = n
        reply.completion_tokens = _completion_tokens(reply)
        reply.cached_tokens = state.engine.run(state.block_hashes(ids), n, reply.completion_tokens, received)
        state.count_finished(reply.prompt_tokens, reply.completion_tokens, reply.finish_reason)
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            self._stream(reply, include_usage=bool(opts.get("include_usage")))
        else:
            self._json(200, _completion_body(reply, script))

    def _stream(self, reply: _Reply, include_usage: bool) -> None:
        self._head(200, {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                         "Transfer-Encoding": "chunked"})
        for event in _stream_events(reply, self.state.script, include_usage):
            data = f"data: {event}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _overflow(server: str, n: int, max_out: int, window: int, *, out_field: str = "max_tokens",
              forced: bool = False) -> StandinError | None:
    """The context-length 400 of `server` for a prompt of `n` tokens asking `max_out` more, built from the
    real counts as each server's own code builds it; None when that server would take the request.

    vLLM 0.33 refuses max_tokens over the window and a prompt over it, and clamps the rest; SGLang refuses a
    prompt that reaches the window, then prompt + max_tokens over it; llama-cpp-python refuses a prompt that
    reaches the window and reports prompt + max_tokens as the tokens "requested". `forced`: the text of the
    first check whatever the counts (the `context_overflow` fault). `out_field`: the request's name for
    max_tokens, which vLLM's text uses.
    """
    if server == "vllm":  # a VLLMValidationError: its text ends with (parameter=..., value=...)
        if max_out > window and not forced:
            return StandinError(400, f"{out_field}={max_out} cannot be greater than max_model_len={window}. "
                                f"Please request fewer output tokens. (parameter={out_field}, value={max_out})",
                                param=out_field)
        if n > window or forced:
            return StandinError(400, f"This model's maximum context length is {window} tokens. However, your prompt "
                                f"contains {n} input tokens, which exceeds this limit even without any output tokens. "
                                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={n})",
                                param="input_tokens")
    elif server == "sglang":
        if n >= window or forced:
            return StandinError(400, f"The input ({n} tokens) is longer than the model's context length ({window} "
                                "tokens).", flat=True)
        if n + max_out > window:
            return StandinError(400, f"Requested token count exceeds the model's maximum context length of {window} "
                                f"tokens. You requested a total of {n + max_out} tokens: {n} tokens from the input "
                                f"messages and {max_out} tokens for the completion. Please reduce the number of "
                                "tokens in the input messages or the completion to fit within the limit.", flat=True)
    elif n >= window or forced:  # llama_cpp
        return StandinError(400, f"This model's maximum context length is {window} tokens. However, you requested "
                            f"{n + max_out} tokens ({n} in the messages, {max_out} in the completion). Please reduce "
                            "the length of the messages or completion.", "invalid_request_error", "messages")
    return None


def _usage(reply: _Reply) -> dict[str, Any]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "completion_tokens": reply.completion_tokens,
        # vLLM fills the details only when the cached count is non-zero
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens} if reply.cached_tokens else None,
    }


def _completion_body(reply: _Reply, script: Script) -> dict[str, Any]:
    """A non-streaming ChatCompletionResponse as vLLM serializes it."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    message["reasoning"] = reply.reasoning
    if script.reasoning_content_alias:
        message["reasoning_content"] = reply.reasoning
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": script.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": reply.finish_reason,
                "stop_reason": None,
                "token_ids": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(reply),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    }


def _pieces_of(text: str, per_chunk: int = 3) -> Iterator[str]:
    """Split text into streaming pieces of a few toy tokens each."""
    pieces = TOKEN_RE.findall(text)
    for i in range(0, len(pieces), per_chunk):
        yield "".join(pieces[i : i + per_chunk])


def _stream_events(reply: _Reply, script: Script, include_usage: bool) -> Iterator[str]:
    """The SSE `data:` payloads of a streamed reply, ending with [DONE]."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        return json.dumps(
            {"id": cid, "object": "chat.completion.chunk", "created": created, "model": script.model, "choices": [choice]},
            ensure_ascii=False,
        )

    yield chunk({"role": "assistant", "content": ""})
    for piece in _pieces_of(reply.reasoning or ""):
        delta = {"reasoning": piece}
        if script.reasoning_content_alias:
            delta["reasoning_content"] = piece
        yield chunk(delta)
    for piece in _pieces_of(reply.content or ""):
        yield chunk({"content": piece})
    for index, call in enumerate(reply.tool_calls):
        # vLLM's M3 parser sends the name first, then the arguments whole once the <invoke> closes
        head = {"id": call["id"], "type": "function", "index": index, "function": {"name": call["function"]["name"]}}
        yield chunk({"tool_calls": [head]})
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]})
    yield chunk({}, reply.finish_reason)
    if include_usage:
        yield json.dumps(
            {"id": cid, "object": "chat.completion.chunk", "created": created, "model": script.model, "choices": [], "usage": _usage(reply)}
        )
    yield "[DONE]"


# Server -------------------------------------------------------------------------------------------


class StandinServer:
    """The stand-in as a context manager: `with StandinServer(script) as srv: srv.base_url`.

    `script` is a Script, a dict, a list of turns, or a path to a JSON script. Port 0 picks a
    free port. The server runs in a background thread until `stop()` (or the end of the `with`).
    `clock` times the performance model: default real time times its `time_scale`; a
    `standin.simclock.VirtualClock` for in-process simulations that real work must not slow.
    `api_key`: answer 401 without it on the paths vLLM guards (`vllm serve --api-key`).
    """

    def __init__(self, script: Script | dict | list | str | Path, *, host: str = "127.0.0.1", port: int = 0,
                 clock: ScaledClock | VirtualClock | None = None, keep_requests: bool = True,
                 api_key: str | None = None) -> None:
        self.script = load_script(script)
        self.host = host
        self.port = port
        # keep_requests=False: `requests` stays empty. A batch benchmark sends a thousand prompts of
        # a few MB each, which the log would hold for the whole run.
        self._state = StandinState(self.script, clock, keep_requests, api_key)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ending in /v1."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        """The server root (for /health, /tokenize, /metrics)."""
        return f"http://{self.host}:{self.port}"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every JSON body POSTed to /v1/chat/completions so far, in order (a snapshot copy)."""
        with self._state.lock:
            return list(self._state.requests)

    @property
    def thinking_modes(self) -> list[str]:
        """The thinking mode of every request that reached the script, in order."""
        with self._state.lock:
            return list(self._state.thinking_modes)

    @property
    def turns_served(self) -> int:
        """How many scripted turns have been consumed (fault turns included)."""
        with self._state.lock:
            return self._state.turns_served

    def start(self) -> StandinServer:
        """Bind and serve in a background thread; the loading clock starts now."""
        handler = type("StandinHandler", (_Handler,), {"state": self._state})
        try:
            self._httpd = _Server((self.host, self.port), handler)
        except OSError as e:
            raise UsageError(f"stand-in cannot listen on {self.host}:{self.port}: {e.strerror or e}") from None
        self.port = self._httpd.server_address[1]
        self._state.started_at = time.monotonic()
        # a short poll interval keeps stop() quick (serve_forever checks for shutdown between polls)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="m3-standin", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket; safe to call twice."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None

    def __enter__(self) -> StandinServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def standin_command(
    script: Path = typer.Option(..., "--script", help="JSON stand-in script (see docs/standin.md)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; keep it on loopback."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="VLLM_API_KEY",
                                          help="Require this key on /v1 routes, as vLLM does (also VLLM_API_KEY)."),
) -> None:
    """Run the M3 stand-in in the foreground until Ctrl-C.

    A scripted TEST DOUBLE speaking vLLM's wire format, not a model: every reply comes from the script.
    """
    server = StandinServer(script, host=host, port=port, api_key=api_key).start()
    stopped = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
    typer.echo(f"m3-agent stand-in (a scripted TEST DOUBLE, not a model) serving {server.base_url}", err=False)
    typer.echo(f"script: {script} ({len(server.script.turns)} turns, {len(server.script.conversations)} conversations); Ctrl-C to stop")
    try:
        while not stopped.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.stop()
        typer.echo("m3-agent stand-in stopped")
