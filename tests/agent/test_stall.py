"""Stall detection: each rule firing and its near-misses, volatile-text normalisation, the window."""

from __future__ import annotations

import json

import pydantic
import pytest

from m3_agent.agent.stall import Stall, StallConfig, StallDetector, Step, normalize


def pytest_output(*, seconds: str = "0.03", tmp: str = "tmpk3j2h1ab", addr: str = "0x7f3a2c1d9e50",
                  pid: int = 4312, failing: tuple[str, ...] = ("test_add",)) -> str:
    """A realistic `pytest -q` failure report; callers vary only the volatile parts or the failures."""
    blocks = []
    for name in failing:
        blocks.append(
            f"___________________________________ {name} ___________________________________\n\n"
            f"    def {name}():\n"
            f">       assert add(Box(1), 2) == 3\n"
            f"E       assert <calc.Box object at {addr}> == 3\n\n"
            f"/tmp/{tmp}/repo/tests/test_calc.py:7: AssertionError\n"
            f"----------------------------- Captured stdout call -----------------------------\n"
            f"worker pid {pid} started at 2026-11-22T00:08:{int(float(seconds) * 100) % 60:02d}Z\n"
        )
    summary = " ".join(f"FAILED tests/test_calc.py::{n} - AssertionError" for n in failing)
    return (
        "F." * len(failing) + "                                                   [100%]\n"
        "=================================== FAILURES ===================================\n"
        + "".join(blocks)
        + "=========================== short test summary info ============================\n"
        + summary + "\n"
        + f"{len(failing)} failed, 1 passed in {seconds}s\n"
    )


def run_tests(turn: int, output: str, failing: list[str], *, exit_code: int = 1) -> Step:
    return Step(turn=turn, tool="test_runner", args={"path": "tests"}, output=output,
                exit_code=exit_code, error=exit_code != 0, failing_tests=failing)


def edit(turn: int, text: str, path: str = "calc.py") -> Step:
    return Step(turn=turn, tool="file_write", args={"path": path, "content": text},
                output=f"wrote {len(text)} bytes to {path}", changed_files=[path])


def say(turn: int, text: str) -> Step:
    return Step(turn=turn, tool=None, args=None, output=text)


def feed(detector: StallDetector, steps: list[Step]) -> Stall | None:
    """Record each step as its own turn, as the loop does, and return the last check()."""
    stall = None
    for step in steps:
        detector.record(step)
        detector.end_turn(step.turn)
        stall = detector.check()
    return stall


# ----- normalize ---------------------------------------------------------------------------------

def test_normalize_equates_pytest_runs_differing_only_in_volatile_text():
    a = pytest_output(seconds="0.03", tmp="tmpk3j2h1ab", addr="0x7f3a2c1d9e50", pid=4312)
    b = pytest_output(seconds="10.57", tmp="tmpz9q8w7xy", addr="0x55d1e0a4b3c0", pid=977)
    assert a != b
    assert normalize(a) == normalize(b)


def test_normalize_keeps_what_matters():
    base = pytest_output(failing=("test_add",))
    assert normalize(base) != normalize(pytest_output(failing=("test_sub",)))
    # Line numbers in locations and parametrize ids are meaningful, not volatile.
    assert normalize("calc.py:12:5: E501") != normalize("calc.py:13:5: E501")
    assert normalize("test_x[1] FAILED") != normalize("test_x[2] FAILED")
    assert normalize("assert 0x10 == 16") == "assert 0x10 == 16"


