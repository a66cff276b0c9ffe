import os
import zlib

# Every output buffer starts as garbage, so an element a kernel forgets to write fails the comparison.
os.environ.setdefault("LIK_POISON", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SESSION_SEED = int(os.environ.get("LIK_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))


def pytest_report_header(config):
    return f"lik-cupy: GPU {'found' if HAS_GPU else 'absent'}; LIK_TEST_SEED={SESSION_SEED} reproduces these inputs"


@pytest.fixture
def rng(request):
    # Fresh inputs every session; LIK_TEST_SEED (printed in the header) replays a run.
    return np.random.default_rng([SESSION_SEED, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture
def standard_tiles(monkeypatch):
    """Calling it makes dispatch stop taking the INT8 tokens-on-M tiles (cached choices are dropped
    then and after the test)."""
    from lik_cupy import _dispatch as dispatch

    def switch():
        monkeypatch.setattr(dispatch.tables, "TOKM_MIN_LD", 1 << 30)
        dispatch.clear_caches()

    yield switch
    monkeypatch.undo()
    dispatch.clear_caches()
