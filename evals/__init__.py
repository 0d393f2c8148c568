"""SWE-style evaluation: tasks, runner, grading, reports."""