@pytest.mark.parametrize("a, b", [
    ("1 failed in 0.03s", "1 failed in 0.05s"),
    ("took 12 ms", "took 873 ms"),
    ("elapsed 1.5 seconds", "elapsed 22 seconds"),
    ("real\t0m1.234s", "real\t0m0.981s"),
    ("Killed process 1234 (python3)", "Killed process 98765 (python3)"),
    ("[1] 4242", "[1] 17"),
    ("<Foo object at 0x7f3a2c1d9e50>", "<Foo object at 0x55d1e0a4b3c0>"),
    ("rootdir: /tmp/tmpabc123/repo", "rootdir: /tmp/tmpq9z8x7/repo"),
    ("/tmp/pytest-of-root/pytest-12/test_io0/out.txt", "/tmp/pytest-of-sam/pytest-3/test_io0/out.txt"),
    ("/private/var/folders/xy/k2j3h4/T/tmpq1w2e3/a.py", "/var/folders/ab/zz9/T/tmpr4t5y6/a.py"),
    ('File "/tmp/m3-agent-tools/3f9a1c2b7d4e.py", line 3', 'File "/tmp/m3-agent-tools/0b1c2d3e4f5a.py", line 3'),
    ("/tmp/tmpk3j2h1ab/build/a1b2c3d4e5/x.o", "/tmp/tmpz9y8x7w6/build/f9e8d7c6b5/x.o"),
    ("2026-11-22T00:08:56.123Z start", "2026-11-23T17:41:02.999Z start"),
    ("Sun Nov 22 00:08:56 UTC 2026", "Mon Nov 23 13:00:01 UTC 2026"),
    ("listening on 127.0.0.1:54321", "listening on 127.0.0.1:40017"),
    ("bound to port 8123", "bound to port 9001"),
    ("peak RSS 12.3 MiB", "peak RSS 140 MiB"),
    ("read 1024 bytes", "read 77 bytes"),
    ("Using --randomly-seed=12345", "Using --randomly-seed=987"),
    ("id 123e4567-e89b-12d3-a456-426614174000", "id 9b2c1f00-0000-4000-8000-00000000abcd"),
    ("==== 1 failed in 0.03s ====", "=== 1 failed in 10.03s ==="),
])
def test_normalize_removes_volatile_text(a, b):
    assert normalize(a) == normalize(b)


@pytest.mark.parametrize("a, b", [
    ("1 failed in 0.03s", "2 failed in 0.03s"),
    ("/tmp/tmpabc123/repo/a.py", "/tmp/tmpabc123/repo/b.py"),
    ("/tmp/m3-agent-tools/run.py", "/tmp/m3-agent-tools/build.py"),
    ('File "/tmp/x.py", line 3', 'File "/tmp/x.py", line 4'),
    ("exit status 1", "exit status 2"),
    ("AssertionError: 3 != 4", "AssertionError: 3 != 5"),
])
def test_normalize_does_not_equate_different_results(a, b):
    assert normalize(a) != normalize(b)


# ----- rule: same failing tests (seed 001) -------------------------------------------------------

def test_same_failing_tests_across_three_runs_is_a_stall_despite_edits_and_volatile_output():
    d = StallDetector(StallConfig(no_change_turns=0))
    fails = ["tests/test_calc.py::test_add"]
    steps = [
        edit(1, "v1"), run_tests(2, pytest_output(seconds="0.03", pid=11), fails),
        edit(3, "v2"), run_tests(4, pytest_output(seconds="0.05", tmp="tmpq1w2e3r4", pid=12), fails),
        edit(5, "v3"),
    ]
    assert feed(d, steps) is None
    stall = feed(d, [run_tests(6, pytest_output(seconds="0.04", addr="0x55d1e0a4b3c0", pid=13), fails)])
    assert stall is not None
    assert stall.rule == "same_failing_tests"
    assert stall.turn == 6
    assert "test_add" in stall.evidence and "3 test runs" in stall.evidence and "2, 4, 6" in stall.evidence


def test_changing_failures_or_passing_runs_are_not_a_stall():
    d = StallDetector(StallConfig(no_change_turns=0))
    steps = [
        run_tests(1, pytest_output(failing=("test_add", "test_sub")), ["t::test_add", "t::test_sub"]),
        edit(2, "v1"),
        run_tests(3, pytest_output(failing=("test_add",)), ["t::test_add"]),
        edit(4, "v2"),
        run_tests(5, pytest_output(failing=("test_add",)), ["t::test_add"]),
    ]
    assert feed(d, steps) is None  # progress: only two runs share the same set
    passing = [run_tests(t, "3 passed in 0.02s", [], exit_code=0) for t in (6, 8, 10)]
    d2 = StallDetector(StallConfig(no_change_turns=0))
    assert feed(d2, [passing[0], edit(7, "a"), passing[1], edit(9, "b"), passing[2]]) is None


