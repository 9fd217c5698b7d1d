"""The documentation's links and citations resolve.

- Every relative link of every Markdown file in the repository (``[text](path)``,
  ``[text](path#anchor)``, ``[text](#anchor)`` and ``<img src="path">``) names a file or folder
  that exists, and its ``#anchor`` a heading of the file it points to (GitHub's anchors: the
  heading lowercased, punctuation dropped, spaces as ``-``, ``-1``, ``-2``... for repeats).
- Every citation of a section in the sources, configs, scripts and docs, ``README, "Section"``
  or ``docs/guide/NAME.md, "Section"`` (quotes escaped or not, on one line), names a heading of
  that file (in Markdown, one inside an inline code span is an example of the form, not read).
  What the binary prints (``--help``, ``init``, the example config) is checked the same way by
  the Rust test ``cli::readme_sections_cited_by_the_config_and_init_exist``.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "target", "node_modules", "__pycache__", ".pytest_cache", "corpus",
             "artifacts", "dist", "runs"}
# The two checkers hold made-up citations as examples of what they refuse.
CHECKERS = {Path("python/tests/test_docs.py"), Path("tests/integration/cli.rs")}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
CITATION = re.compile(r"(README|docs/guide/[A-Za-z0-9_.-]+\.md), \\?\"([^\"\\\n]*)(\\?\")?")
SPLIT_CITATION = re.compile(r"(README|docs/guide/[A-Za-z0-9_.-]+\.md),[ \t]*\n")


def files(pattern: str):
    for path in sorted(ROOT.rglob(pattern)):
        rel = path.relative_to(ROOT)
        if not SKIP_DIRS.intersection(rel.parts[:-1]) and path.is_file():
            yield rel


def without_code(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def headings(path: Path, levels=range(1, 7)) -> list[str]:
    text = FENCE.sub("", (ROOT / path).read_text())
    return [m.group(2) for m in HEADING.finditer(text) if len(m.group(1)) in levels]


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(path):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


MARKDOWN = list(files("*.md"))


def test_the_guide_exists_and_is_found():
    assert Path("README.md") in MARKDOWN and Path("docs/guide/README.md") in MARKDOWN


@pytest.mark.parametrize("doc", MARKDOWN, ids=str)
def test_every_relative_link_and_anchor_resolves(doc):
    text = without_code((ROOT / doc).read_text())
    broken = []
    for m in LINK.finditer(text):
        target = next(g for g in m.groups() if g)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (ROOT / doc).parent / path if path else ROOT / doc
        if not resolved.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor:
            if resolved.suffix != ".md":
                broken.append(f"{target}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(resolved.resolve().relative_to(ROOT)):
                broken.append(f"{target}: no heading with that anchor in {path or doc}")
    assert not broken, f"{doc}: " + "; ".join(broken)


def cited_sections(text: str):
    """(file, section) of each citation in `text`; a citation not closed on its line is an
    error."""
    out = []
    for m in SPLIT_CITATION.finditer(text):
        line = text[:m.start()].count("\n") + 1
        raise AssertionError(f"line {line}: `{m.group(0).strip()}` ends its line: a citation on one line")
    for m in CITATION.finditer(text):
        if not m.group(3):
            line = text[:m.start()].count("\n") + 1
            raise AssertionError(f"line {line}: `{m.group(0)}` is not a citation on one line")
        out.append(("README.md" if m.group(1) == "README" else m.group(1), m.group(2)))
    return out


def test_the_citation_form_is_read_as_documented():
    assert cited_sections('a (README, "Install") b docs/guide/early-stop.md, \\"The detector\\"') == [
        ("README.md", "Install"), ("docs/guide/early-stop.md", "The detector")]
    with pytest.raises(AssertionError):
        cited_sections('(README, "Install\nwithout root")')
    with pytest.raises(AssertionError):
        cited_sections('# (docs/guide/formulas.md,\n# "ICR and the number of view pairs")')


TOP = {"src", "python", "scripts", "tests", "config", "dashboards", "examples", "bench", "tools", "docs",
       "fuzz"}
SOURCES = sorted(
    ({p for pattern in ("*.rs", "*.py", "*.yaml", "*.yml", "*.json", "*.toml", "*.md", "*.sbatch",
                        "*.service", "Makefile")
      for p in files(pattern) if p.parts[0] in TOP or len(p.parts) == 1}
     | {p for p in files("*") if p.parts[0] == "scripts"})
    - CHECKERS)


def test_every_cited_section_is_a_heading_of_the_file_it_names():
    wrong = []
    cited = 0
    for source in SOURCES:
        try:
            text = (ROOT / source).read_text()
        except UnicodeDecodeError:
            continue
        if source.suffix == ".md":
            text = INLINE_CODE.sub("", text)  # `README, "Section"` in Markdown shows the form
        try:
            citations = cited_sections(text)
        except AssertionError as e:
            wrong.append(f"{source}: {e}")
            continue
        for doc, section in citations:
            cited += 1
            if not (ROOT / doc).is_file():
                wrong.append(f"{source} cites {doc}, which does not exist")
            elif section not in headings(Path(doc), range(2, 4) if doc == "README.md" else range(1, 7)):
                wrong.append(f'{source} cites {doc}, "{section}", which is not a heading there')
    assert not wrong, "\n".join(wrong)
    assert cited >= 20, cited


# Paths into the tree: a top-level folder, then names (`diffmon@.service` has an @); in the
# Markdown files and in the comments of the build files.
TOP = ("src", "python", "scripts", "tests", "docs", "bench", "config", "dashboards", "deploy",
       "examples", "fuzz", "tools", ".ci")
TREE_PATH = re.compile(r"(?<![\w./@-])((?:%s)/[\w./@-]*[\w/@])" % "|".join(re.escape(t) for t in TOP))
# Made by a command, not kept in the tree.
GENERATED = ("fuzz/target/", "fuzz/corpus/", "fuzz/artifacts/")


def named_paths(text: str):
    for number, line in enumerate(text.splitlines(), 1):
        for m in TREE_PATH.finditer(line):
            path = m.group(1)
            # Placeholders (`docs/guide/NAME.md`, `<run>`), globs and `..` are not files.
            if re.search(r"[*<>{}]|\.\.|/[A-Z]+\.md$", path) or path.startswith(GENERATED):
                continue
            yield number, path


def test_every_path_the_docs_name_exists():
    """Every path into the tree that a Markdown file or a build file's comment names (in
    backticks or not) is a file or folder that exists: the tree moves (ARCHITECTURE.md,
    "Modules"). ARCHITECTURE.md's tables name the modules' files relative to `src/`."""
    missing = []
    for doc in [*files("**/*.md"), Path("Cargo.toml"), Path("Makefile")]:
        for number, path in named_paths((ROOT / doc).read_text()):
            if not ((ROOT / path).exists() or (ROOT / "src" / path).exists()):
                missing.append(f"{doc}:{number}: {path}")
    assert not missing, "documents name files that do not exist:\n" + "\n".join(missing)


def test_the_path_check_finds_paths_as_the_docs_write_them():
    line = "see `src/store/pin.rs`, python/diffmon/export.py, [x](docs/guide/nothere.md) and `docs/guide/NAME.md`."
    assert [p for _, p in named_paths(line)] == [
        "src/store/pin.rs", "python/diffmon/export.py", "docs/guide/nothere.md"]
    assert not (ROOT / "docs/guide/nothere.md").exists()


def test_the_readme_is_a_front_door_of_at_most_400_lines():
    """The README stays short: what diffmon is, whether it fits, install, the quick start; the
    detail is in docs/guide/ (issue 63)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 400, f"README.md is {len(lines)} lines: move detail into docs/guide/"
