"""Fixtures the engine's test modules share."""

from __future__ import annotations

import pytest

from engine.core import demo
from tests.engine_helpers import one_torch_thread


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for the module (its tests compare sums whose order must not vary)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def mtp_demo_dir(tmp_path_factory):
    """The hybrid demo with its MTP draft layer, made once for the session (read-only to its users)."""
    d = tmp_path_factory.mktemp("mtp-demo")
    demo.make(d, arch="qwen3_5", mtp=True)
    return d