def test_same_failing_tests_threshold_is_configurable():
    fails = ["t::test_add"]
    runs = [run_tests(t, pytest_output(seconds=f"0.0{t}"), fails) for t in (1, 3)]
    d = StallDetector(StallConfig(same_failures_runs=2, no_change_turns=0))
    assert feed(d, [runs[0], edit(2, "x"), runs[1]]).rule == "same_failing_tests"
    d = StallDetector(StallConfig(same_failures_runs=0, no_change_turns=0))
    more = [run_tests(t, pytest_output(), fails) for t in (5, 7, 9, 11)]
    assert feed(d, [runs[0], edit(2, "x"), runs[1], edit(4, "y"), more[0], edit(6, "z"), more[1]]) is None


def test_failing_test_ids_compare_normalized():
    d = StallDetector(StallConfig(no_change_turns=0, same_failures_runs=2))
    a = run_tests(1, "1 failed", ["t.py::test_obj[<Obj at 0x7f00aa11bb22>]"])
    b = run_tests(3, "1 failed", ["t.py::test_obj[<Obj at 0x7f00cc33dd44>]"])
    assert feed(d, [a, edit(2, "x"), b]).rule == "same_failing_tests"


# ----- rule 1: repeated action -------------------------------------------------------------------

def cat(turn: int, output: str = "def add(a, b):\n    return a - b\n", **kw) -> Step:
    return Step(turn=turn, tool="file_read", args={"path": "calc.py"}, output=output, **kw)


def test_four_equal_actions_with_equal_observations_stall():
    d = StallDetector(StallConfig(no_change_turns=0))
    assert feed(d, [cat(1), cat(2), cat(3)]) is None
    stall = feed(d, [cat(4)])
    assert stall.rule == "repeated_action"
    assert "file_read" in stall.evidence and "4 times" in stall.evidence and "1, 2, 3, 4" in stall.evidence


def test_repeated_action_compares_canonical_args_and_normalized_output():
    d = StallDetector(StallConfig(no_change_turns=0))
    steps = [
        Step(turn=t, tool="bash", args=args, output=f"listening on 127.0.0.1:{port}\ndone in {ms} ms", exit_code=0)
        for t, args, port, ms in [
            (1, {"command": "python serve.py", "timeout": 30}, 40001, 12),
            (2, {"timeout": 30, "command": "python serve.py"}, 40107, 15),
            (3, {"command": "python serve.py", "timeout": 30}, 51234, 9),
            (4, {"timeout": 30, "command": "python serve.py"}, 40555, 31),
        ]
    ]
    assert feed(d, steps).rule == "repeated_action"


def test_repeated_action_near_misses():
    d = StallDetector(StallConfig(no_change_turns=0))
    # Same action, but the file changed between reads: the observation differs.
    assert feed(d, [cat(1), cat(2), cat(3), cat(4, output="def add(a, b):\n    return a + b\n")]) is None
    d = StallDetector(StallConfig(no_change_turns=0))
    # Same output, different exit code.
    assert feed(d, [cat(1), cat(2), cat(3), cat(4, exit_code=1)]) is None
    d = StallDetector(StallConfig(no_change_turns=0))
    # A different action in between breaks the run.
    other = Step(turn=3, tool="file_read", args={"path": "tests/test_calc.py"}, output="...")
    assert feed(d, [cat(1), cat(2), other, cat(4), cat(5)]) is None


def test_changing_thought_text_does_not_hide_a_repeated_action():
    d = StallDetector(StallConfig(no_change_turns=0))
    stall = None
    for t, thought in enumerate(["Let me look at calc.py.", "I should check calc.py again.",
                                 "Maybe the bug is in calc.py?", "Reading calc.py once more."], start=1):
        # Even a loop that records each turn's thought as a message step: actions are compared, not thoughts.
        d.record(say(t, thought))
        d.record(cat(t))
        d.end_turn(t)
        stall = d.check()
    assert stall is not None and stall.rule == "repeated_action"


