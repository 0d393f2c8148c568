import pytest

from semver import is_newer, parse


def test_parse_rejects_short():
    with pytest.raises(ValueError):
        parse("1.2")


def test_newer_patch():
    assert is_newer("1.2.4", "1.2.3")


def test_not_newer_when_equal():
    assert not is_newer("2.0.0", "2.0.0")
