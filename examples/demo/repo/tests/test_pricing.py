import pytest

from inventory.pricing import apply_discount, order_total


def test_no_discount_keeps_price():
    assert apply_discount(80.0, 0) == 80.0


def test_discount_reduces_price():
    assert apply_discount(80.0, 25) == 60.0


def test_order_total_with_discount():
    assert order_total([(10.0, 3), (5.0, 2)], discount_percent=10) == 36.0


def test_bad_percent_rejected():
    with pytest.raises(ValueError):
        apply_discount(10.0, 120)
