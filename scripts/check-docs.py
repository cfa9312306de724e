#!/usr/bin/env python3
"""Check the docs site's links and the README's size; exit 1 on any problem.

- Every relative link in README.md and in docs/src/**/*.md reaches a file, and every `#anchor`
  (in the same page or another) reaches a heading of that page (the id mdBook and GitHub give
  it: lowercase, letters, digits, `_` and `-` kept, whitespace to `-`, the rest dropped; a
  repeated heading gets `-1`, `-2`, ...).
- A link in docs/src stays inside docs/src: mdBook copies only that folder into the site, so a
  link to a repository file outside it would be broken on the site (name such files as plain
  paths instead).
- Every page in docs/src is listed in docs/src/SUMMARY.md, and every page SUMMARY.md lists exists.
- README.md has at most 300 lines (issue 46: a door, with the rest in the docs).

Links inside fenced code blocks and inline code are not links and are skipped, as are URLs with a
scheme (https:, mailto:). Run from anywhere: `python3 scripts/check-docs.py`.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "docs" / "src"
README = ROOT / "README.md"
README_MAX_LINES = 300

# [text](target) or [text](target "title"); images too (the leading ! is not needed to match).
INLINE = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def prose_lines(text):
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield n, line


def strip_code_spans(line):
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", line)


def heading_text(raw):
    """The text a heading renders: links to their text, code and emphasis marks dropped."""
    t = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    # Emphasis marks go; `_` stays (it is kept in ids, and `a_b` in code is no emphasis).
    return t.replace("`", "").replace("*", "")


def slug(text):
    out = []
    for ch in text:
        if ch.isalnum() or ch in "_-":
            out.append(ch.lower())
        elif ch.isspace():
            out.append("-")
    return "".join(out)


def anchors(path, cache={}):
    if path not in cache:
        seen = {}
        ids = set()
        for _, line in prose_lines(path.read_text(encoding="utf-8")):
            m = HEADING.match(line)
            if not m:
                continue
            base = slug(heading_text(m.group(2)))
            k = seen.get(base, 0)
            seen[base] = k + 1
            ids.add(base if k == 0 else f"{base}-{k}")
        cache[path] = ids
    return cache[path]


def links(path):
    prev_blank = True
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        # A reference definition cannot interrupt a paragraph: `[V,h]: ...` mid-paragraph is text.
        m = REFDEF.match(line) if prev_blank else None
        prev_blank = line.strip() == "" or m is not None
        if m:
            yield n, m.group(1)
            continue
        for m in INLINE.finditer(strip_code_spans(line)):
            yield n, m.group(1)


def check_file(path, errors):
    in_book = BOOK in path.parents
    for n, target in links(path):
        where = f"{path.relative_to(ROOT)}:{n}"
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # https:, mailto:, ...
        file_part, _, anchor = target.partition("#")
        dest = path if file_part == "" else (path.parent / file_part).resolve()
        if not dest.exists():
            errors.append(f"{where}: link to a missing file: {target}")
            continue
        if in_book and BOOK.resolve() not in [dest, *dest.parents]:
            errors.append(
                f"{where}: link leaves docs/src (mdBook will not copy it into the site): {target};"
                " name the file as a plain path instead"
            )
            continue
        if anchor:
            if dest.suffix != ".md":
                errors.append(f"{where}: anchor on a file that is not Markdown: {target}")
            elif anchor not in anchors(dest):
                errors.append(f"{where}: no heading for #{anchor} in {dest.relative_to(ROOT)}")


def check_summary(errors):
    summary = BOOK / "SUMMARY.md"
    listed = set()
    for _, target in links(summary):
        listed.add((BOOK / target.partition("#")[0]).resolve())
    for page in sorted(BOOK.rglob("*.md")):
        if page.name != "SUMMARY.md" and page.resolve() not in listed:
            errors.append(f"{page.relative_to(ROOT)}: not listed in docs/src/SUMMARY.md")


def main():
    errors = []
    pages = sorted(BOOK.rglob("*.md"))
    for path in [README, *pages]:
        check_file(path, errors)
    check_summary(errors)
    n = README.read_text(encoding="utf-8").count("\n")
    if n > README_MAX_LINES:
        errors.append(f"README.md: {n} lines, more than {README_MAX_LINES}: move the rest into docs/src")
    for e in errors:
        print(e, file=sys.stderr)
    checked = sum(1 for p in [README, *pages] for _ in links(p))
    if errors:
        print(f"check-docs: {len(errors)} problems in {checked} links over {len(pages) + 1} files", file=sys.stderr)
        return 1
    print(f"check-docs: {checked} links over {len(pages) + 1} files resolve; README.md {n} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
