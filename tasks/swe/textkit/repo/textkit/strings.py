"""String helpers used by the report generator."""
import re


def truncate(text: str, limit: int, ellipsis: str = "...") -> str:
    """Shorten `text` to at most `limit` characters.

    Text that fits is returned unchanged; longer text is cut and ends with `ellipsis`,
    the ellipsis included in the limit.
    """
    if limit < len(ellipsis):
        raise ValueError(f"limit {limit} is shorter than the ellipsis {ellipsis!r}")
    if len(text) < limit:
        return text
    return text[: limit - len(ellipsis)] + ellipsis


def slugify(text: str) -> str:
    """Lowercase words joined by single dashes: 'Hello, World!' -> 'hello-world'."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "-".join(words)


def word_count(text: str) -> int:
    return len(text.split())
