from textkit.slug import slugify


def test_lower():
    assert slugify("ABC") == "abc"


def test_digits_kept():
    assert slugify("abc123") == "abc123"
