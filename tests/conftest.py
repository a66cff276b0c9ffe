import os
import zlib

# Every output buffer starts as garbage, so an element a kernel forgets to write fails the comparison.
os.environ.setdefault("LIK_POISON", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


GPU_COUNT = _gpu_count()
HAS_GPU = GPU_COUNT > 0


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


@pytest.fixture
def other_gpu():
    """The multi-GPU tests' device, 1, for the arrays of a call made while device 0 is current (skipped
    with fewer than two GPUs): each such call must run on its arrays' GPU and leave device 0 current,
    which is checked again when the test ends (CuPy's and torch's current device are CUDA's one)."""
    if GPU_COUNT < 2:
        pytest.skip("needs two GPUs")
    import cupy

    with cupy.cuda.Device(0):
        yield 1
        assert cupy.cuda.runtime.getDevice() == 0, "a call left another device current"

