"""The docs lead somewhere: no citation of a file a reader of this repository does not have, and
every relative link of docs/method.md names a file (and a function) that exists. Text only: fast."""
import ast
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHOD = os.path.join(ROOT, "docs", "method.md")
# Written split, so that this file does not cite them itself.
OUTSIDE = re.compile(r"\b" + "SP" + "EC" + r"\b|(?<![\w/.-])" + "notes" + "/")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def tracked_files(exts=(".py", ".md", ".html", ".txt")):
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        paths = out.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk it
        paths = [os.path.relpath(os.path.join(d, f), ROOT) for d, dirs, files in os.walk(ROOT)
                 for f in files if not any(p.startswith(".") for p in os.path.relpath(d, ROOT).split(os.sep)
                                           if p != ".")]
    return [p for p in paths if p.endswith(exts) and os.path.isfile(os.path.join(ROOT, p))]


def test_no_citation_points_outside_the_repository():
    hits = []
    for path in tracked_files():
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if OUTSIDE.search(line):
                    hits.append(f"{path}:{n}: {line.strip()}")
    assert not hits, "cite docs/method.md or the paper's equation instead:\n" + "\n".join(hits)


def test_the_citation_pattern_catches_what_it_should():
    assert OUTSIDE.search("as " + "SP" + "EC" + " §3 says") and OUTSIDE.search("(" + "notes" + "/toy-memory-task)")
    assert not OUTSIDE.search("SPECIAL_TOKENS = [...]") and not OUTSIDE.search("release_notes/x")


def defined_names(path):
    """Top-level functions, classes and assignments of a Python file, and their methods and fields."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def heading_anchors(text):
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def method_links():
    with open(METHOD, encoding="utf-8") as f:
        text = f.read()
    return text, [(m.group(1), m.group(2)) for m in LINK.finditer(text)]


def test_method_md_exists_and_links_to_functions():
    _, links = method_links()
    assert sum(t.endswith(".py") or ".py#" in t for _, t in links) >= 20


@pytest.mark.parametrize("label,target", method_links()[1], ids=lambda x: x[:60])
def test_method_md_link_resolves(label, target):
    """A relative link names a file that exists; `file.py#name`, or a label `module.name` linked
    to module.py, names something that file defines; a bare #anchor names a heading."""
    if re.match(r"^[a-z]+:", target):  # http:, https:, mailto: — not checked here
        return
    text, _ = method_links()
    path, _, fragment = target.partition("#")
    if not path:
        assert fragment in heading_anchors(text), f"no heading for #{fragment}"
        return
    full = os.path.normpath(os.path.join(os.path.dirname(METHOD), path))
    assert full.startswith(ROOT + os.sep) and os.path.exists(full), f"{target}: no such file"
    if not full.endswith(".py"):
        return
    names = defined_names(full)
    if fragment:
        assert fragment in names, f"{target}: {fragment} is not defined in {path}"
    label = label.strip("`")
    parts = label.split(".")
    stem = os.path.splitext(os.path.basename(full))[0]
    if len(parts) > 1 and parts[0] == stem:
        missing = [p for p in parts[1:] if p not in names]
        assert not missing, f"[{label}]({target}): {', '.join(missing)} not defined in {path}"


def test_readme_links_to_method_md():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "(docs/method.md)" in f.read()
