"""The agent loop: the model proposes tool calls, the environment runs them, until the model is done.

    config = AgentConfig(model=ModelConfig(base_url="http://127.0.0.1:8000/v1"))
    result = Agent(config).run(repo=Path("."), issue="...")
    result = Agent(config, model=my_model, env_factory=LocalEnvironment).run(...)   # injected parts

`Agent` takes a model, an environment factory, a packer and a stall detector (`agent.protocols`;
defaults: the M3 client, the Docker sandbox, a `context.Packer` counting with the model's own
`token_counter()`, and a `StallDetector` of the config's rules). `_Run.loop` is a plain step loop:
whatever ends the run raises a `RunEnded` (Submitted, Finished, LimitsExceeded, FormatError,
Stalled). Each event is emitted once on one stream (`agent.events`); the trajectory writer and the
callbacks subscribe to it. The messages live in the run's `Conversation` (`agent.conversation`, its
texts `agent.prompts`), usage and timings in its `Ledger` (`agent.ledger`, which `RunResult` extends).

A reply without a tool call ends the run (Finished) only when the last test run saw the current,
non-empty change and passed. A tool call written as text is read as one (`tools.text_calls`); any
other such reply is re-prompted, counted like a format error, and the next request asks for a tool
call with `tool_choice: "required"` ("auto" for the rest of the run where the server refuses it).

One request per turn; each extends the previous one (but for shrinking), so the server's prefix cache
keeps hitting. The thinking mode is chosen per request by `agent.thinking`; stalls are caught by `agent.stall`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from m3_agent.agent.config import AgentConfig
from m3_agent.agent.context import Pack
from m3_agent.agent.context import pack as packing
from m3_agent.agent.context.tokens import EstimateCounter, budget_for_window, reply_budget
from m3_agent.agent.conversation import Conversation, IssueInput, issue_text
from m3_agent.agent.events import EventStream, Subscriber
from m3_agent.agent.ledger import Ledger
from m3_agent.agent.model import (
    ContextOverflowError,
    ModelClient,
    ModelReply,
    ThinkingRejected,
    ToolCall,
    ToolChoiceRefused,
)
from m3_agent.agent.protocols import Environment, EnvironmentFactory, Model, Packer
from m3_agent.agent.recovery import Recovery, SandboxLostError, Watched, notice, reason_of
from m3_agent.agent.stall import Stall, StallDetector, Step
from m3_agent.agent.thinking import LoopState, ThinkingPolicy
from m3_agent.agent.trajectory import TrajectoryWriter
from m3_agent.agent.verdict import TestWatch, Verdict, decide, unverified
from m3_agent.errors import Interrupted, M3AgentError, SandboxDied, UsageError
from m3_agent.sandbox import Sandbox
from m3_agent.sandbox.output import head_tail
from m3_agent.tools import Tool, ToolResult, default_tools, execute_call, read_text_call, with_project_tests
from m3_agent.tools.js_runners import repository_note

RunStatus = Literal["submitted", "finished", "stalled", "turn_limit", "token_limit", "time_limit", "cost_limit",
                    "context_limit", "error"]

FORMAT_ERROR_KINDS = {"unknown_tool", "bad_json", "bad_args", "truncated"}


def unusable_calls(turns: int, reply: ModelReply, results: list[ToolResult], tools: list[Tool]) -> str:
    """Why a run of turns without one usable tool call ended it: calls to tools that do not exist are
    named as such (a script or prompt written for another tool set), not called malformed."""
    unknown = sorted({c.name for c, r in zip(reply.tool_calls, results) if r.error_kind == "unknown_tool"})
    known = f"the tools are {', '.join(t.name for t in tools)}"
    if unknown and all(r.error_kind == "unknown_tool" for r in results):
        return f"{turns} turns in a row calling only tools that do not exist ({', '.join(unknown)}); {known}"
    if unknown:
        return (f"{turns} turns in a row without a usable tool call: tools that do not exist "
                f"({', '.join(unknown)}) and malformed calls; {known}")
    return f"{turns} turns in a row with only malformed tool calls (bad JSON, bad arguments or cut off)"


class RunResult(Ledger):
    """The outcome of one run, with its ledger (usage, modes, timings, cost)."""

    status: RunStatus
    patch: str = ""
    turns: int = 0
    stalls: list[Stall] = Field(default_factory=list)
    sandbox_restarts: int = 0  # fresh environments started after the one in use died (agent.recovery)
    final_message: str = ""
    final_tests: dict[str, Any] | None = None  # the tests that ran on the final workspace (verdict.tests)
    verdict: Verdict | None = None  # which test run decides, and when it ran relative to the last change
    pack_tokens: int = 0
    pack_files: int = 0
    error: str | None = None
    trajectory_path: Path | None = None


# ----- how a run ends: raised from wherever the loop is, caught once in `_Run.loop` ----------------


class RunEnded(Exception):
    """The loop is over; `status` is the run's status and `error` says why when it failed."""

    status: RunStatus = "error"

    def __init__(self, error: str | None = None, *, status: RunStatus | None = None) -> None:
        super().__init__(error or status or self.status)
        self.error = error
        if status is not None:
            self.status = status


