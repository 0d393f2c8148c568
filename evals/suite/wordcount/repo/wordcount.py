"""Count words in text."""

from collections import Counter


def words(text: str) -> list:
    """The words of text, lower-cased."""
    return [w.lower() for w in text.split(" ")]


def word_count(text: str) -> int:
    """How many words text has."""
    return len(words(text))


def top_words(text: str, n: int = 3) -> list:
    """The n most common words with their counts."""
    return Counter(words(text)).most_common(n)
