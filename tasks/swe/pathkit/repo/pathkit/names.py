"""File-name helpers (names only, no directories)."""


def split_ext(name: str) -> tuple[str, str]:
    """'report.txt' -> ('report', '.txt'); 'README' -> ('README', '')."""
    dot = name.rfind(".")
    if dot == -1:
        return name, ""
    return name[:dot], name[dot:]


def change_ext(name: str, ext: str) -> str:
    """Replace the extension: change_ext('a.txt', '.md') -> 'a.md'."""
    stem, _ = split_ext(name)
    return stem + ext