class Submitted(RunEnded):
    """The model called `submit`."""

    status = "submitted"


class Finished(RunEnded):
    """The model answered without a tool call after a passing test run of the current change: it is done."""

    status = "finished"


class LimitsExceeded(RunEnded):
    """A turn, token, time, cost or context-window limit was reached (the status names which; a context
    limit says in `error` which window the conversation outgrew)."""


class FormatError(RunEnded):
    """Too many turns in a row whose every tool call was malformed, or whose reply had no tool call."""


class Stalled(RunEnded):
    """A stall was detected again after the nudge."""

    status = "stalled"


class SandboxLost(RunEnded):
    """The environment died once more than `limits.max_sandbox_restarts` allows."""


# ----- the agent ----------------------------------------------------------------------------------


class Agent:
    """Runs the loop for one issue on one repository.

    `model` (a `protocols.Model`) defaults to `ModelClient(config)`; `env_factory` (repository path ->
    `Environment`) to the Docker `Sandbox` with `config.sandbox`. Hand in your own to embed the loop,
    e.g. `env_factory=LocalEnvironment` (no isolation). An injected model is not closed by the run.
    `packer` (a `protocols.Packer`) packs the repository into the first message; default: a
    `Packer` of `config.context` counting with `model.token_counter()` (another counter:
    `packer=Packer.from_config(config.context, counter=...)`).
    `stall`: the run's stall detector (default: a `StallDetector` of `config.stall`; it keeps what it
    saw, so give each run a fresh one). `callbacks` subscribe to the run's event stream
    (`agent.events`) after the trajectory writer.
    """

    def __init__(
        self,
        config: AgentConfig | None = None,
        *,
        model: Model | None = None,
        env_factory: EnvironmentFactory | None = None,
        tools: list[Tool] | None = None,
        callbacks: list[Subscriber] | None = None,
        packer: Packer | None = None,
        stall: StallDetector | None = None,
    ) -> None:
        self.config = config or AgentConfig()
        self.model = model
        self.env_factory: EnvironmentFactory = env_factory or self.docker_sandbox
        self.tools = tools if tools is not None else default_tools()
        self.callbacks = list(callbacks or [])
        self.packer, self.stall = packer, stall

    def docker_sandbox(self, repo: Path) -> Sandbox:
        """The default environment: a hardened Docker container holding a copy of `repo`."""
        return Sandbox(self.config.sandbox, repo=repo)

    def run(self, repo: Path, issue: IssueInput, *, trajectory_path: Path | None = None) -> RunResult:
        """Work on `issue` in an environment made from `repo` until submitted, finished, stalled or a limit.

        Raises EndpointError / SandboxUnavailable when infrastructure is missing, Interrupted on Ctrl-C
        (the trajectory is kept and the environment closed either way).
        """
        repo = Path(repo)
        if not repo.is_dir():
            raise UsageError(f"repository path {repo} does not exist or is not a directory")
        writer = TrajectoryWriter(trajectory_path) if trajectory_path is not None else None
        events = EventStream([writer, *self.callbacks] if writer else self.callbacks)
        run = _Run(self, repo, issue, events, trajectory_path)
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
            if writer:
                writer.close()