def test_several_tool_calls_in_one_turn_count_as_separate_actions():
    d = StallDetector(StallConfig(no_change_turns=0))
    d.record(cat(1))
    d.record(cat(1))
    d.end_turn(1)
    assert d.check() is None
    d.record(cat(2))
    d.record(cat(2))
    d.end_turn(2)
    assert d.check().rule == "repeated_action"


# ----- rule 2: repeated error --------------------------------------------------------------------

def test_three_equal_failing_actions_stall_even_with_different_errors():
    d = StallDetector(StallConfig(no_change_turns=0))
    cmd = {"command": "python -m build"}
    steps = [Step(turn=t, tool="bash", args=cmd, output=f"error {t}: missing module x{t}", exit_code=1)
             for t in (1, 2, 3)]
    stall = feed(d, steps)
    assert stall.rule == "repeated_error"
    assert "failed 3 times" in stall.evidence


def test_tool_error_flag_counts_as_error():
    d = StallDetector(StallConfig(no_change_turns=0))
    steps = [Step(turn=t, tool="file_edit", args={"path": "a.py", "old": "x", "new": "y"},
                  output=f"'x' not found in a.py (attempt {t})", error=True) for t in (1, 2, 3)]
    assert feed(d, steps).rule == "repeated_error"


def test_repeated_error_near_misses():
    cmd = {"command": "make"}
    d = StallDetector(StallConfig(no_change_turns=0))
    # One of the three succeeded.
    steps = [Step(turn=1, tool="bash", args=cmd, output="e1", exit_code=2),
             Step(turn=2, tool="bash", args=cmd, output="ok", exit_code=0),
             Step(turn=3, tool="bash", args=cmd, output="e3", exit_code=2)]
    assert feed(d, steps) is None
    d = StallDetector(StallConfig(no_change_turns=0))
    # Three failures, but of different commands.
    steps = [Step(turn=t, tool="bash", args={"command": f"make t{t}"}, output="e", exit_code=2) for t in (1, 2, 3)]
    assert feed(d, steps) is None


# ----- rule 3: monologue -------------------------------------------------------------------------

def test_three_identical_messages_in_a_row_stall():
    d = StallDetector(StallConfig(no_change_turns=0))
    assert feed(d, [say(1, "I will now fix the bug."), say(2, "I will now fix the bug.")]) is None
    stall = feed(d, [say(3, "I will now fix the bug.  ")])
    assert stall.rule == "monologue"
    assert "I will now fix the bug." in stall.evidence


def test_monologue_near_misses():
    d = StallDetector(StallConfig(no_change_turns=0))
    assert feed(d, [say(1, "a"), say(2, "a"), say(3, "b")]) is None
    d = StallDetector(StallConfig(no_change_turns=0))
    # A tool call between the messages: not a monologue.
    assert feed(d, [say(1, "a"), say(2, "a"), cat(3), say(4, "a")]) is None


# ----- rule 4: alternation -----------------------------------------------------------------------

def test_alternating_two_actions_with_same_results_stall():
    d = StallDetector(StallConfig(no_change_turns=0, same_failures_runs=0))
    a = cat
    b = lambda t: run_tests(t, pytest_output(seconds=f"0.{t}"), ["t::test_add"])  # noqa: E731
    assert feed(d, [a(1), b(2), a(3), b(4), a(5)]) is None
    stall = feed(d, [b(6)])
    assert stall.rule == "alternation"
    assert "file_read" in stall.evidence and "test_runner" in stall.evidence


