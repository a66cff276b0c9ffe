"""ab_calls.py's 1,024-row cell again, three times with the padded single query beside it for scale
(21 rounds each, fresh inputs each time): where fold._OWN_GEMM_MAX_ROWS stops. python ab_1024.py > ab_1024.txt"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
from ab_calls import CELLS, ab

for i in range(3):
    ab({k: CELLS[k] for k in ("1q1024x16d1024", "1q32x1000d180")}, 21, np.random.default_rng(i))
