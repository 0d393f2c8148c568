"""Secrets as they may be shown: masked, never in full.

API keys and tokens reach messages, dry-run commands, logs and JSON. `mask` is the one form a
secret may be shown in (its last four characters at most); `redact` puts that form in place of
every occurrence of given secrets in a text, for output the project does not write itself (an
engine's log lines, a command line).
"""

from __future__ import annotations

from collections.abc import Iterable

# Shorter secrets show no characters at all: four of eight would give half of it away.
SHOWN_FROM_LENGTH = 12


def mask(value: str) -> str:
    """A secret as it may be shown: its last four characters at most."""
    if not value:
        return ""
    return "****" + value[-4:] if len(value) >= SHOWN_FROM_LENGTH else "****"


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """`text` with each of `secrets` (the longest first, so that none hides inside another) masked."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, mask(secret))
    return text
