"""Token counting: the server's `/tokenize`, a local `tokenizer.json`, or a calibrated estimate.

Every counter has a `kind` (what the pack reports), an `id` (the key of its counts in the on-disk
cache: two counters with the same id must give the same counts) and `count_many(texts)`.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, runtime_checkable

from m3_agent.agent.endpoint import EndpointClient
from m3_agent.errors import EndpointError, UsageError

# Texts longer than this are counted in pieces cut at line ends and summed (a cut can split a token
# the whole would merge, so the sum is usually at or a little above the whole's count); this keeps
# each /tokenize request a sane size. Budgeted packs stay below it and are counted whole.
MAX_REQUEST_CHARS = 8_000_000
CHARS_PER_TOKEN = 3.2  # the estimate's characters per token of ASCII source (it errs high: see EstimateCounter)
OUTPUT_RESERVE = 32_768  # tokens a default budget leaves for the model's reply (`budget_for_window`)
MIN_SCALE, MAX_SCALE = 0.25, 4.0  # an estimate is never scaled further than this to fit an exact counter


@runtime_checkable
class TokenCounter(Protocol):
    """What the packer needs from a tokenizer."""

    kind: str
    id: str

    def count_many(self, texts: list[str]) -> list[int]:
        """Token counts of `texts`, in order."""
        ...

    def count(self, text: str) -> int:
        """Token count of one text."""
        ...


def fit_scale(estimated: float, exact: float) -> float:
    """The scale that takes an estimate to an exact count of the same texts, clamped (1 with no estimate)."""
    return min(MAX_SCALE, max(MIN_SCALE, exact / estimated)) if estimated else 1.0


def text_shape(text: str) -> tuple[int, int]:
    """(characters, extra UTF-8 bytes beyond one per character): all the estimate looks at."""
    if text.isascii():
        return len(text), 0
    return len(text), len(text.encode("utf-8", "surrogatepass")) - len(text)


class EstimateCounter:
    """A fast estimate from the text's shape: characters, and extra bytes of non-ASCII characters.

    The defaults err high for code under 200k-vocabulary BPE tokenizers (about 3.2 characters a
    token for ASCII source; CJK characters about one token each). `calibrated` fits `scale` to an
    exact counter on sample texts.
    """

    kind = "estimate"

    def __init__(self, chars_per_token: float = CHARS_PER_TOKEN, tokens_per_extra_byte: float = 0.4, scale: float = 1.0) -> None:
        if chars_per_token <= 0 or tokens_per_extra_byte < 0 or scale <= 0:
            raise UsageError("estimate parameters must be positive")
        self.chars_per_token = chars_per_token
        self.tokens_per_extra_byte = tokens_per_extra_byte
        self.scale = scale
        self.id = f"estimate:{chars_per_token:g}:{tokens_per_extra_byte:g}:{scale:.4f}"

    def from_shape(self, chars: int, extra_bytes: int) -> int:
        """The estimate for a text of this shape (see `text_shape`)."""
        if chars == 0:
            return 0
        return math.ceil((chars / self.chars_per_token + extra_bytes * self.tokens_per_extra_byte) * self.scale)

    def count(self, text: str) -> int:
        """Estimated tokens of `text`."""
        return self.from_shape(*text_shape(text))

    def count_many(self, texts: list[str]) -> list[int]:
        """Estimated tokens of each text."""
        return [self.count(t) for t in texts]

    def calibrated(self, exact: TokenCounter, samples: list[str]) -> EstimateCounter:
        """A copy whose scale makes its total over `samples` match `exact`'s (clamped to 0.25-4x)."""
        samples = [s for s in samples if s]
        if not samples:
            return self
        unscaled = EstimateCounter(self.chars_per_token, self.tokens_per_extra_byte)
        est = sum(unscaled.count_many(samples))
        real = sum(exact.count_many(samples))
        if est <= 0 or real <= 0:
            return self
        return EstimateCounter(self.chars_per_token, self.tokens_per_extra_byte, fit_scale(est, real))


