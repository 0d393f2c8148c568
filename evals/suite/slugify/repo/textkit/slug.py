"""URL slugs."""

import re


def slugify(text: str) -> str:
    """A lower-case slug of text: letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]", "-", text.lower())
