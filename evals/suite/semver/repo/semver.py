"""Tiny semantic-version helpers."""


def parse(version: str) -> tuple:
    """Split "1.2.3" into its components."""
    parts = version.strip().split(".")
    if len(parts) != 3:
        raise ValueError(f"not a version: {version!r}")
    return tuple(parts)


def is_newer(a: str, b: str) -> bool:
    """True when version a is strictly newer than b."""
    return parse(a) > parse(b)
