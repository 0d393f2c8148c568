import pytest

from roman import to_roman


def test_simple():
    assert to_roman(3) == "III"
    assert to_roman(2000) == "MM"


def test_additive():
    assert to_roman(1666) == "MDCLXVI"


def test_range():
    with pytest.raises(ValueError):
        to_roman(0)
