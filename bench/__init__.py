"""glmc's benchmarks and device checks, one module per command (`python -m bench.<name> --help`;
`python -m bench` lists them). Shared helpers live in `bench.common`.

Run them from the repository root. glmc need not be installed: where `glmc.ir`, `glmc.codegen`,
... are not importable (the GPU image, which has no glmc install), importing this package maps the
repository's folders onto them, as `pyproject.toml` maps them for an install. An installed glmc
always wins: the mapping is consulted only after every other finder has failed.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# glmc's packages and the repository folders that hold them (pyproject.toml's package-dir)
FOLDERS = {"glmc": "glmc", "glmc.ir": "ir", "glmc.passes": "passes", "glmc.codegen": "codegen",
           "glmc.runtime": "runtime", "glmc.models": "models"}


class RepoFolders(importlib.abc.MetaPathFinder):
    """Finds glmc's top packages in the repository's folders (their submodules are then found
    through each package's `__path__` as usual)."""

    def find_spec(self, name, path=None, target=None):
        folder = FOLDERS.get(name)
        if folder is None or not (ROOT / folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])


if not any(isinstance(f, RepoFolders) for f in sys.meta_path):
    sys.meta_path.append(RepoFolders())
