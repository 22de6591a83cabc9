"""Shared fixtures. GLMC_VERIFY=1: the verifier runs between every pass in tests.

TRITON_INTERPRET=1 is set here, before any test module imports triton (transformers and torch
may import it early): CI has no GPU, so Triton kernels run in the interpreter.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

os.environ.setdefault("GLMC_VERIFY", "1")


_EXIT_STATUS = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with the run's status once every report is written, without the interpreter's C++
    teardown: it has aborted the process after a green run ("terminate called without an active
    exception", README "Limits"), which would report passing tests as a crash."""
    if _EXIT_STATUS and os.environ.get("GLMC_TEST_TEARDOWN") != "1":
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/*.ir from the current compiler")


@pytest.fixture(scope="session")
def update_golden(request):
    return request.config.getoption("--update-golden")


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's ops are too small to split: on 2 shared cores extra intra-op threads only
    contend (5-10x slower under load); serving test modules run torch single-threaded."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """The tiny default model's checkpoint (models/glm_moe_dsa_tiny.yaml), made for this module."""
    from glmc.tiny import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
