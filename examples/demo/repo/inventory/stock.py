"""Stock levels."""


class Stock:
    """Quantities on hand, by SKU."""

    def __init__(self) -> None:
        self._levels: dict[str, int] = {}

    def add(self, sku: str, qty: int) -> None:
        if qty < 0:
            raise ValueError("qty must be positive")
        self._levels[sku] = self._levels.get(sku, 0) + qty

    def remove(self, sku: str, qty: int) -> None:
        have = self._levels.get(sku, 0)
        if qty > have:
            raise ValueError(f"only {have} of {sku} in stock")
        self._levels[sku] = have - qty

    def level(self, sku: str) -> int:
        return self._levels.get(sku, 0)
