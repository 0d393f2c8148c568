import pytest

from lru import LRUCache


def test_put_get():
    c = LRUCache(2)
    c.put("a", 1)
    assert c.get("a") == 1
    assert c.get("zz", 0) == 0


def test_evicts_oldest():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.put("c", 3)
    assert c.get("a") is None
    assert len(c) == 2


def test_bad_capacity():
    with pytest.raises(ValueError):
        LRUCache(0)
