"""Split sequences into chunks."""


def chunked(items, size: int):
    """Yield lists of `size` consecutive items."""
    if size < 1:
        raise ValueError("size must be >= 1")
    items = list(items)
    for i in range(0, len(items) - size + 1, size):
        yield items[i:i + size]
