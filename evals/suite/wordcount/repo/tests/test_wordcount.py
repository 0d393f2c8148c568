from wordcount import top_words, word_count, words


def test_single_spaces():
    assert word_count("a b c") == 3


def test_lowercase():
    assert words("Hello World") == ["hello", "world"]


def test_top():
    assert top_words("a b a", 1) == [("a", 2)]
