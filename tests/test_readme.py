"""The README's Python API example runs as written (on a tiny checkpoint) and agrees with HF."""
import re
from pathlib import Path

import torch
from tiny_hf import save_tiny


def test_readme_python_example(tmp_path, capsys):
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"## Python API.*?```python\n(.*?)```", text, re.S).group(1)
    model = save_tiny(tmp_path, "grouped", seed=2)
    exec(code.replace("path/to/hf_checkpoint", str(tmp_path)), {})
    printed = eval(capsys.readouterr().out.strip())
    want = model.generate(torch.tensor([[11, 12, 13, 14]]), max_new_tokens=8, do_sample=False)
    assert printed == [want[0, 4:].tolist()]
