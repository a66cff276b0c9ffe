"""What this directory's A/B scripts share: the old fold kernel and its arguments, one cell's random
inputs, and calls timed in alternation."""
import importlib.util, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
import numpy as np
from lik_cupy._cpu import fold


def fold_ways(old_kernels: str) -> dict:
    """{"before": (kernel, DocumentFold class), "after": ...}: the kernel of the file ``old_kernels``
    (``git show 14a7a61:lik_cupy/_cpu/fold_kernels.py``), given its one runner-up buffer, and this tree's."""
    assert fold.available()
    spec = importlib.util.spec_from_file_location("old_fold_kernels", old_kernels)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # (Numba's on-disk cache finds its module by name)
    spec.loader.exec_module(old)

    class OldFold(fold.DocumentFold):
        """The old kernel's arguments: one runner-up buffer (the state's second element unused)."""
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            squares, top, runner, _, at, nan, offset = self._run
            self._run = (squares, top, runner, at, nan, offset)

    return {"before": (old.piece, OldFold), "after": (fold._kernel, fold.DocumentFold)}


def packed_cell(rng, nq: int, lq: int, nd: int, lo: int, hi: int):
    """Unit-length float32 queries ``[nq, lq, 128]`` and ``nd`` packed documents of ``lo`` .. ``hi`` tokens:
    (Q, tokens, offsets)."""
    def unit(x): return x / np.linalg.norm(x, axis=-1, keepdims=True)
    Q = unit(rng.standard_normal((nq, lq, 128), dtype=np.float32))
    lens = rng.integers(lo, hi + 1, nd)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return Q, unit(rng.standard_normal((int(off[-1]), 128), dtype=np.float32)), off


def alternate(call, use, ways: tuple[str, str], rounds: int) -> dict[str, list[float]]:
    """ms of ``call()`` under each of the two ``ways`` (``use(way)`` switches), in turn, the first of each
    round alternating, each call 0.15 s after the one before."""
    t = {k: [] for k in ways}
    for r in range(rounds):
        for k in (ways if r % 2 else ways[::-1]):
            use(k)
            time.sleep(0.15)
            t0 = time.perf_counter(); call(); t[k].append(1e3 * (time.perf_counter() - t0))
    return t