def test_alternation_near_misses():
    d = StallDetector(StallConfig(no_change_turns=0, same_failures_runs=0))
    b = lambda t, out="1 failed": run_tests(t, out, ["t::x"])  # noqa: E731
    # The last action breaks the pattern.
    other = Step(turn=6, tool="file_read", args={"path": "other.py"}, output="x")
    assert feed(d, [cat(1), b(2), cat(3), b(4), cat(5), other]) is None
    d = StallDetector(StallConfig(no_change_turns=0, same_failures_runs=0))
    # Observations change between the repeats: the agent is learning something.
    assert feed(d, [cat(1), b(2), cat(3), b(4, "2 failed"), cat(5), b(6)]) is None


def test_alternation_threshold_is_configurable():
    d = StallDetector(StallConfig(alternation=4, no_change_turns=0, same_failures_runs=0))
    b = lambda t: run_tests(t, "1 failed", ["t::x"])  # noqa: E731
    assert feed(d, [cat(1), b(2), cat(3), b(4)]).rule == "alternation"


# ----- rule 5: condensation ----------------------------------------------------------------------

def test_ten_condensations_in_a_row_stall_and_a_step_resets_the_count():
    d = StallDetector(StallConfig(no_change_turns=0))
    for _ in range(9):
        d.record_condensation(3)
    assert d.check() is None
    d.record(cat(3))
    d.record_condensation(4)
    assert d.check() is None
    for _ in range(9):
        d.record_condensation(4)
    stall = d.check()
    assert stall.rule == "condensation" and "10 times" in stall.evidence and stall.turn == 4


# ----- rule: no file change ----------------------------------------------------------------------

def test_no_file_change_in_k_turns_stalls():
    d = StallDetector(StallConfig(no_change_turns=3))
    reads = [Step(turn=t, tool="file_read", args={"path": f"m{t}.py"}, output=f"x{t}") for t in (1, 2)]
    assert feed(d, reads) is None
    stall = feed(d, [Step(turn=3, tool="file_read", args={"path": "m3.py"}, output="x3")])
    assert stall.rule == "no_file_change"
    assert "3 turns" in stall.evidence and "1-3" in stall.evidence


def test_a_file_change_resets_the_no_change_count():
    d = StallDetector(StallConfig(no_change_turns=3))
    reads = lambda ts: [Step(turn=t, tool="file_read", args={"path": f"m{t}.py"}, output=str(t)) for t in ts]  # noqa: E731
    assert feed(d, reads([1, 2]) + [edit(3, "v")] + reads([4, 5])) is None
    assert feed(d, reads([6])).rule == "no_file_change"


def test_no_file_change_can_be_switched_off():
    for off in (0, None):
        d = StallDetector(StallConfig(no_change_turns=off))
        steps = [Step(turn=t, tool="file_read", args={"path": f"m{t}.py"}, output=str(t)) for t in range(1, 30)]
        assert feed(d, steps) is None


def test_end_turn_is_idempotent():
    d = StallDetector(StallConfig(no_change_turns=2))
    d.record(cat(1))
    for _ in range(5):
        d.end_turn(1)
    assert d.check() is None


# ----- running commands --------------------------------------------------------------------------

def poll(turn: int) -> Step:
    return Step(turn=turn, tool="bash", args={"command": "tail -n 1 build.log"},
                output="still running (pid 4242, 3.1 MiB written)", running=True)


def test_a_long_running_command_is_never_a_stall():
    d = StallDetector(StallConfig(no_change_turns=3))
    # Twelve identical polls of a command that is still running: no rule may count them.
    assert feed(d, [poll(t) for t in range(1, 13)]) is None


def test_running_steps_neither_count_nor_break_a_repeat():
    d = StallDetector(StallConfig(no_change_turns=0))
    assert feed(d, [cat(1), cat(2), poll(3), cat(4)]) is None
    assert feed(d, [cat(5)]).rule == "repeated_action"


def test_running_turns_do_not_count_toward_no_file_change():
    d = StallDetector(StallConfig(no_change_turns=3))
    r = lambda t: Step(turn=t, tool="file_read", args={"path": f"m{t}.py"}, output=str(t))  # noqa: E731
    assert feed(d, [r(1), r(2), poll(3), poll(4), poll(5)]) is None
    assert feed(d, [r(6)]).rule == "no_file_change"


