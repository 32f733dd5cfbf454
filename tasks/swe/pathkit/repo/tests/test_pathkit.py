from pathkit import change_ext, split_ext


def test_split_ext_simple():
    assert split_ext("report.txt") == ("report", ".txt")


def test_split_ext_no_extension():
    assert split_ext("README") == ("README", "")


def test_split_ext_last_dot_only():
    assert split_ext("archive.tar.gz") == ("archive.tar", ".gz")


def test_change_ext():
    assert change_ext("notes.txt", ".md") == "notes.md"
