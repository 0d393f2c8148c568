"""Prices, discounts and totals."""


def apply_discount(price: float, percent: float) -> float:
    """Return `price` reduced by `percent` percent, rounded to cents."""
    if not 0 <= percent <= 100:
        raise ValueError(f"percent must be between 0 and 100, got {percent}")
    return round(price * percent / 100, 2)


def order_total(lines: list[tuple[float, int]], discount_percent: float = 0) -> float:
    """Sum of price x quantity over the order lines, with an optional discount."""
    subtotal = sum(price * qty for price, qty in lines)
    return apply_discount(subtotal, discount_percent)
