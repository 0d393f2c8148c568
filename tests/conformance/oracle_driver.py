"""Runs INSIDE the oracle virtualenv (vLLM / SGLang installed): answers one JSON question on stdin.

    ORACLE_PYTHON tests/conformance/oracle_driver.py < question.json > answer.json

A question is {"task": NAME, ...}; each task below uses the engines' own code, never ours, so the
conformance tests compare the project against the engines. Imports are inside the tasks: the
tier's tests each pay only for the modules their task needs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from typing import Any


class CharTokenizer:
    """One token per character, and one for each think marker (M3's vocabulary has both markers).

    The parsers read text; they need a tokenizer only to find the markers and to count tokens.
    """

    MARKERS = {"<mm:think>": 2_000_001, "</mm:think>": 2_000_002}  # above every code point
    _split = re.compile("(" + "|".join(map(re.escape, MARKERS)) + ")")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            ids.extend([self.MARKERS[part]] if part in self.MARKERS else (ord(c) for c in part))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        names = {v: k for k, v in self.MARKERS.items()}
        return "".join(names.get(i) or chr(i) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.MARKERS)

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self.MARKERS)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.MARKERS.get(token)


def _vllm_serve_parser() -> tuple[argparse.ArgumentParser, Any]:
    from vllm import platforms
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.platforms.cpu import CpuPlatform

    # no GPU here: the argument defaults need a platform, so take vLLM's CPU one (as `vllm bench` does)
    if platforms.current_platform.is_unspecified():
        platforms.current_platform = CpuPlatform()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    cmd = ServeSubcommand()
    cmd.subparser_init(top.add_subparsers(dest="subparser"))
    return top, cmd


def _parse_quietly(parse) -> tuple[Any, str | None]:
    """Run an argparse call; return (namespace, None) or (None, the error argparse printed)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(), None
    except SystemExit:
        return None, err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "argparse exited"
    except Exception as e:  # the engines' validators raise plain exceptions
        return None, f"{type(e).__name__}: {e}"


def vllm_args(q: dict[str, Any]) -> dict[str, Any]:
    """Parse each argv (after `vllm serve`) with `vllm serve`'s own parser and validator."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top, cmd = _vllm_serve_parser()
    api_server = make_arg_parser(FlexibleArgumentParser(prog="vllm.entrypoints.openai.api_server"))
    results = []
    for argv, form in zip(q["argvs"], q.get("forms") or ["serve"] * len(q["argvs"])):
        # `vllm serve ARGS` and `python -m vllm.entrypoints.openai.api_server ARGS` share make_arg_parser
        parse = (lambda argv=argv: top.parse_args(["serve", *argv])) if form == "serve" else (lambda argv=argv: api_server.parse_args(argv))
        ns, error = _parse_quietly(parse)
        if ns is not None:
            _, error = _parse_quietly(lambda ns=ns: (cmd.validate(ns), ns)[1])
        picked = {k: getattr(ns, k, None) for k in ("model", "model_tag", "tool_call_parser", "reasoning_parser",
                                                     "block_size", "tensor_parallel_size", "host", "api_key")} if ns else {}  # fmt: skip
        results.append({"error": error, "values": {k: v for k, v in picked.items() if isinstance(v, (str, int, list, type(None)))}})
    return {
        "results": results,
        "tool_parsers": sorted(ToolParserManager.list_registered()),
        "reasoning_parsers": sorted(ReasoningParserManager.list_registered()),
    }


def sglang_args(q: dict[str, Any]) -> dict[str, Any]:
    """Parse each argv (after `python -m sglang.launch_server`) with SGLang's ServerArgs."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    results = []
    for argv in q["argvs"]:
        ns, error = _parse_quietly(lambda argv=argv: parser.parse_args(argv))
        values = {}
        if ns is not None:
            values = {k: getattr(ns, k, None) for k in ("model_path", "tool_call_parser", "reasoning_parser", "page_size",
                                                         "host", "api_key")}
        results.append({"error": error, "values": values})
    return {"results": results}


def _answers(app: Any, requests: list[list[Any]]) -> list[list[Any]]:
    """[status, start of the body] of each [method, path, key, body?] request, sent through a test client of
    `app` (no server, no socket)."""
    from fastapi.testclient import TestClient

    client = TestClient(app, raise_server_exceptions=False)
    out = []
    for method, path, key, *body in requests:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = client.request(method, path, headers=headers, json=(body[0] if body else {}) if method == "POST" else None)
        out.append([r.status_code, r.text[:300]])
    return out


def vllm_auth(q: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own API server app, built on CPU from `argv` (parsed by `vllm serve`'s parser) with `env` as
    the process environment (VLLM_API_KEY), and each request's status. No engine runs: a request its
    API-key middleware lets through reaches a handler that has none (400 or 500), never 401."""
    import os

    os.environ.update(q.get("env") or {})
    top, _ = _vllm_serve_parser()
    ns = top.parse_args(["serve", *q["argv"]])
    from vllm.entrypoints.launchers.app import build_app

    app = build_app(ns, supported_tasks=("generate",))
    return {"answers": _answers(app, q["requests"]), "host": ns.host, "api_key_flag": ns.api_key}


def sglang_auth(q: dict[str, Any]) -> dict[str, Any]:
    """SGLang's own API-key middleware, added as its http_server adds it with the args `argv` parses to, on an
    app with the routes clients use; each request's status. SGLang's app itself cannot be built here:
    sglang.srt.entrypoints.http_server imports torchvision (via sglang.srt.configs), left out with the GPU
    stack. Also: whether that middleware is added in single-tokenizer mode only (read from the source)."""
    import importlib.util
    import pathlib

    from fastapi import FastAPI
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.auth import add_api_key_middleware

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(q["argv"])
    app = FastAPI()
    for method, path, *_ in q["requests"]:
        app.add_api_route(path, lambda: {"ok": True}, methods=[method])
    if ns.api_key or ns.admin_api_key:  # http_server.py's condition (admin-only routes aside)
        add_api_key_middleware(app, api_key=ns.api_key, admin_api_key=ns.admin_api_key)
    source = pathlib.Path(importlib.util.find_spec("sglang.srt.entrypoints.http_server").origin).read_text()
    branch = source[source.index("if get_serving().tokenizer_worker_num == 1:"):]
    single_only = source.count("add_api_key_middleware(") == 1 and "add_api_key_middleware(" in branch.split("\n    else:")[0]
    return {"statuses": [status for status, _ in _answers(app, q["requests"])], "host": ns.host, "api_key": ns.api_key,
            "middleware_in_single_tokenizer_mode_only": single_only}


def router_args(q: dict[str, Any]) -> dict[str, Any]:
    """Parse each argv (after `python -m sglang_router.launch_router`) with the router's own parser."""
    from sglang_router.launch_router import parse_router_args

    results = []
    for argv in q["argvs"]:
        ra, error = _parse_quietly(lambda argv=argv: parse_router_args(argv))
        values = {k: getattr(ra, k, None) for k in ("worker_urls", "policy", "host", "port", "api_key")} if ra else {}
        results.append({"error": error, "values": values})
    return {"results": results}


def _parser(tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]):
    from vllm.parser import ParserManager

    cls = ParserManager.get_parser(tool_parser_name="minimax_m3", reasoning_parser_name="minimax_m3", enable_auto_tools=True)
    return cls(CharTokenizer(), tools, chat_template_kwargs=kwargs, model_config=None)


def _calls(tool_calls: list[Any]) -> list[dict[str, Any]]:
    return [{"name": c.function.name if hasattr(c, "function") else c.name,
             "arguments": json.loads(c.function.arguments if hasattr(c, "function") else c.arguments)}
            for c in tool_calls or []]  # fmt: skip


def parse_output(q: dict[str, Any]) -> dict[str, Any]:
    """Each case's raw text through vLLM's minimax_m3 parsers: whole, and streamed in `chunk` pieces."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    results = []
    for case in q["cases"]:
        kwargs = {"thinking_mode": case["thinking_mode"]} if case.get("thinking_mode") else {}
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": kwargs}
        if case.get("tools"):
            body["tools"] = case["tools"]
        req = ChatCompletionRequest.model_validate(body)
        text, tok = case["raw"], CharTokenizer()
        reasoning, content, calls = _parser(req.tools, kwargs).parse(
            text, req, enable_auto_tools=True, model_output_token_ids=tok.encode(text)
        )
        whole = {"reasoning": reasoning, "content": content, "tool_calls": _calls(calls)}
        results.append({"whole": whole, "stream": _stream(text, req, kwargs, case.get("chunk", 7))})
    return {"results": results}


def _stream(text: str, req: Any, kwargs: dict[str, Any], size: int) -> dict[str, Any]:
    """vLLM's streaming deltas for `text` fed in `size`-character pieces, accumulated."""
    parser, tok = _parser(req.tools, kwargs), CharTokenizer()
    reasoning, content, calls = "", "", {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for n, piece in enumerate(pieces):
        delta = parser.parse_delta(delta_text=piece, delta_token_ids=tok.encode(piece), request=req,
                                   prompt_token_ids=[1], finished=n == len(pieces) - 1)  # fmt: skip
        if delta is None:
            continue
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"name": "", "arguments": "", "ids": []})
            if call.id:
                slot["ids"].append(call.id)
            if call.function is not None:
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
    return {"reasoning": reasoning or None, "content": content or None,
            "tool_calls": [{"name": c["name"], "arguments": json.loads(c["arguments"] or "{}"), "ids": c["ids"]}
                           for _, c in sorted(calls.items())]}  # fmt: skip


def validate_requests(q: dict[str, Any]) -> dict[str, Any]:
    """Validate each chat body with vLLM's ChatCompletionRequest; list the fields it would ignore."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    results = []
    for body in q["bodies"]:
        try:
            req = ChatCompletionRequest.model_validate(body)
        except Exception as e:
            results.append({"error": f"{type(e).__name__}: {e}"})
            continue
        known = set(ChatCompletionRequest.model_fields) | {f.alias for f in ChatCompletionRequest.model_fields.values() if f.alias}
        results.append({"error": None, "ignored": sorted(set(body) - known),
                        "message_reasoning": [m.get("reasoning") if isinstance(m, dict) else None for m in req.messages]})  # fmt: skip
    return {"results": results}


def tokenize_models(q: dict[str, Any]) -> dict[str, Any]:
    """Validate /tokenize requests and responses with vLLM's serve models."""
    import vllm.entrypoints.serve.tokenize.protocol as proto

    out = {"requests": [], "responses": []}
    for body in q["requests"]:
        model = proto.TokenizeChatRequest if "messages" in body else proto.TokenizeCompletionRequest
        try:
            model.model_validate(body)
            known = set(model.model_fields)
            out["requests"].append({"error": None, "model": model.__name__, "ignored": sorted(set(body) - known)})
        except Exception as e:
            out["requests"].append({"error": f"{type(e).__name__}: {e}"})
    for body in q["responses"]:
        try:
            proto.TokenizeResponse.model_validate(body)
            out["responses"].append({"error": None, "ignored": sorted(set(body) - set(proto.TokenizeResponse.model_fields))})
        except Exception as e:
            out["responses"].append({"error": f"{type(e).__name__}: {e}"})
    return out


def source_facts(q: dict[str, Any]) -> dict[str, Any]:
    """Facts read from vLLM's installed code: its version, metric names present, tool-choice support."""
    import importlib.metadata
    import pathlib

    import vllm
    from vllm.config import CacheConfig
    from vllm.tool_parsers import ToolParserManager

    root = pathlib.Path(vllm.__file__).parent
    metrics_src = "".join(p.read_text(encoding="utf-8", errors="replace") for p in (root / "v1" / "metrics").rglob("*.py"))
    parser_cls = ToolParserManager.get_tool_parser("minimax_m3")
    return {
        "version": importlib.metadata.version("vllm"),
        "metrics_present": {name: f'"{name}"' in metrics_src for name in q["metrics"]},
        "supports_required_and_named": getattr(parser_cls, "supports_required_and_named", True),
        "cache_config_fields": sorted(CacheConfig.__dataclass_fields__),  # the labels of vllm:cache_config_info
    }


def context_errors(q: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own length checks of each chat body (its TokenizeParams) for a prompt of `prompt` tokens in a
    window of `window`: the 400 text and param vLLM answers, or None when it takes the request."""
    from types import SimpleNamespace

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    answers = []
    for case in q["cases"]:
        try:
            request = ChatCompletionRequest.model_validate(case["body"])
            request.build_tok_params(SimpleNamespace(max_model_len=case["window"]))._token_len_check(
                None, list(range(case["prompt"])))
            answers.append(None)
        except Exception as e:  # the VLLMValidationError vLLM turns into the 400 (str(e) is its message)
            answers.append({"message": str(e), "param": getattr(e, "parameter", None)})
    return {"answers": answers}


TASKS = {f.__name__: f for f in (vllm_args, sglang_args, parse_output, validate_requests, tokenize_models, source_facts,
                                  vllm_auth, sglang_auth, router_args, context_errors)}

if __name__ == "__main__":
    question = json.load(sys.stdin)
    answer = TASKS[question["task"]](question)
    sys.stdout.write(json.dumps(answer, default=str))
