"""The README's first command, as written, in a fresh directory: it makes a virtual environment,
installs glmc into it and starts `glmc run`, which must print its URL and answer a completion.
Nothing of the test's own environment is visible to it (a copy of the source tree, no
PYTHONPATH), so a package `glmc run` imports but the install leaves out fails here. Needs the
package index (pip's cache makes torch quick after the first install)."""
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import openai
from test_run_cli import free_port

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900   # the install (torch from pip's cache, the rest from the index) and the start
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__",
                                    ".cache", ".whl", ".pytest_cache")


def quick_start_command() -> str:
    """The first command of the README's "Quick start" section (one indented line)."""
    section = (ROOT / "README.md").read_text().split("## Quick start", 1)[1]
    return re.search(r"^    (\S.*)$", section, re.M).group(1)


def test_the_readme_first_command_installs_and_serves(tmp_path):
    command = quick_start_command()
    assert command.endswith("&& glmc run"), command
    src = tmp_path / "glmc"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    log = tmp_path / "log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        # as written, but on a free port, and `glmc run` in bash's place so that it gets the signal
        run = f"{command.removesuffix(' && glmc run')} && exec glmc run --port {port}"
        proc = subprocess.Popen(["bash", "-c", run], cwd=src, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**env, "OMP_NUM_THREADS": "1"})
        try:
            while not (m := re.search(r"serving (\S+) at (http://\S+/v1)", log.read_text())):
                text = log.read_text()
                assert proc.poll() is None and time.monotonic() - t0 < TIMEOUT_S \
                    and "Traceback" not in text, text[-4000:]
                time.sleep(0.5)
            started = time.monotonic() - t0
            text = log.read_text()
            assert "start-up requests answered" in text and "Error" not in text, text[-4000:]
            client = openai.OpenAI(base_url=m.group(2), api_key="none", max_retries=0, timeout=60)
            got = client.completions.create(model=m.group(1), prompt="def main():\n    ",
                                            max_tokens=8, temperature=0)
            assert got.choices[0].text and got.usage.completion_tokens >= 1
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0 and "stopped serving" in log.read_text(), \
                log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    assert (src / ".venv" / "bin" / "glmc").exists()
    print(f"installed and serving after {started:.0f} s")
