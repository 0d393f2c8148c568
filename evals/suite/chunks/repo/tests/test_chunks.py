import pytest

from chunks import chunked


def test_even():
    assert list(chunked([1, 2, 3, 4], 2)) == [[1, 2], [3, 4]]


def test_bad_size():
    with pytest.raises(ValueError):
        list(chunked([1], 0))


def test_empty():
    assert list(chunked([], 3)) == []