class TokenizerJsonCounter:
    """Exact counts from a Hugging Face `tokenizer.json` (the `tokenizers` package), no special tokens."""

    kind = "tokenizer.json"

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # an optional extra on some installs
            raise UsageError("counting with a tokenizer.json needs the 'tokenizers' package: pip install tokenizers") from e
        try:
            raw = path.read_bytes()
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # OSError, UnicodeDecodeError, and the tokenizers library's own errors
            raise UsageError(f"cannot load tokenizer {path}: {e}") from e
        self.path = path
        self.id = "tokenizer.json:" + hashlib.sha256(raw).hexdigest()[:16]

    def count_many(self, texts: list[str]) -> list[int]:
        """Exact token counts (encoded in one parallel batch)."""
        if not texts:
            return []
        encs = self._tok.encode_batch_fast(texts, add_special_tokens=False) if hasattr(
            self._tok, "encode_batch_fast") else self._tok.encode_batch(texts, add_special_tokens=False)
        return [len(e.ids) for e in encs]

    def count(self, text: str) -> int:
        """Exact token count of one text."""
        return self.count_many([text])[0]


def _split_long(text: str, limit: int) -> list[str]:
    """Cut a long text at line ends into pieces of at most about `limit` characters."""
    if len(text) <= limit:
        return [text]
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + limit)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            if nl > start:
                end = nl + 1
        out.append(text[start:end])
        start = end
    return out


class ServerCounter:
    """Exact counts from a vLLM server's `POST /tokenize`, several requests in flight at once.

    `base_url` may end in `/v1`. Construction checks the endpoint (one tiny request) and raises
    EndpointError when it is missing, so callers can fall back to another counter.
    """

    kind = "server"

    def __init__(self, base_url: str, model: str | None = None, *, api_key: str | None = None,
                 timeout: float = 120.0, concurrency: int = 4, check: bool = True) -> None:
        self.endpoint = EndpointClient(base_url, api_key=api_key, timeout=timeout)
        self.concurrency = max(1, concurrency)
        self.model = model or self.endpoint.card().id
        self.id = f"server:{self.model}"
        if check:
            self.endpoint.tokenize(self.model, "m3-agent")

    def count(self, text: str) -> int:
        """Exact token count of one text (a long one in pieces the server takes)."""
        if not text:
            return 0
        return sum(self.endpoint.tokenize(self.model, piece) for piece in _split_long(text, MAX_REQUEST_CHARS))

    def count_many(self, texts: list[str]) -> list[int]:
        """Exact counts, `concurrency` requests in flight over keep-alive connections."""
        if len(texts) <= 1 or self.concurrency == 1:
            return [self.count(t) for t in texts]
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="tokenize") as pool:
            return list(pool.map(self.count, texts))


def reply_budget(max_model_len: int, configured: int) -> int:
    """The completion tokens one request may ask for in a window: the configured count, at most a quarter
    of the window (an 8k window asked for 8,192 would leave the prompt nothing)."""
    return min(configured, max(1, max_model_len // 4))


def budget_for_window(max_model_len: int, *, output_reserve: int = OUTPUT_RESERVE, growth_reserve: float | int = 0.15) -> int:
    """The default pack budget for a context window: the window less room for output and for the conversation.

    The output room is `reply_budget` of `output_reserve`; `growth_reserve` is a share of the window when
    below 1, else a token count; each at most a quarter of the window, so that a small window still gets
    a pack (half of it). The loop and `m3-agent pack` both use this one formula.
    """
    growth = int(max_model_len * growth_reserve) if growth_reserve < 1 else int(growth_reserve)
    return max(0, max_model_len - reply_budget(max_model_len, output_reserve) - min(growth, max_model_len // 4))


def budget_for_server(base_url: str, *, model: str | None = None, output_reserve: int = OUTPUT_RESERVE,
                      growth_reserve: float | int = 0.15, api_key: str | None = None) -> int:
    """The default pack budget: the served model's `max_model_len` (from /v1/models) less reserves."""
    endpoint = EndpointClient(base_url, api_key=api_key)
    card = endpoint.card(model)
    if card.max_model_len is None:
        raise EndpointError(f"{endpoint.root}/v1/models gives no max_model_len for {card.id}")
    return budget_for_window(card.max_model_len, output_reserve=output_reserve, growth_reserve=growth_reserve)
