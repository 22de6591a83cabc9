"""The run settings are one value: one default per field, checked on construction with errors that
name the field, shown by `glmc run --help`, and picklable to the ranks of a multi-rank server."""
import dataclasses
import inspect
import pickle

import pytest
from glmc.runtime.engine.engine import Engine
from glmc.runtime.engine.scheduler import Scheduler
from glmc.runtime.serving.launch import ServeConfig
from glmc.runtime.worker.loader import load_runner

from glmc.api import build_engine, plan_for
from glmc.cli import main as glmc
from glmc.run_config import RunConfig, with_settings


def test_defaults():
    run = RunConfig()
    assert (run.device, run.num_pages, run.max_context, run.max_running, run.max_batch_tokens) == \
        ("cpu", 256, None, 32, 256)
    assert (run.max_waiting, run.enable_prefix_cache, run.overlap, run.speculative_num_steps) == \
        (256, True, None, 0)
    assert (run.capture, run.prefill_graphs, run.warmup, run.kv_fp8, run.quantize, run.kv_dtype) == \
        (True, True, True, None, None, None)


def test_every_field_has_a_docstring():
    source = inspect.getsource(RunConfig)
    for f in dataclasses.fields(RunConfig):
        after = source.split(f"    {f.name}: ", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), f.name


@pytest.mark.parametrize("field, value, message", [
    ("max_running", 0, "max_running must be >= 1, got 0"),
    ("num_pages", -3, "num_pages must be >= 1, got -3"),
    ("max_batch_tokens", 0, "max_batch_tokens must be >= 1, got 0"),
    ("max_waiting", 0, "max_waiting must be >= 1, got 0"),
    ("max_context", 0, "max_context must be >= 1, got 0"),
    ("mixed_prefill_tokens", 0, "mixed_prefill_tokens must be >= 1, got 0"),
    ("speculative_num_steps", -1, "speculative_num_steps must be >= 0, got -1"),
    ("max_running", 2.5, "max_running must be an integer, got 2.5"),
    ("device", "tpu", "device must be one of ('cpu', 'cuda') (or cuda:N), got 'tpu'"),
    ("kv_fp8", "keep", "kv_fp8 must be one of ('store', 'emulate', 'none') or None, got 'keep'"),
    ("kv_dtype", "fp16", "kv_dtype must be one of ('fp8', 'bf16') or None, got 'fp16'"),
    ("quantize", "int4", "quantize must be one of ('fp8',) or None, got 'int4'"),
])
def test_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError) as e:
        RunConfig(**{field: value})
    assert str(e.value) == message
    with pytest.raises(ValueError, match=field):
        with_settings(RunConfig(), **{field: value})


def test_speculation_refuses_overlap():
    with pytest.raises(ValueError, match="overlap: speculative decoding runs without overlap"):
        RunConfig(speculative_num_steps=2, overlap=True)
    assert RunConfig(speculative_num_steps=2, overlap=False).validate().overlap is False
    assert RunConfig(device="cuda:1").device == "cuda:1"


def test_keywords_are_its_fields():
    assert with_settings(None, max_running=4) == RunConfig(max_running=4)
    assert with_settings(RunConfig(num_pages=8), max_running=4) == RunConfig(num_pages=8, max_running=4)
    with pytest.raises(TypeError, match="max_runnin"):
        with_settings(RunConfig(), max_runnin=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().max_running = 4


def test_one_default_each():
    """What takes the settings takes a RunConfig; the scheduler's own limits default to its fields."""
    for fn in (Engine.__init__, load_runner, build_engine, plan_for):
        params = inspect.signature(fn).parameters
        assert "run" in params and not {f.name for f in dataclasses.fields(RunConfig)} & set(params), fn
    params = inspect.signature(Scheduler.__init__).parameters
    assert params["max_running"].default == RunConfig.max_running
    assert params["max_batch_tokens"].default == RunConfig.max_batch_tokens


def test_it_crosses_the_process_boundary():
    run = RunConfig(device="cuda", num_pages=9, max_running=3, speculative_num_steps=2, overlap=False,
                    kv_fp8="emulate")
    assert pickle.loads(pickle.dumps(run)) == run
    cfg = ServeConfig(plan=None, ckpt_dir="ckpt", run=run)
    assert pickle.loads(pickle.dumps(cfg)).run == run


def test_run_help_takes_the_defaults_from_it(capsys):
    with pytest.raises(SystemExit):
        glmc(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split()).split(" options: ", 1)[1]
    for flag, value in (("--num-pages NUM_PAGES", RunConfig.num_pages),
                        ("--max-running MAX_RUNNING", RunConfig.max_running),
                        ("--max-batch-tokens MAX_BATCH_TOKENS", RunConfig.max_batch_tokens),
                        ("--max-waiting MAX_WAITING", RunConfig.max_waiting)):
        assert f"(default: {value})" in text.split(flag, 1)[1].split(" --", 1)[0], flag


def test_run_refuses_a_bad_setting_before_any_work(capsys):
    assert glmc(["run", "--max-running", "0"]) == 2
    assert "glmc run: error: max_running must be >= 1, got 0" in capsys.readouterr().err
