"""FileCheck-style assertions on generated source (Triton kernels rendered from templates) and on
printed IR (pass docstring examples, `check_lines`)."""
import re


def check(src, *patterns, absent=()):
    """Each pattern occurs after the previous one; none of `absent` occurs."""
    at = 0
    for p in patterns:
        found = src.find(p, at)
        assert found >= 0, f"CHECK: {p!r} not found after offset {at} in:\n{src}"
        at = found + len(p)
    for p in absent:
        assert p not in src, f"CHECK-NOT: {p!r} found"


def line_pattern(snippet: str) -> re.Pattern:
    """A snippet line as a regex: `...` matches anything, the rest literally (a substring of a line)."""
    return re.compile(".*".join(re.escape(part) for part in snippet.strip().split("...")))


def check_lines(text: str, snippets: list[str]) -> str | None:
    """None if each snippet matches a line of `text`, in order (a later line than the previous
    snippet's); else a message naming the first snippet that does not."""
    lines, at = text.splitlines(), 0
    for snippet in snippets:
        pattern = line_pattern(snippet)
        hit = next((i for i in range(at, len(lines)) if pattern.search(lines[i])), None)
        if hit is None:
            return f"CHECK: {snippet.strip()!r} matches no line after line {at}"
        at = hit + 1
    return None
