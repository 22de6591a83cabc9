"""The `glmc` command's surface: help that shows defaults, arguments checked before any work,
what start-up writes to a log, and plan directories made with the user's umask."""
import os
import re
import stat

import pytest

from glmc import cli
from glmc.cli import main as glmc
from glmc.passes import PHASES
from glmc.runtime.worker.loader import progress


def help_of(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        glmc([*args, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())   # argparse wraps lines: one line of words


def test_run_help_shows_the_defaults(capsys):
    text = help_of(capsys, "run").split(" options: ", 1)[1]
    for option, default in (("--host HOST", "127.0.0.1"), ("--port PORT", "8000"),
                            ("--num-pages NUM_PAGES", "256"), ("--max-running MAX_RUNNING", "32"),
                            ("--max-batch-tokens MAX_BATCH_TOKENS", "256"),
                            ("--max-waiting MAX_WAITING", "256"), ("--max-body-mb MAX_BODY_MB", "8.0"),
                            ("--shutdown-timeout SHUTDOWN_TIMEOUT", "30.0"), ("--device {cpu,cuda}", "cpu"),
                            ("--speculative-num-steps N", "0"), ("--log-level {debug,info,warning,error}", "info")):
        # its help: up to the next option that takes a value (a flag's text may follow)
        after = re.search(re.escape(option) + r" (.*?)(?= --[a-z-]+ [A-Z{]|$)", text).group(1)
        assert f"(default: {default})" in after, (option, after)
    # flags and options without a default say nothing of one, or say it in words
    assert "(default: False)" not in text and "(default: None)" not in text
    assert "(default: True)" not in help_of(capsys, "compile")


def test_diff_names_the_valid_phases_before_compiling(capsys):
    assert cli.PHASES == PHASES
    with pytest.raises(SystemExit) as e:
        glmc(["diff", "tp1", "tp2", "--phase", "bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err and all(repr(p) in err for p in PHASES), err


def test_one_step_progress_is_one_line(capfd, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    with progress(total=1, desc="compiling tp1 (cpu)", unit="plan") as bar:
        bar.update()
    assert capfd.readouterr().err == "glmc: compiling tp1 (cpu)\n"
    monkeypatch.setenv("TQDM_DISABLE", "1")
    with progress(total=1, desc="loading weights", unit="shard") as bar:
        bar.update()
    assert capfd.readouterr().err == ""


def test_plan_directories_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        assert glmc(["compile", "--model", "glm_moe_dsa_tiny", "--parallel", "tp1", "--device",
                     "cpu", "-o", str(tmp_path / "plan")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plan").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "plan" / "plan.json").stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["plan"]   # no temporary directory left
