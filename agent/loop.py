"""The agent loop: the model proposes tool calls, the sandbox runs them, until the model is done.

    config = AgentConfig(model=ModelConfig(base_url="http://127.0.0.1:8000/v1"))
    result = Agent(config).run(repo=Path("."), issue="...")

One request per turn. History is append-only so the server's prefix cache keeps hitting: the first
user message is the packed repository (byte-identical for the same commit) followed by the issue;
every later request extends the previous one. The thinking mode is chosen per request by
`agent.thinking`; stalls are caught by `agent.stall`; everything goes to a JSONL trajectory.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from m3_agent.agent.config import SYSTEM_PROMPT, AgentConfig  # noqa: F401 - re-exported: where callers look
from m3_agent.agent.context import EstimateCounter, Pack, ServerCounter, pack_repository
from m3_agent.agent.context.tokens import budget_for_window
from m3_agent.errors import EndpointError, Interrupted, M3AgentError, UsageError
from m3_agent.agent.model import ContextOverflowError, ModelClient, ModelReply, Usage
from m3_agent.agent.stall import Stall, StallDetector, Step, nudge_message
from m3_agent.agent.thinking import LoopState, ThinkingPolicy
from m3_agent.agent.trajectory import TrajectoryWriter
from m3_agent.sandbox import Sandbox
from m3_agent.tools import Tool, ToolResult, default_tools, execute_call

RunStatus = Literal["submitted", "finished", "stalled", "turn_limit", "token_limit", "time_limit", "cost_limit", "error"]

FORMAT_ERROR_KINDS = {"unknown_tool", "bad_json", "bad_args", "truncated"}


class AgentEvent(BaseModel):
    """What an embedding program sees: kind is turn, reply (with usage), tool_call, tool_result, stall or finish."""

    kind: str
    turn: int
    data: dict[str, Any] = Field(default_factory=dict)


class Timings(BaseModel):
    """Where a run's wall time went."""

    wall_s: float = 0.0
    pack_s: float = 0.0
    sandbox_start_s: float = 0.0
    model_s: float = 0.0
    tools_s: float = 0.0


class RunResult(BaseModel):
    """The outcome of one run."""

    status: RunStatus
    patch: str = ""
    turns: int = 0
    usage: Usage = Field(default_factory=Usage)
    cache_hit_share: float = 0.0
    mode_counts: dict[str, int] = Field(default_factory=dict)
    stalls: list[Stall] = Field(default_factory=list)
    timings: Timings = Field(default_factory=Timings)
    cost_usd: float | None = None
    final_message: str = ""
    final_tests: dict[str, Any] | None = None  # the last test_runner summary
    pack_tokens: int = 0
    pack_files: int = 0
    error: str | None = None
    trajectory_path: Path | None = None


Callback = Callable[[AgentEvent], None]
IssueInput = str | list[dict[str, Any]]  # text, or OpenAI content parts (text + image_url)


def cap_output(text: str, limit: int) -> str:
    """Keep head and tail of a long tool output, with a marker saying what was cut."""
    if len(text) <= limit:
        return text
    half = limit // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters elided by m3-agent ...]\n{text[-half:]}"


class Agent:
    """Runs the loop for one issue on one repository. Build it from an AgentConfig."""

    def __init__(
        self,
        config: AgentConfig | None = None,
        *,
        tools: list[Tool] | None = None,
        callbacks: list[Callback] | None = None,
    ) -> None:
        self.config = config or AgentConfig()
        self.tools = tools if tools is not None else default_tools()
        self.callbacks = list(callbacks or [])

    def _emit(self, kind: str, turn: int, **data: Any) -> None:
        if not self.callbacks:
            return
        event = AgentEvent(kind=kind, turn=turn, data=data)
        for cb in self.callbacks:
            cb(event)

    def run(self, repo: Path, issue: IssueInput, *, trajectory_path: Path | None = None) -> RunResult:
        """Work on `issue` in a sandboxed copy of `repo` until submitted, finished, stalled or a limit.

        Raises EndpointError / SandboxUnavailable when infrastructure is missing, Interrupted on Ctrl-C
        (the trajectory is kept and the sandbox removed either way).
        """
        repo = Path(repo)
        if not repo.is_dir():
            raise UsageError(f"repository path {repo} does not exist or is not a directory")
        run = _Run(self, repo, issue, TrajectoryWriter(trajectory_path))
        try:
            return run.execute()
        except KeyboardInterrupt:
            run.finish("error", error="interrupted")
            raise Interrupted("interrupted: the trajectory is kept and the sandbox removed") from None
        except M3AgentError as e:
            run.finish("error", error=str(e))
            raise
        finally:
            run.close()