def _in_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """`fn(*args)` run in a daemon thread (a Ctrl-C does not wait for it): its future value or error."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to the caller of result()
            future.set_exception(e)

    threading.Thread(target=run, name="m3-agent-pack", daemon=True).start()
    return future


class _Run:
    """The state of one run; Agent.run is its only user."""

    def __init__(self, agent: Agent, repo: Path, issue: IssueInput, events: EventStream,
                 trajectory_path: Path | None) -> None:
        self.agent = agent
        self.cfg = agent.config
        self.repo = repo
        self.events = events
        self.owns_model = agent.model is None
        self.model: Model = agent.model if agent.model is not None else ModelClient(self.cfg.model)
        self.policy = ThinkingPolicy(self.cfg.thinking)
        self.stall = agent.stall if agent.stall is not None else StallDetector(self.cfg.stall)
        self.packer: Packer | None = agent.packer  # made at the first pack when not injected
        self.result = RunResult(status="error", trajectory_path=trajectory_path)
        self.state = LoopState(turn=0)  # the turn number's one home
        self.budget: int | None = None
        self.conversation = Conversation(self.cfg.prompts, issue, self.emit)
        # test_runner runs the project's own test command where it has one that is not pytest.
        self.tools = with_project_tests(agent.tools, repo, self.cfg.tests.command)
        self.schemas = [t.schema() for t in self.tools]
        self.tests = TestWatch()
        self.env: Environment | None = None  # replaced when it dies (agent.recovery)
        self.recovery = Recovery(self.cfg.limits.max_sandbox_restarts)
        self.finished = False
        self.tool_choice = "auto"  # the next request's; "required" after a re-prompt
        self.forcing = True  # the server takes tool_choice "required" (False once it refused it)
        self.thinking = True  # the server takes the thinking-mode parameter (False once it rejected it)
        self.window: int | None = None  # the context window: the server's, the configured one, or an error's
        self.max_tokens = self.cfg.model.max_tokens  # per request: at most a quarter of a known window
        self.ran_on_turn = 0  # the last turn whose reply ran on to the window's end (`_ran_on`)

    def emit(self, kind: str, **data: Any) -> None:
        self.events.emit(kind, self.state.turn, **data)

    # ----- set-up ---------------------------------------------------------------------------------
    def execute(self) -> RunResult:
        first = self.env = self.agent.env_factory(self.repo)
        try:
            self._start(first)
            packing = _in_thread(self._pack, self.budget)  # the repository is packed while the environment starts
            t = time.monotonic()
            with first:
                self.result.timings.sandbox_start_s = time.monotonic() - t
                self.conversation.start(self._packed(self.budget, packing.result()).text,
                                        repository_note(Path(self.repo)))  # a JavaScript repository's runner
                end = self.loop()
                try:  # a run that lost its environment keeps the last diff it took
                    self.result.patch = self.recovery.kept if isinstance(end, SandboxLost) else self._final_patch()
                except SandboxLost as lost:
                    end, self.result.patch = lost, self.recovery.kept
                self._verify(end)
        finally:
            self.env.close()
            first.close()
        self.finish(end.status, error=end.error)
        return self.result

    def _start(self, env: Environment) -> None:
        cfg = self.cfg
        self.emit("run_start", repo=str(self.repo), model=cfg.model.name, base_url=cfg.model.base_url,
                  config=cfg.model_dump(mode="json", exclude={"model": {"api_key"}}),
                  environment={"kind": getattr(env, "kind", type(env).__name__),
                               "isolated": getattr(env, "isolated", None)})
        model = self.model.model  # fails fast with EndpointError when the server is down
        reported = self.model.max_model_len()
        self._set_window(reported or cfg.model.context_window)
        self.emit("model", model=model, max_model_len=reported, context_window=self.window,
                  window_source="server" if reported else "config" if self.window else None, max_tokens=self.max_tokens)
        self.budget = self._budget()

    def _set_window(self, window: int | None) -> None:
        """Take `window` as the context window: the reply budget shrinks to a quarter of it if need be."""
        self.window = window
        if window:
            self.max_tokens = reply_budget(window, self.cfg.model.max_tokens)

    def _budget(self, configured: bool = True) -> int | None:
        """The pack's budget: the configured one, else what the window leaves (None without one)."""
        if configured and self.cfg.context.budget is not None:
            return self.cfg.context.budget
        return budget_for_window(self.window, output_reserve=self.max_tokens,
                                 growth_reserve=self.cfg.context.reserve_tokens) if self.window else None

    def _pack(self, budget: int | None) -> Pack:
        with self.result.timed("pack_s"):
            if self.packer is None:
                self.packer = packing.Packer.from_config(self.cfg.context, counter=self.model.token_counter())
            return self.packer.pack(self.repo, issue=issue_text(self.conversation.issue), budget=budget,
                                    history=self.cfg.context.history)

    def _packed(self, budget: int | None, pack: Pack | None = None) -> Pack:
        """`pack` (else a new one for `budget`), counted and announced."""
        pack = pack or self._pack(budget)
        self.result.pack_tokens, self.result.pack_files = pack.tokens, len(pack.files)
        self.emit("pack", tokens=pack.tokens, files=len(pack.files), skipped=len(pack.skipped),
                  counter=pack.counter_kind, budget=budget, delta_base=pack.delta_base)
        return pack

    # ----- the loop -------------------------------------------------------------------------------
    def loop(self) -> RunEnded:
        """Step until something ends the run."""
        try:
            while True:
                self.step()
        except RunEnded as end:
            return end

    def step(self) -> None:
        """One turn: check the limits, ask the model, run its tool calls, look for a stall."""
        if self.state.turn >= self.cfg.limits.max_turns:
            raise LimitsExceeded(status="turn_limit")
        self.state.turn += 1
        limit = self.result.limit_reached(self.cfg.limits)
        if limit:
            raise LimitsExceeded(status=limit)
        reply = self._request()
        if not reply.tool_calls:
            reply = self._read_text_call(reply)
        self.conversation.add(reply.as_message())
        self.state.stalled = False
        if not reply.tool_calls:
            self._answer_without_tools(reply)
            return
        results = self._run_tools(reply)
        self._observe(reply, results)
        self._check_stall()

    def _request(self) -> ModelReply:
        mode, reason = self.policy.decide(self.state) if self.thinking else (None, "the server takes no thinking mode")
        choice, self.tool_choice = self.tool_choice, "auto"
        self.emit("request", thinking_mode=mode, mode_reason=reason, n_messages=len(self.conversation.messages),
                  tool_choice=choice, max_tokens=self.max_tokens)
        reply = self._complete(mode, choice)
        self.result.account(reply, mode if self.thinking else None)  # the modes the server was sent
        usage = self.result.usage
        # the reply's text and calls are in the assistant `message` that follows: this event carries the rest
        self.emit("reply", finish_reason=reply.finish_reason, usage=reply.usage.model_dump(),
                  total_usage=usage.model_dump(), cache_hit_share=round(usage.cache_hit_share, 4),
                  latency_s=round(reply.latency_s, 4), attempts=reply.attempts)
        return reply

    def _complete(self, mode: str | None, choice: str) -> ModelReply:
        """The model's reply; a context overflow shrinks the conversation and asks again (at most 3 times);
        a refused tool_choice asks again with "auto", a rejected thinking mode without one, and so does every
        later request."""
        shrinks = 0
        while True:
            try:
                with self.result.timed("model_s"):
                    return self.model.complete(self.conversation.messages, tools=self.schemas, tool_choice=choice,
                                               thinking_mode=mode if self.thinking else None, max_tokens=self.max_tokens)
            except ToolChoiceRefused as e:
                self.forcing, choice = False, "auto"
                self.emit("tool_choice_fallback", message=str(e), tool_choice=choice)
            except ThinkingRejected as e:
                self.thinking = False
                self.emit("thinking_dropped", message=str(e))
            except ContextOverflowError as e:
                self.emit("context_overflow", message=str(e), input_tokens=e.input_tokens, limit=e.limit)
                if not shrinks and self._ran_on(e):
                    return ModelReply(finish_reason="length")  # re-prompted as a reply cut off at max_tokens
                shrinks += 1
                if shrinks > 3 or not self._shrink(e, shrinks):
                    raise self._outgrown(e, shrinks) from None
                self.stall.record_condensation(self.state.turn)

    def _ran_on(self, e: ContextOverflowError) -> bool:
        """Whether an overflow is the reply running on, not the prompt: llama-cpp-python's tool-call handler
        generates a call's arguments without `max_tokens`, to the window's end, then fails its next step with a
        context-length error that counts what it generated "in the messages". Such an error's prompt fills the
        window (a few tokens over at most) while the estimate of what was sent is far below it. Shrinking would
        not help, a shorter reply would. Not twice in a row: a second one is taken at its word, in case the
        estimate is wrong."""
        if e.input_tokens is None or e.limit is None or not 0 <= e.input_tokens - e.limit <= 64:
            return False
        if self.ran_on_turn == self.state.turn - 1 and self.ran_on_turn:
            return False
        sent = EstimateCounter().count(json.dumps([self.conversation.messages, self.schemas]))
        if sent >= 0.75 * e.input_tokens:
            return False
        self.ran_on_turn = self.state.turn
        self.emit("ran_on", input_tokens=e.input_tokens, limit=e.limit, sent_estimate=sent)
        return True

    def _shrink(self, e: ContextOverflowError, attempt: int) -> bool:
        """Make the conversation fit after a context overflow: take a smaller window the error names (and
        its reply budget), elide old tool outputs, then repack smaller."""
        if e.limit is not None and (self.window is None or e.limit < self.window):
            self._set_window(e.limit)
            self.emit("context_window", context_window=self.window, window_source="error", max_tokens=self.max_tokens)
        if self.conversation.elide() and attempt == 1:  # the latest two results stay intact
            return True
        target = self.budget if self.budget is not None else self.result.pack_tokens
        if e.input_tokens is not None and e.limit is not None:  # the prompt alone, and the room it must leave
            target -= max(e.input_tokens + self.max_tokens - e.limit, 0)
        if self.window:
            target = min(target, self._budget(configured=False))
        new_budget = int(max(target, 0) * 0.8)
        if new_budget <= 0:
            return False
        self.budget = new_budget
        try:
            packed = self._packed(new_budget)
        except UsageError:  # the packer: not even the repository's header and tree fit that budget
            return False
        self.conversation.repack(packed.text, new_budget)
        return True

    def _outgrown(self, e: ContextOverflowError, shrinks: int) -> LimitsExceeded:
        """The end of a run whose conversation no longer fits the window however it shrinks: a limit that
        names the window, not the packer's or the server's words alone."""
        window = f"the model's {self.window:,}-token window" if self.window else "the model's context window"
        packed = f", the repository packed down to a {self.budget:,}-token budget" if self.budget else ""
        tried = "after 3 shrinks" if shrinks > 3 else f"with old tool outputs elided{packed}"
        return LimitsExceeded(f"the conversation no longer fits {window} ({tried}; the server said: "
                              f"{' '.join(str(e).split())[:200]})", status="context_limit")

    def _read_text_call(self, reply: ModelReply) -> ModelReply:
        """A tool call the model wrote as text becomes the reply's call, its reading named as a repair."""
        found = read_text_call(reply.content, [t.name for t in self.tools])
        if found is None:
            return reply
        call = ToolCall(id=f"text-call-{self.state.turn}", name=found.name, arguments=found.arguments, repair=found.repair)
        self.emit("text_tool_call", name=call.name, arguments=call.arguments, repair=call.repair)
        return reply.model_copy(update={"tool_calls": [call]})

    def _answer_without_tools(self, reply: ModelReply) -> None:
        """A reply without tool calls ends the run if the last test run saw the current change and passed;
        any other (a cut-off one too) is re-prompted, counted like a format error."""
        self.stall.record(Step(turn=self.state.turn, tool=None, args=None, output=reply.content))
        cut = reply.finish_reason == "length"
        if not cut and self.tests.passed_on(self._final_patch()):
            self.result.final_message = reply.content
            raise Finished()
        state = self.state
        state.format_errors_in_row += 1
        if state.format_errors_in_row >= self.cfg.limits.max_format_errors:
            said = " ".join((reply.content or "").split())  # what the model said: a stand-in out of script says so
            said = said if len(said) <= 200 else said[:199] + "…"
            last = "cut off at max_tokens" if cut else "without a tool call" + (f", saying: {said}" if said else "")
            raise FormatError(f"{state.format_errors_in_row} turns in a row without a well-formed tool call "
                              f"(the last reply {last})")
        self.tool_choice = "required" if self.forcing else "auto"
        self.emit("reprompt", reason="cut_off" if cut else "no_tool_call", format_errors=state.format_errors_in_row,
                  tool_choice=self.tool_choice)
        self.conversation.say("cut_off" if cut else "reprompt", tools=", ".join(t.name for t in self.tools))

    def _run_tools(self, reply: ModelReply) -> list[ToolResult]:
        truncated = reply.finish_reason == "length"
        results = []
        for call in reply.tool_calls:
            self.emit("tool_call", id=call.id, name=call.name, arguments=call.arguments)
            t = time.monotonic()
            with self.result.timed("tools_s"):
                result = self._call(call, truncated)
            took = time.monotonic() - t
            output = head_tail(result.output, self.cfg.output_cap_chars)
            self.conversation.add({"role": "tool", "tool_call_id": call.id, "content": output})
            self.emit("tool_result", id=call.id, name=call.name, ok=result.ok, error_kind=result.error_kind,
                      data=result.data, changed_files=result.changed_files,  # the output: the `message` before
                      tests=result.tests.model_dump() if result.tests else None, duration_s=round(took, 4))
            self.stall.record(_step_of(self.state.turn, call.name, call.arguments, result, output))
            if result.tests is not None:  # a test run: remember the workspace it saw (diffed by _call)
                self.tests.saw(call.name, call.arguments, result.tests.model_dump(), self.state.turn,
                               self.recovery.last_diff)
            results.append(result)
            if result.submitted:
                break
        return results

    def _call(self, call: ToolCall, truncated: bool) -> ToolResult:
        """One tool call in the environment, then its diff (the last known workspace); a death restarts it.

        No diff after a call that only read files or never reached the environment: it changed nothing.
        """
        watched = Watched(self.env)
        try:
            result = execute_call(call.name, call.arguments, self.tools, watched, truncated=truncated,
                                  repairs=[call.repair] if call.repair else None)
            # A test run's workspace decides the verdict; any other is kept only for a restart.
            if watched.touched and (self.recovery.limit or result.tests is not None):
                self.recovery.last_diff = self.env.diff()
            return result
        except SandboxDied as died:
            return self._restart(died)

    def _final_patch(self) -> str:
        """The final workspace's diff; a sandbox that died after the last tool call is replaced first."""
        try:
            return self.env.diff()
        except SandboxDied as died:
            self._restart(died)  # SandboxLost past the limit
            return self.env.diff()

    def _restart(self, died: SandboxDied) -> ToolResult:
        """Replace the dead environment (base commit + the last diff); the result tells the model so."""
        reason, patch = reason_of(self.env, died), self.recovery.last_diff
        self.result.patch = self.recovery.kept  # if no environment can be started any more
        try:
            self.env = self.recovery.replace(self.env, reason, self.agent.env_factory, self.repo)
        except SandboxLostError as e:
            raise SandboxLost(str(e)) from None
        n = self.result.sandbox_restarts = self.recovery.restarts
        self.emit("sandbox_restart", reason=reason, restored_diff_bytes=len(patch.encode()),
                  restored_files=patch.count("diff --git "), restarts=n)
        return ToolResult(output=notice(self.cfg.prompts.restart, reason, patch, n, self.recovery.limit), ok=False, error_kind="execution",
                          data={"sandbox_restart": n, "reason": reason})

    def _observe(self, reply: ModelReply, results: list[ToolResult]) -> None:
        """Carry what the tool calls showed into the loop state; end the run on submit or too many format errors."""
        state = self.state
        all_malformed = all(r.error_kind in FORMAT_ERROR_KINDS for r in results)
        state.format_errors_in_row = state.format_errors_in_row + 1 if all_malformed else 0
        state.last_tools = [c.name for c in reply.tool_calls]
        state.last_tool_errors = sum(not r.ok for r in results)
        tests = [r.tests for r in results if r.tests is not None]
        state.last_tests_failed = bool(tests[-1].failed or tests[-1].errors) if tests else None
        state.last_edit_ok = any(r.ok and r.changed_files for r in results)
        submitted = next((r for r in results if r.submitted), None)
        if submitted is not None:
            self.result.final_message = submitted.output
            raise Submitted()
        if state.format_errors_in_row >= self.cfg.limits.max_format_errors:
            raise FormatError(unusable_calls(state.format_errors_in_row, reply, results, self.tools))

    def _check_stall(self) -> None:
        """Nudge the model at the first stall; end the run at the next one."""
        self.stall.end_turn(self.state.turn)
        stall = self.stall.check()
        if stall is None:
            return
        self.result.stalls.append(stall)
        nudged = len(self.result.stalls) > 1  # the first stall was nudged
        self.emit("stall", rule=stall.rule, evidence=stall.evidence, nudged=nudged)
        if nudged:
            raise Stalled(f"stalled: {stall.rule}: {stall.evidence}")
        self.state.stalled = True
        self.conversation.say("nudge", rule=stall.rule, evidence=stall.evidence, advice=self.cfg.prompts.advice(stall.rule))
        self.stall.user_message()

    # ----- the end --------------------------------------------------------------------------------
    def _verify(self, end: RunEnded) -> None:
        """Decide on the final workspace (`agent.verdict`): tests that ran after the last change, or none."""
        if end.status not in ("submitted", "finished") or not self.result.patch.strip():
            verdict = unverified(f"not verified: the run ended {end.status}"
                                 + ("" if self.result.patch.strip() else " without a change"))
        else:
            with self.result.timed("tools_s"):
                verdict = self._decide()
        self.result.verdict = verdict
        self.result.final_tests = verdict.tests if verdict.after_last_change else None
        self.emit("verify", **verdict.model_dump())

    def _decide(self) -> Verdict:
        """`decide` in the current environment; one that dies under the verdict's test run is replaced
        (final patch restored, within the run's restart budget) and the run is decided there."""
        patch = self.result.patch
        while True:
            try:
                return decide(self.tests, patch, self.env, self.tools, self.cfg.test_cmd)
            except SandboxDied as died:
                self.recovery.last_diff = patch  # the final workspace is the state to restore
                try:
                    self._restart(died)
                except SandboxLost as lost:
                    return unverified(f"not verified: the sandbox died under the verdict's test run: {lost}")
                finally:
                    self.result.patch = patch  # known whatever the restart did: the run keeps it

    def finish(self, status: RunStatus, *, error: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        r = self.result
        r.status, r.error, r.turns = status, error, self.state.turn
        r.close(self.cfg.limits)
        self.emit("finish", status=status, error=error, turns=r.turns, usage=r.usage.model_dump(),
                  cache_hit_share=r.cache_hit_share, mode_counts=r.mode_counts,
                  stalls=[s.model_dump() for s in r.stalls], sandbox_restarts=r.sandbox_restarts,
                  timings=r.timings.model_dump(),
                  cost_usd=r.cost_usd, patch=r.patch, final_tests=r.final_tests,
                  verdict=r.verdict.model_dump() if r.verdict else None)

    def close(self) -> None:
        if self.owns_model:
            self.model.close()


def _step_of(turn: int, name: str, arguments: str | None, result: ToolResult, output: str) -> Step:
    """What the stall detector keeps of one tool call."""
    return Step(
        turn=turn, tool=name, args=_parsed(arguments), output=output, error=not result.ok,
        exit_code=result.data.get("exit_code"), running=result.running, changed_files=list(result.changed_files),
        failing_tests=[f.id for f in result.tests.failing] if result.tests is not None else None,
    )


def _parsed(arguments: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments or "")
    except (json.JSONDecodeError, TypeError):
        return None
    return value if isinstance(value, dict) else None