# ----- switching off, config ---------------------------------------------------------------------

def test_disabled_detector_never_reports():
    d = StallDetector(StallConfig(enabled=False, no_change_turns=1))
    for t in range(1, 12):
        d.record(cat(t))
        d.record(say(t, "same"))
        d.record_condensation(t)
        d.end_turn(t)
    assert d.check() is None


def _fire(rule: str, detector: StallDetector) -> Stall | None:
    """Feed a history that trips `rule` under the default thresholds and return the last check()."""
    fails = ["t::test_add"]
    histories = {
        "repeated_action": [cat(t) for t in range(1, 5)],
        "repeated_error": [Step(turn=t, tool="bash", args={"command": "make"}, output=f"e{t}", exit_code=2)
                           for t in range(1, 4)],
        "monologue": [say(t, "thinking...") for t in range(1, 4)],
        "alternation": [cat(t) if t % 2 else run_tests(t, "1 failed", []) for t in range(1, 7)],
        "same_failing_tests": [edit(t, str(t)) if t % 2 else run_tests(t, f"{t}", fails) for t in range(1, 7)],
        "no_file_change": [Step(turn=t, tool="file_read", args={"path": f"{t}.py"}, output=str(t))
                           for t in range(1, 11)],
    }
    if rule == "condensation":
        for _ in range(10):
            detector.record_condensation(1)
        return detector.check()
    return feed(detector, histories[rule])


RULE_FIELDS = {"repeated_action": "repeat_actions", "repeated_error": "repeat_errors", "monologue": "monologue",
               "alternation": "alternation", "same_failing_tests": "same_failures_runs",
               "condensation": "condensations", "no_change_turns": "no_change_turns"}


@pytest.mark.parametrize("rule", ["repeated_action", "repeated_error", "monologue", "alternation",
                                  "same_failing_tests", "condensation", "no_file_change"])
@pytest.mark.parametrize("off", [0, None])
def test_each_rule_fires_by_default_and_can_be_switched_off(rule, off):
    assert _fire(rule, StallDetector()).rule == rule
    field = RULE_FIELDS.get(rule, "no_change_turns")
    stall = _fire(rule, StallDetector(StallConfig(**{field: off})))
    assert stall is None or stall.rule != rule


def test_repeat_threshold_is_configurable():
    d = StallDetector(StallConfig(repeat_actions=6, repeat_errors=0, alternation=0, no_change_turns=0))
    assert feed(d, [cat(t) for t in range(1, 6)]) is None
    assert feed(d, [cat(6)]).rule == "repeated_action"
    d = StallDetector(StallConfig(repeat_actions=0, no_change_turns=0))
    assert feed(d, [cat(t) for t in range(1, 20)]) is None


@pytest.mark.parametrize("bad", [{"repeat_actions": 1}, {"alternation": 3}, {"monologue": -1},
                                 {"no_such_rule": 3}])
def test_bad_config_is_rejected(bad):
    with pytest.raises(pydantic.ValidationError):
        StallConfig(**bad)


def test_config_validates_from_plain_data():
    cfg = StallConfig.model_validate({"enabled": True, "same_failures_runs": 5, "no_change_turns": None})
    assert cfg.same_failures_runs == 5 and cfg.no_change_turns is None


# ----- window: user message ----------------------------------------------------------------------

def test_user_message_restarts_the_window():
    d = StallDetector(StallConfig(no_change_turns=0))
    stall = feed(d, [cat(t) for t in range(1, 5)])
    assert stall.rule == "repeated_action"
    d.user_message()
    assert d.check() is None
    # Three more equal reads are not enough: the earlier ones are before the window.
    assert feed(d, [cat(t) for t in range(5, 8)]) is None
    assert feed(d, [cat(8)]).rule == "repeated_action"