class _InThread:
    """A call run in a daemon thread; `result()` waits for it and returns its value or raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="m3-agent-pack", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # handed to the caller of result()
            self._error = e

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class _Run:
    """The state of one run; Agent.run is its only user."""

    def __init__(self, agent: Agent, repo: Path, issue: IssueInput, traj: TrajectoryWriter) -> None:
        self.agent = agent
        self.cfg = agent.config
        self.repo = repo
        self.issue = issue
        self.traj = traj
        self.client = ModelClient(self.cfg.model)
        self.policy = ThinkingPolicy(self.cfg.thinking)
        self.stall = StallDetector(self.cfg.stall)
        self.result = RunResult(status="error", trajectory_path=traj.path)
        self.modes: Counter[str] = Counter()
        self.t0 = time.monotonic()
        self.messages: list[dict[str, Any]] = []
        self.schemas = [t.schema() for t in agent.tools]
        self.finished = False

    # ----- set-up ---------------------------------------------------------------------------------
    def _issue_text(self) -> str:
        if isinstance(self.issue, str):
            return self.issue
        return "\n".join(p.get("text", "") for p in self.issue if p.get("type") == "text")

    def _budget(self) -> int | None:
        if self.cfg.context.budget is not None:
            return self.cfg.context.budget
        window = self.client.max_model_len()
        if not window:
            return None
        return budget_for_window(window, output_reserve=self.cfg.model.max_tokens,
                                 growth_reserve=self.cfg.context.reserve_tokens)

    def _counter(self):
        try:
            return ServerCounter(self.cfg.model.base_url, model=self.client.model,
                                 api_key=self.cfg.model.api_key.get_secret_value())
        except EndpointError:  # a server without /tokenize (SGLang): fall back to the estimate
            return EstimateCounter()

    def _pack(self, budget: int | None) -> Pack:
        t = time.monotonic()
        pack = pack_repository(
            self.repo,
            issue=self._issue_text(),
            budget=budget,
            counter=self._counter(),
            include=tuple(self.cfg.context.include),
            exclude=tuple(self.cfg.context.exclude),
            max_file_bytes=self.cfg.context.max_file_bytes,
        )
        self.result.timings.pack_s += time.monotonic() - t
        return pack

    def _first_messages(self, budget: int | None, pack: Pack | None = None) -> list[dict[str, Any]]:
        if pack is None:
            pack = self._pack(budget)
        self.result.pack_tokens, self.result.pack_files = pack.tokens, len(pack.files)
        self.traj.write("pack", tokens=pack.tokens, files=len(pack.files), skipped=len(pack.skipped),
                        counter=pack.counter_kind, budget=budget)
        # The repository comes first and the issue after it, so the prefix is shared across issues.
        task = (
            "\n\n<issue>\n{issue}\n</issue>\n\nResolve the issue above in /workspace. "
            "Use the tools; run the tests; call `submit` when the fix is done."
        )
        if isinstance(self.issue, str):
            user: Any = pack.text + task.format(issue=self.issue)
        else:
            user = [{"type": "text", "text": pack.text + task.format(issue=self._issue_text())}]
            user += [p for p in self.issue if p.get("type") != "text"]
        return [{"role": "system", "content": self.cfg.system_prompt}, {"role": "user", "content": user}]

    # ----- the loop -------------------------------------------------------------------------------
    def execute(self) -> RunResult:
        cfg = self.cfg
        self.traj.write("run_start", repo=str(self.repo), model=cfg.model.name, base_url=cfg.model.base_url,
                        config=cfg.model_dump(mode="json", exclude={"model": {"api_key"}}))
        model = self.client.model  # fails fast with EndpointError when the server is down
        self.traj.write("model", model=model, max_model_len=self.client.max_model_len())
        budget = self._budget()
        packing = _InThread(self._pack, budget)  # the repository is packed while the sandbox starts
        t = time.monotonic()
        with Sandbox(cfg.sandbox, repo=self.repo) as sb:
            self.result.timings.sandbox_start_s = time.monotonic() - t
            self.messages = self._first_messages(budget, packing.result())
            status, error = self._loop(sb, budget)
            patch = sb.diff()
        self.result.patch = patch
        self.finish(status, error=error)
        return self.result

    def _limit_hit(self) -> RunStatus | None:
        cfg, u = self.cfg.limits, self.result.usage
        if cfg.max_total_tokens is not None and u.total_tokens >= cfg.max_total_tokens:
            return "token_limit"
        if cfg.max_wall_s is not None and time.monotonic() - self.t0 >= cfg.max_wall_s:
            return "time_limit"
        cost = self._cost()
        if cfg.max_cost_usd is not None and cost is not None and cost >= cfg.max_cost_usd:
            return "cost_limit"
        return None

    def _cost(self) -> float | None:
        cfg, u = self.cfg.limits, self.result.usage
        if cfg.usd_per_m_input is not None or cfg.usd_per_m_output is not None:
            return (u.prompt_tokens * (cfg.usd_per_m_input or 0) + u.completion_tokens * (cfg.usd_per_m_output or 0)) / 1e6
        if cfg.gpu_usd_per_hour is not None:
            return cfg.gpu_usd_per_hour * (time.monotonic() - self.t0) / 3600
        return None

    def _request(self, turn: int, state: LoopState, budget: int | None) -> ModelReply:
        mode, reason = self.policy.decide(state)
        self.modes[mode] += 1
        self.agent._emit("turn", turn, thinking_mode=mode, reason=reason)
        self.traj.write("request", turn=turn, thinking_mode=mode, mode_reason=reason, n_messages=len(self.messages),
                        new_messages=self.messages[-2:] if turn > 1 else None)
        shrinks = 0
        while True:
            t = time.monotonic()
            try:
                reply = self.client.complete(self.messages, tools=self.schemas, thinking_mode=mode)
            except ContextOverflowError as e:
                self.traj.write("context_overflow", turn=turn, message=str(e), input_tokens=e.input_tokens, limit=e.limit)
                shrinks += 1
                if shrinks > 3 or not self._shrink(e, budget, shrinks):
                    raise
                self.stall.record_condensation(turn)
                continue
            finally:
                self.result.timings.model_s += time.monotonic() - t
            break
        self.result.usage.add(reply.usage)
        self.agent._emit("reply", turn, finish_reason=reply.finish_reason, tool_calls=len(reply.tool_calls),
                         usage=reply.usage.model_dump(), total_usage=self.result.usage.model_dump(),
                         cache_hit_share=round(self.result.usage.cache_hit_share, 4))
        self.traj.write("reply", turn=turn, content=reply.content, reasoning=reply.reasoning,
                        tool_calls=[c.model_dump() for c in reply.tool_calls], finish_reason=reply.finish_reason,
                        usage=reply.usage.model_dump(), latency_s=round(reply.latency_s, 4), attempts=reply.attempts)
        return reply

    def _shrink(self, e: ContextOverflowError, budget: int | None, attempt: int) -> bool:
        """Make the conversation fit after a context overflow: elide old tool outputs, then repack smaller."""
        elided = 0
        tool_msgs = [m for m in self.messages if m.get("role") == "tool"]
        for m in tool_msgs[:-2]:  # keep the latest results intact
            if not str(m["content"]).startswith("[elided"):
                m["content"] = "[elided by m3-agent to fit the context window; re-run the tool if needed]"
                elided += 1
        if elided and attempt == 1:
            self.traj.write("shrink", how="elided_tool_outputs", count=elided)
            return True
        over = (e.input_tokens or 0) - (e.limit or 0) + self.cfg.model.max_tokens
        current = budget if budget is not None else self.result.pack_tokens
        new_budget = int(max(current - max(over, 0), 0) * 0.8)
        if new_budget <= 0:
            return False
        first = self._first_messages(new_budget)
        self.messages[1] = first[1]
        self.traj.write("shrink", how="repacked", budget=new_budget)
        return True

    def _loop(self, sb: Sandbox, budget: int | None) -> tuple[RunStatus, str | None]:
        cfg = self.cfg.limits
        state = LoopState(turn=1, last_tools=[], last_tool_errors=0, last_tests_failed=None, last_edit_ok=False,
                          stalled=False, format_errors_in_row=0)
        nudged = False
        for turn in range(1, cfg.max_turns + 1):
            self.result.turns = turn
            limit = self._limit_hit()
            if limit:
                return limit, None
            state.turn = turn
            reply = self._request(turn, state, budget)
            self.messages.append(reply.as_message())
            state.stalled = False

            if not reply.tool_calls:
                self.stall.record(Step(turn=turn, tool=None, args=None, output=reply.content))
                if reply.finish_reason == "length":
                    # The reply was cut off before it said anything usable: ask for a shorter one.
                    state.format_errors_in_row += 1
                    if state.format_errors_in_row >= cfg.max_format_errors:
                        return "error", f"{state.format_errors_in_row} truncated replies in a row"
                    self.messages.append({"role": "user", "content": (
                        "Your reply was cut off (max_tokens reached). Reply more briefly, "
                        "and make one tool call at a time.")})
                    continue
                self.result.final_message = reply.content
                return "finished", None

            results = self._run_tools(sb, turn, reply)
            submitted = any(r.submitted for r in results)
            format_errors = [r for r in results if r.error_kind in FORMAT_ERROR_KINDS]
            state.format_errors_in_row = state.format_errors_in_row + 1 if len(format_errors) == len(results) else 0
            state.last_tools = [c.name for c in reply.tool_calls]
            state.last_tool_errors = sum(not r.ok for r in results)
            tests = [r.data for r in results if "failing" in r.data]
            state.last_tests_failed = bool(tests[-1].get("failed") or tests[-1].get("errors")) if tests else None
            state.last_edit_ok = any(r.ok and r.changed_files for r in results)
            if tests:
                self.result.final_tests = tests[-1]
            if submitted:
                self.result.final_message = next(r.output for r in results if r.submitted)
                return "submitted", None
            if state.format_errors_in_row >= cfg.max_format_errors:
                return "error", f"{state.format_errors_in_row} turns in a row with only malformed tool calls"

            self.stall.end_turn(turn)
            stall = self.stall.check()
            if stall is not None:
                self.result.stalls.append(stall)
                self.traj.write("stall", turn=turn, rule=stall.rule, evidence=stall.evidence, nudged=nudged)
                self.agent._emit("stall", turn, rule=stall.rule, evidence=stall.evidence)
                if nudged:
                    return "stalled", f"stalled: {stall.rule}: {stall.evidence}"
                nudged = True
                state.stalled = True
                self.messages.append({"role": "user", "content": nudge_message(stall)})
                self.stall.user_message()
        return "turn_limit", None

    def _run_tools(self, sb: Sandbox, turn: int, reply: ModelReply) -> list[ToolResult]:
        truncated = reply.finish_reason == "length"
        results = []
        for call in reply.tool_calls:
            self.traj.write("tool_call", turn=turn, id=call.id, name=call.name, arguments=call.arguments)
            self.agent._emit("tool_call", turn, id=call.id, name=call.name, arguments=call.arguments)
            t = time.monotonic()
            result = execute_call(call.name, call.arguments, self.agent.tools, sb, truncated=truncated)
            took = time.monotonic() - t
            self.result.timings.tools_s += took
            output = cap_output(result.output, self.cfg.output_cap_chars)
            self.messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
            self.traj.write("tool_result", turn=turn, id=call.id, name=call.name, ok=result.ok,
                            error_kind=result.error_kind, output=output, data=result.data,
                            changed_files=result.changed_files, duration_s=round(took, 4))
            self.agent._emit("tool_result", turn, id=call.id, name=call.name, ok=result.ok,
                             error_kind=result.error_kind, data=result.data, output=output)
            self.stall.record(Step(
                turn=turn, tool=call.name, args=_parsed(call.arguments), output=output,
                error=not result.ok, exit_code=result.data.get("exit_code"), running=result.running,
                changed_files=list(result.changed_files),
                failing_tests=[f.get("id", "") for f in result.data["failing"]] if "failing" in result.data else None,
            ))
            results.append(result)
            if result.submitted:
                break
        return results

    # ----- the end --------------------------------------------------------------------------------
    def finish(self, status: RunStatus, *, error: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        r = self.result
        r.status, r.error = status, error
        r.mode_counts = dict(self.modes)
        r.cache_hit_share = round(r.usage.cache_hit_share, 4)
        r.cost_usd = self._cost()
        r.timings.wall_s = time.monotonic() - self.t0
        self.traj.write("finish", status=status, error=error, turns=r.turns, usage=r.usage.model_dump(),
                        cache_hit_share=r.cache_hit_share, mode_counts=r.mode_counts,
                        stalls=[s.model_dump() for s in r.stalls], timings=r.timings.model_dump(),
                        cost_usd=r.cost_usd, patch=r.patch, final_tests=r.final_tests)
        self.agent._emit("finish", r.turns, status=status, error=error)

    def close(self) -> None:
        self.traj.close()
        self.client.close()


def _parsed(arguments: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments or "")
    except (json.JSONDecodeError, TypeError):
        return None
    return value if isinstance(value, dict) else None
