"""Import glmc from a bench script: the installed package, or (on the device image, where glmc is
not installed) the repo's folders mapped onto glmc.*, glmc.runtime, glmc.codegen."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_glmc(probe: str = "glmc.codegen.torch_ref") -> None:
    """Make `probe` importable (try it first; map the folders only if that fails)."""
    try:
        importlib.import_module(probe)
        return
    except ImportError:
        pass
    for name, folder in [("glmc", "glmc"), ("glmc.runtime", "runtime"), ("glmc.codegen", "codegen")]:
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
