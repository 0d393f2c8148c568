import pytest

from calutil.dates import days_in_month, is_leap


def test_ordinary_leap():
    assert is_leap(2024)
    assert not is_leap(2023)


def test_february():
    assert days_in_month(2024, 2) == 29
    assert days_in_month(2023, 2) == 28


@pytest.mark.parametrize("month", [0, 13])
def test_bad_month(month):
    with pytest.raises(ValueError):
        days_in_month(2024, month)
