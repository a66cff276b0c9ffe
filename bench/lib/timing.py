"""Event timing shared by the bench scripts (torch CUDA events on the current stream)."""

from __future__ import annotations

import statistics


def per_call_ms(torch, fn, n, *, rounds=3, spin_cycles=0):
    """Median over ``rounds`` of (time of ``n`` back-to-back calls) / n, after one warm-up call.

    ``spin_cycles`` > 0 queues a spin kernel before each round so the host runs ahead and
    launch overhead stays hidden (device time); 0 times what a loop of calls pays, host
    included. CuPy work on the legacy default stream is ordered with torch's.
    """
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin_cycles:
            torch.cuda._sleep(spin_cycles)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / n)
    return statistics.median(times)


def padded_call_ms(torch, fn, reps, pad_cycles):
    """Per-call ms of ``fn(i)`` for i in range(reps): events around each call, each call behind
    its own queued sleep of ``pad_cycles`` (0: none) so the host runs ahead and the call's launch
    overhead stays hidden, while a call that waits inside is charged the wait."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for i in range(reps):
        if pad_cycles:
            torch.cuda._sleep(pad_cycles)
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def packed_calls(torch, q, toks, off):
    """(ours, flash): callables making one call each of ``lik_cupy.maxsim_varlen`` (unchecked
    offsets) and of flash-maxsim's packed kernel (one query: q[0]), each call on the next of the
    packed corpora ``toks`` (CuPy [T, d] copies, so that no call finds its corpus in L2).
    q: CuPy [Nq, Lq, d]; off: CuPy [Nd + 1] offsets shared by every corpus."""
    import lik_cupy

    tq, toff = torch.as_tensor(q, device="cuda"), torch.as_tensor(off, device="cuda")
    ttoks = [torch.as_tensor(t, device="cuda") for t in toks]
    counter = [0]

    def ours():
        counter[0] += 1
        return lik_cupy.maxsim_varlen(q, toks[counter[0] % len(toks)], off, validate_offsets=False)

    def flash():
        import flash_maxsim

        counter[0] += 1
        return flash_maxsim.flash_maxsim(tq[0], ttoks[counter[0] % len(toks)], doc_lengths=toff)

    return ours, flash


def count_mismatches(cp, variants, apply, call, label):
    """For each variant in turn, ``apply(variant)`` then ``call()`` (a tuple result: its first
    array); count and print the variants whose result is not bit for bit the first variant's.
    ``label(variant)`` names a variant in the printed line."""
    ref, mismatches = None, 0
    for v in variants:
        apply(v)
        got = call()
        got = got[0] if isinstance(got, tuple) else got
        if ref is None:
            ref = got
        elif not bool(cp.array_equal(got, ref)):
            mismatches += 1
            print(f"MISMATCH {label(v)}", flush=True)
    return mismatches
