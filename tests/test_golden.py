"""Golden IR: the CI's view of the compiler. Any drift fails with the diff; refresh with
`python -m pytest tests/test_golden.py --update-golden` and explain each hunk in the commit."""
import difflib
from pathlib import Path

import pytest
from glmc.ir import print_graph

from tests.compile_util import FULL, TINY, graph

GOLDEN = Path(__file__).parent / "golden"
SPECS = ("tp1", "tp8", "tp8ep8", "dp8ep8")
CASES = [(TINY, par, ph) for par in SPECS for ph in ("prefill", "decode", "mtp_draft", "mtp_verify")] + \
        [(FULL, par, ph) for par in SPECS for ph in ("prefill", "decode")]


@pytest.mark.parametrize("model,par,phase", CASES)
def test_golden_ir(model, par, phase, update_golden):
    path = GOLDEN / f"{model}.{par}.{phase}.ir"
    text = print_graph(graph(model, par, phase))
    if update_golden:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"missing golden {path.name}: run pytest tests/test_golden.py --update-golden"
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            f"golden/{path.name}", "compiled", n=1))
        pytest.fail(f"IR drift in {path.name}:\n{diff[:20000]}")
