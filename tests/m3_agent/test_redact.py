"""How a secret may be shown: its last four characters at most, wherever it occurs in a text."""

from __future__ import annotations

from m3_agent.redact import mask, redact


def test_mask_shows_at_most_the_last_four_characters():
    assert mask("") == "" and mask("short-key") == "****"
    assert mask("m3-0123456789abcdefWXYZ") == "****WXYZ"


def test_redact_masks_every_occurrence_and_the_longest_secret_first():
    key = "m3-0123456789abcdefWXYZ"
    text = f"--api-key {key} and again {key}; prefix {key[:14]}"
    shown = redact(text, [key[:14], None, key])
    assert key not in shown and key[:14] not in shown
    assert shown.count("****WXYZ") == 2
    assert redact("nothing secret", [None, ""]) == "nothing secret"
