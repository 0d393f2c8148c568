"""Formatting of dates."""


def iso(year: int, month: int, day: int) -> str:
    """YYYY-MM-DD."""
    return f"{year:04d}-{month:02d}-{day:02d}"
