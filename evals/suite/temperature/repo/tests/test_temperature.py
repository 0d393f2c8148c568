import pytest

from temperature import to_celsius, to_fahrenheit


def test_freezing():
    assert to_fahrenheit(0) == 32
    assert to_celsius(32) == 0


def test_boiling():
    assert to_fahrenheit(100) == 212


def test_absolute_zero():
    with pytest.raises(ValueError):
        to_fahrenheit(-300)


@pytest.mark.skip(reason="kelvin support not written yet")
def test_kelvin():
    assert False
