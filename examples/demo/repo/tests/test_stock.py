import pytest

from inventory.stock import Stock


def test_add_and_remove():
    s = Stock()
    s.add("A1", 5)
    s.remove("A1", 2)
    assert s.level("A1") == 3


def test_cannot_remove_more_than_stock():
    s = Stock()
    s.add("A1", 1)
    with pytest.raises(ValueError):
        s.remove("A1", 2)
