"""How long output is shortened on the host: keep the head and the tail, say how much was left out.

One function for every host-side cut on a command's path (each stream of a command, the tool
message the model reads). The in-container exec server caps bytes on its own (see server.py).
"""

from __future__ import annotations


def head_tail(text: str, limit: int) -> str:
    """`text` if at most `limit` characters, else its head and tail around a marker giving the count cut."""
    if len(text) <= limit:
        return text
    half = max(limit, 2) // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters left out by m3-agent ...]\n{text[-half:]}"
