import pytest

from textkit import slugify, truncate, word_count


def test_truncate_short_text_unchanged():
    assert truncate("abc", 10) == "abc"


def test_truncate_long_text():
    assert truncate("abcdefghij", 6) == "abc..."


def test_truncate_rejects_tiny_limit():
    with pytest.raises(ValueError):
        truncate("abcdef", 2)


def test_slugify():
    assert slugify("Hello, World!") == "hello-world"
    assert slugify("  many   spaces ") == "many-spaces"


def test_word_count():
    assert word_count("one two  three") == 3