def test_user_message_restarts_test_runs_and_no_change_count():
    d = StallDetector(StallConfig(no_change_turns=4, same_failures_runs=2))
    fails = ["t::test_add"]
    assert feed(d, [run_tests(1, "1 failed", fails), edit(2, "a")]) is None
    d.user_message()
    assert feed(d, [run_tests(3, "1 failed", fails)]) is None
    assert feed(d, [edit(4, "b"), run_tests(5, "1 failed", fails)]).rule == "same_failing_tests"
    d.user_message()
    reads = [Step(turn=t, tool="file_read", args={"path": f"m{t}.py"}, output=str(t)) for t in (6, 7, 8)]
    assert feed(d, reads) is None
    d.user_message()
    assert feed(d, [Step(turn=9, tool="file_read", args={"path": "n.py"}, output="n")]) is None


def test_persisting_stall_fires_again_after_the_nudge():
    """The loop nudges on the first detection, restarts the window, and stops on the second."""
    d = StallDetector(StallConfig(no_change_turns=0))
    fails = ["tests/test_calc.py::test_add"]
    detections = []
    for t in range(1, 13):
        step = edit(t, f"v{t}") if t % 2 else run_tests(t, pytest_output(seconds=f"0.{t:02d}"), fails)
        stall = feed(d, [step])
        if stall is not None:
            detections.append(stall)
            if len(detections) == 2:
                break
            d.user_message()
    assert [(s.rule, s.turn) for s in detections] == [("same_failing_tests", 6), ("same_failing_tests", 12)]


# ----- with the real agent loop --------------------------------------------------------------------

@pytest.mark.docker
def test_agent_loop_nudges_once_then_stops_a_run_that_keeps_the_same_failure(git_repo, sandbox_image, tmp_path):
    """Real loop, real sandbox, stand-in model over HTTP: each 'fix' leaves the same test failing."""
    from m3_agent.agent.config import AgentConfig, LimitsConfig, ModelConfig
    from m3_agent.agent.loop import Agent
    from m3_agent.standin.server import StandinServer
    from m3_agent.sandbox import SandboxConfig

    repo = git_repo({"calc.py": "def add(a, b):\n    return a - b\n",
                     "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"})
    turns = [{"reasoning": "Read the code first.", "tool_calls": [{"name": "file_read", "arguments": {"path": "calc.py"}}]}]
    for attempt in range(8):
        wrong = f"def add(a, b):\n    return a - b  # attempt {attempt}\n"
        turns.append({"tool_calls": [{"name": "file_write", "arguments": {"path": "calc.py", "content": wrong}}]})
        turns.append({"tool_calls": [{"name": "test_runner", "arguments": {"test_file": "tests"}}]})
    with StandinServer({"turns": turns, "on_exhausted": "final"}) as srv:
        cfg = AgentConfig(model=ModelConfig(base_url=srv.base_url, api_key="x", name="MiniMaxAI/MiniMax-M3"),
                          limits=LimitsConfig(max_turns=30), sandbox=SandboxConfig(image=sandbox_image))
        result = Agent(cfg).run(repo, "add() subtracts", trajectory_path=tmp_path / "traj.jsonl")
        requests = list(srv.requests)

    # Test runs at turns 3, 5, 7 -> nudge; the window restarts; runs at 9, 11, 13 -> stop.
    assert result.status == "stalled"
    assert [(s.rule, s.turn) for s in result.stalls] == [("same_failing_tests", 7), ("same_failing_tests", 13)]
    assert "tests/test_calc.py::test_add" in result.stalls[0].evidence
    nudges = [m["content"] for m in requests[7]["messages"] if m["role"] == "user"]
    assert "Stall detected (same_failing_tests)" in nudges[-1]
    modes = [r["chat_template_kwargs"]["thinking_mode"] for r in requests]
    assert modes[:4] == ["enabled", "disabled", "disabled", "enabled"]  # plan, after read, after edit, after failure
    reasons = [e["mode_reason"] for e in map(json.loads, (tmp_path / "traj.jsonl").read_text().splitlines())
               if e["kind"] == "request"]
    assert modes[7] == "enabled" and reasons[7] == "stall detected"  # the nudge turn, recorded per request
    assert sum(result.mode_counts.values()) == len(requests) == 13
