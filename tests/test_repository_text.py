"""The repository speaks of the product: tracked text cites no ticket numbers, has no work-diary
headings, no to-do lists for later and no talk of machines being handed out, and every `bench`
module imports without touching `sys.path` or glmc's private names.

Each check prints the file, the line and the text it objects to. Training text and tokenizer data
(models/small/) are other people's words and are not read.
"""
import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_OURS = ("models/small/",)            # the stdlib sources the small model learnt from, its tokenizer
BINARY = (".safetensors", ".png", ".gz", ".whl")

# A ticket reference: the word, singular or plural, then a number.
TICKET = re.compile(r"\b(issues?|tickets?)[ -]#?\d+", re.I)
# A results folder named after the work's sittings (`h200_2026-12-03_s14`), not its day or subject.
SITTING_DIR = re.compile(r"^bench/results/[^/]*_s\d+/")
# A dated or numbered diary entry, anywhere in prose.
SESSION = re.compile(r"\bsessions? \d+", re.I)
# Markdown headings that open a diary entry or a list for later.
# (Each word is spelt with a character class so that these lines do not match themselves.)
DIARY_HEADING = re.compile(r"^#+\s*(sess[i]on\b|20\d\d-\d\d-\d\d\b|ne[x]t\b|la[t]er\b|le[f]t for later\b|to-?d[o]\b)",
                           re.I | re.M)
LATER = re.compile(r"\b(TO[D]O|FIX[M]E)\b|\b(ne[x]t session|le[f]t for later)\b")
# Machines handed out to the work, and the calls that asked for them.
LOAN = re.compile(r"\b(le[n]t|with[h]eld|lea[s]ed?)\b|\brun\(command=|\bcarry=\[", re.I)


def tracked_text() -> dict[str, str]:
    """{path: text} of every file git tracks (and every file not yet added), less data."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    texts = {}
    for path in out.stdout.split():
        if path.startswith(NOT_OURS) or path.endswith(BINARY) or not (ROOT / path).is_file():
            continue
        try:
            texts[path] = (ROOT / path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def hits(pattern: re.Pattern, texts: dict[str, str], only=lambda path: True) -> list[str]:
    found = []
    for path, text in texts.items():
        if only(path):
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path}:{line}: {text.splitlines()[line - 1].strip()[:120]}")
    return found


@pytest.fixture(scope="module")
def texts():
    return tracked_text()


def test_no_ticket_references(texts):
    assert not hits(TICKET, texts), "say what the code does and why, not which ticket asked for it"


def test_results_folders_say_what_they_hold(texts):
    assert [p for p in texts if SITTING_DIR.match(p)] == []
    assert SITTING_DIR.match("bench/results/h200_2026-12-03_s14/x.json")


def test_no_diary(texts):
    found = hits(SESSION, texts) + hits(LATER, texts) + hits(DIARY_HEADING, texts, lambda p: p.endswith(".md"))
    assert not found, "current facts belong in docs/performance.md or the README's Limits; history in git"


def test_no_talk_of_machines_handed_out(texts):
    assert not hits(LOAN, texts)


def test_the_checks_see_what_they_forbid():
    planted = {"a.py": "# see iss" + "ue 12\n", "b.md": "## Ses" + "sion 3 (2026-12-01)\n- TO" + "DO: x\n",
               "c.sh": "# the machine was le" + "nt for 10 minutes\n"}
    assert hits(TICKET, planted) == ["a.py:1: # see iss" + "ue 12"]
    assert len(hits(DIARY_HEADING, planted)) == 1 and len(hits(SESSION, planted)) == 1
    assert len(hits(LATER, planted)) == 1 and len(hits(LOAN, planted)) == 1


def bench_modules() -> list[str]:
    return sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__main__")


def is_sys_path(node) -> bool:
    node = node.value if isinstance(node, ast.Subscript) else node
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def path_edits(source: str) -> list[int]:
    """Lines that change `sys.path`: a method call on it (insert, append, ...) or an assignment."""
    lines = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and is_sys_path(n.func.value):
            lines.add(n.lineno)
        elif isinstance(n, (ast.Assign, ast.AugAssign)):
            if any(is_sys_path(t) for t in (n.targets if isinstance(n, ast.Assign) else [n.target])):
                lines.add(n.lineno)
    return sorted(lines)


def private_glmc_names(source: str) -> list[str]:
    """`from glmc... import _x` and `<glmc module>._x`."""
    tree, found, modules = ast.parse(source), [], set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("glmc"):
            for a in n.names:
                modules.add(a.asname or a.name)
                if a.name.startswith("_"):
                    found.append(f"{n.lineno}: {n.module}.{a.name}")
        elif isinstance(n, ast.Import):
            modules |= {a.asname or a.name for a in n.names if a.name.startswith("glmc")}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in modules \
                and n.attr.startswith("_") and not n.attr.startswith("__"):
            found.append(f"{n.lineno}: {n.value.id}.{n.attr}")
    return found


def test_no_sys_path_edits_in_bench_or_tests():
    found = [f"{p.relative_to(ROOT)}:{line}" for folder in ("bench", "tests")
             for p in sorted((ROOT / folder).glob("*.py")) for line in path_edits(p.read_text())]
    assert not found, "import bench as a package (`from bench import common`), not through sys.path"


def test_bench_uses_no_private_glmc_names():
    found = [f"bench/{m}.py:{x}" for m in bench_modules()
             for x in private_glmc_names((ROOT / "bench" / f"{m}.py").read_text())]
    assert not found, "make the name public in glmc instead"


def test_the_import_checks_see_what_they_forbid():
    assert path_edits("import sys\nsys.path.insert(0, 'bench')\nsys.path[:0] = ['x']\nsys.path += ['y']\n") == [2, 3, 4]
    assert path_edits("import sys\nbefore = list(sys.path)\n") == []
    assert private_glmc_names("from glmc.codegen.cuda_target import _padding\n") == \
        ["1: glmc.codegen.cuda_target._padding"]
    assert private_glmc_names("from glmc.codegen import triton_render as tr\nx = tr._warps(4)\n") == ["2: tr._warps"]


@pytest.mark.parametrize("name", bench_modules())
def test_every_bench_module_imports_as_it_is(name):
    before = list(sys.path)
    importlib.import_module("bench" if name == "__init__" else f"bench.{name}")
    assert sys.path == before
