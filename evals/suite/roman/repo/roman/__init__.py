"""Roman numerals."""

_VALUES = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


def to_roman(n: int) -> str:
    """Return the Roman numeral for 1 <= n <= 3999."""
    if not 0 < n < 4000:
        raise ValueError("out of range")
    out = []
    for value, symbol in _VALUES:
        count, n = divmod(n, value)
        out.append(symbol * count)
    return "".join(out)
