"""Host issue time of the fused head step's torch ops at their shapes (no sync inside the timed loop)."""
import sys, time
sys.path.insert(0, ".")
import torch
import lik_cupy._torch_hidden as TH
bf = torch.bfloat16
h2 = torch.randn(9600, 768, device="cuda", dtype=bf); W = torch.randn(128, 768, device="cuda", dtype=bf)
b = torch.randn(128, device="cuda", dtype=bf); dP = torch.randn(9600, 128, device="cuda", dtype=bf)
D = torch.randn(9600, 128, device="cuda", dtype=bf); ss = torch.empty(9600, device="cuda")
ops = {
    "mm_fwd h2@W.t": lambda: torch.mm(h2, W.t()),
    "mm_dH dP@W": lambda: torch.mm(dP, W),
    "mm_dW dP.t@h2": lambda: torch.mm(dP.t(), h2),
    "linear": lambda: torch.nn.functional.linear(h2, W, b),
    "sum0": lambda: dP.sum(0),
    "bias.float": lambda: b.float(),
    "empty ss": lambda: torch.empty(9600, dtype=torch.float32, device="cuda"),
    "rows_launch normalize": lambda: TH._rows_launch("lik_hidden_normalize", D, (D, None, ss), (9600, 128, 1e-12)),
    "_project": lambda: TH._project(h2, W, b, True, 1e-12),
    "mm_fwd fp32-accum off": None,
}
ops.pop("mm_fwd fp32-accum off")
print("allow_bf16_reduced", torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
      "preferred blas", torch.backends.cuda.preferred_blas_library())
for k, f in ops.items():
    for _ in range(50): f()
    torch.cuda.synchronize()
    best = 1e9
    for r in range(7):
        t = time.perf_counter()
        for _ in range(200): f()
        best = min(best, (time.perf_counter() - t) / 200 * 1e6)
        torch.cuda.synchronize()
    print(f"{k:24s} {best:7.2f} us", flush=True)
torch.backends.cuda.preferred_blas_library("cublas")
for k in ("mm_fwd h2@W.t", "mm_dH dP@W", "mm_dW dP.t@h2"):
    f = ops[k]
    for _ in range(50): f()
    torch.cuda.synchronize()
    best = 1e9
    for r in range(7):
        t = time.perf_counter()
        for _ in range(200): f()
        best = min(best, (time.perf_counter() - t) / 200 * 1e6)
        torch.cuda.synchronize()
    print(f"cublas {k:24s} {best:7.2f} us", flush=True)
