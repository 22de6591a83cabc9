"""FileCheck-style assertions on generated source (Triton kernels rendered from templates)."""


def check(src, *patterns, absent=()):
    """Each pattern occurs after the previous one; none of `absent` occurs."""
    at = 0
    for p in patterns:
        found = src.find(p, at)
        assert found >= 0, f"CHECK: {p!r} not found after offset {at} in:\n{src}"
        at = found + len(p)
    for p in absent:
        assert p not in src, f"CHECK-NOT: {p!r} found"
