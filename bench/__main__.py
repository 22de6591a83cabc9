"""`python -m bench NAME ARGS...` runs `bench.NAME` (as `python -m bench.NAME ARGS...`);
`python -m bench` lists the commands with the first line of each one's docstring."""
from __future__ import annotations

import ast
import runpy
import sys

from bench import ROOT

NOT_COMMANDS = {"__init__", "__main__", "common", "predicted"}


def commands() -> dict[str, str]:
    """{name: the first line of its docstring} of every runnable module here."""
    out = {}
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.stem not in NOT_COMMANDS:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            out[path.stem] = doc.splitlines()[0] if doc else ""
    return out


def main() -> None:
    names = commands()
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: python -m bench NAME [ARGS...]   (or python -m bench.NAME [ARGS...])\n")
        print("\n".join(f"  {n:22s} {d}" for n, d in names.items()))
        return
    name = sys.argv[1]
    if name not in names:
        sys.exit(f"bench: no command {name!r}; known: {', '.join(names)}")
    sys.argv = [f"bench.{name}", *sys.argv[2:]]
    runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
