"""file_edit's matching logic (the sandbox round trip is in test_sandbox_tools.py)."""

from m3_agent.tools.file_edit import line_of, not_found_hint, occurrences

TEXT = "def f():\n    return 1\n\n\ndef g():\n    return 1\n"


def test_occurrences_are_non_overlapping_like_replace():
    assert occurrences("aaaa", "aa") == [0, 2]
    first = TEXT.index("return 1")
    assert occurrences(TEXT, "return 1") == [first, TEXT.index("return 1", first + 1)]
    assert [line_of(TEXT, i) for i in occurrences(TEXT, "return 1")] == [2, 6]


def test_hint_points_at_same_line_with_other_indentation():
    hint = not_found_hint(TEXT, "def g():\n  return 1")
    assert "line 5" in hint and "indentation" in hint


def test_hint_points_at_the_closest_line():
    hint = not_found_hint(TEXT, "def gg(x):")
    assert "closest line is 5" in hint and "'def g():'" in hint


def test_hint_when_nothing_is_similar():
    assert "Nothing similar" in not_found_hint(TEXT, "class Zebra(Animal): pass")
