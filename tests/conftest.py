"""Shared fixtures. GLMC_VERIFY=1: the verifier runs between every pass in tests.

TRITON_INTERPRET=1 is set here, before any test module imports triton (transformers and torch
may import it early): CI has no GPU, so Triton kernels run in the interpreter.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

os.environ.setdefault("GLMC_VERIFY", "1")


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/*.ir from the current compiler")


@pytest.fixture(scope="session")
def update_golden(request):
    return request.config.getoption("--update-golden")
