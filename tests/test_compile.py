"""NVRTC compilation, the kernel caches and kernel choice. CPU only: NVRTC needs no GPU.

``test_check_all_compiles_without_spills`` is the CI compile check. Dispatch can return some
4,300 forward configurations over the four architectures, too many to build on every CI run, so
it builds a sample that still reaches every way the kernels can differ (``_ci_sample``): every
pair of configuration values that occurs together, the register-heaviest tile of each kernel
family, and a rotating share of the rest. ``LIK_COMPILE_ALL=1`` builds every configuration (the
whole check, 30-60 minutes on two cores); ``test_every_padded_dim_compiles_without_spills``
(opt-in, ``LIK_COMPILE_ALL_DIMS=1``) builds the other padded dims' kernels too. Both compile on
every core and read what an earlier check proved under the same key from the kernel cache
(``nvrtc.compile_logs``; ``LIK_COMPILE_FRESH=1`` compiles everything).

A fresh clone's cache is empty, so the check's proofs are also committed: ``tests/data/compile_logs.json.gz``
holds the ptxas logs of the sample's fixed part (the pair cover and the families) under their cache
keys, which name the source and every file it includes, the defines, NVRTC's build and this
package's version. The check seeds the cache from it first (``nvrtc.seed_logs``): a build whose
source changed misses its entry and compiles, and the rotating share compiles every day. After
changing ``cuda_src/``, ``LIK_COMPILE_RECORD=1 python -m pytest tests/test_compile.py -k "check_all or fp8"``
compiles what changed and rewrites the file with this run's fixed part (the FP8 families' check
adds its builds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import glob
import gzip
import hashlib
import json
import os
import pathlib
import random
import subprocess
import sys
import re
import shutil
import statistics

import pytest

from lik_cupy._runtime import nvrtc as lc
from lik_cupy._runtime import token_split
from lik_cupy._runtime.kernels import HIDDEN_FUSED
from lik_cupy import _dispatch as dispatch

pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-python) is not installed")

SRC = "maxsim_fwd.cu"


# The compile check's processes: every core (the CI machine has two).
WORKERS = os.cpu_count() or 1


def _cached() -> bool:
    """Whether the compile checks may read what an earlier check proved (``LIK_COMPILE_FRESH`` says no)."""
    return not os.environ.get("LIK_COMPILE_FRESH")


def _small_cfg(arch=80, argmax=False):
    return dispatch.choose_forward(arch, "float16", 64, 32, argmax, True)


# ---------------------------------------------------------------- (a) the CI compile check


def _table(rows) -> str:
    head = ("kernel", "arch", "regs", "dyn_smem", "static_smem", "stack", "spill_st", "spill_ld")
    body = [
        (r["kernel"], r["arch"], str(r["registers"]), str(r["dynamic_smem"]), str(r["static_smem"]), str(r["stack"]),
         str(r["spill_stores"]), str(r["spill_loads"]))
        for r in rows
    ]
    w = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w[0]}}}" if i == 0 else f"{{:>{w[i]}}}" for i in range(len(head)))
    return "\n".join(fmt.format(*x) for x in [head, *body]) + "\n"


# Hopper kernels whose wgmma instructions ptxas serializes (C7520, "compiler-inserted WG.AR in
# divergent path"): none since INT8's one-shot scores-only tiles leave their accumulators unwritten
# before the first wgmma (cuda_src/maxsim_fwd.cu). Any kernel ptxas serializes fails the check: a
# Hopper tile whose wgmma instructions wait on each other loses its pipelining without a word
# elsewhere.
WGMMA_SERIALIZED: frozenset = frozenset()


def _row_problems(r, cfg, arch) -> list[str]:
    """What is wrong with one compile result: spills, wgmma instructions serialized, shared memory,
    and registers that break the launch plan's residency estimate (``cfg`` is None for the kernels
    outside the forward family)."""
    what = f"{r['kernel']} on {r['arch']}"
    problems = []
    if r["registers"] <= 0:
        problems.append(f"{what}: no ptxas resource line (did it compile?)")
    if r["spill_stores"] or r["spill_loads"] or r["stack"]:
        problems.append(f"{what}: {r['spill_stores']} B spill stores, {r['spill_loads']} B spill loads, "
                        f"{r['stack']} B stack frame")
    if r.get("wgmma_serialized") and r["kernel"] not in WGMMA_SERIALIZED:
        problems.append(f"{what}: ptxas serialized its wgmma instructions (see its C75xx note)")
    if cfg is None:
        return problems
    if r["dynamic_smem"] != cfg.smem_bytes:
        problems.append(f"{what}: dynamic smem {r['dynamic_smem']} != config's {cfg.smem_bytes}")
    if cfg.smem_bytes + r["static_smem"] > dispatch.SMEM_PER_BLOCK[arch]:
        problems.append(f"{what}: {cfg.smem_bytes} + {r['static_smem']} B smem over the sm_{arch} limit")
    if r["registers"] <= 0:  # reported above; no residency to compute
        return problems
    if cfg.threads * (-(-r["registers"] // 8) * 8) > 65536:
        problems.append(f"{what}: {r['registers']} registers x {cfg.threads} threads cannot launch")
    real = dispatch.ctas_per_sm(cfg, arch, r["registers"])
    if real < dispatch.ctas_per_sm(cfg, arch):
        problems.append(f"{what}: {r['registers']} registers allow {real} CTAs per SM but the launch plan "
                        f"assumes {dispatch.ctas_per_sm(cfg, arch)}")
    return problems


# What can make two forward configurations compile differently (registers, spills, shared memory).
_FEATURES = ("elem", "dp", "warps", "mt", "bn", "stages", "qreg", "argmax", "vec", "wgmma", "multi", "packed",
             "split", "tma", "qhalf", "tokm", "residual", "cand", "strided", "x3", "refine", "min_blocks")
ROTATING_PER_ARCH = 12


# sm_86 takes the configurations sm_89 takes (the same shared memory and register file) and ptxas
# treats them alike: sm_89's pair cover builds them, sm_86 only each family's heaviest tile and the
# rotating share, which keeps the cold check within CI's time.
_NO_PAIR_COVER = {86: 89}


def _ci_sample(cfgs: list, seed: int, pair_cover: bool = True, rotating: int = ROTATING_PER_ARCH) -> list:
    """The configurations the CI check builds for one architecture, out of ``cfgs``:
    - with ``pair_cover``, a greedy cover of every pair of feature values that occurs together in
      ``cfgs``, so each flag meets each other flag's values and each tile size at least once;
    - per kernel family (dtype, argmax, several queries a tile, wgmma, split-d, TMA, tokens on M,
      half query stages, residual bits, candidate ids) the tile with the most accumulator and
      fragment state, where spills show
      first;
    - ``rotating`` more (``ROTATING_PER_ARCH``) drawn with ``seed``, so that successive runs reach the rest.
    """
    feats = {c.name: tuple((f, getattr(c, f)) for f in _FEATURES) for c in cfgs}
    pairs = {n: {(a, b) for i, a in enumerate(fs) for b in fs[i + 1:]} for n, fs in feats.items()}
    uncovered = set().union(*pairs.values()) if pairs and pair_cover else set()
    chosen: dict[str, object] = {}
    while uncovered:
        best = max(cfgs, key=lambda c: (len(pairs[c.name] & uncovered), c.name))
        chosen[best.name] = best
        uncovered -= pairs[best.name]
    families: dict[tuple, object] = {}
    for c in sorted(cfgs, key=lambda c: c.name):
        # CTAs an SM in the key: a tile held to 128 registers (two CTAs) spills where the same family
        # at one CTA does not; packed documents, which hold more, win a tie.
        key = (c.elem, c.argmax, c.multi, c.wgmma, c.split, c.tma, c.tokm, c.qhalf, bool(c.residual), c.cand, c.strided,
               c.x3, c.min_blocks)
        weight = (c.dp * c.mt * c.bn, c.warps, c.stages, c.packed)
        if key not in families or weight > families[key][0]:
            families[key] = (weight, c)
    chosen.update((c.name, c) for _, c in families.values())
    rest = sorted(n for n in feats if n not in chosen)
    by_name = {c.name: c for c in cfgs}
    for n in random.Random(seed).sample(rest, min(rotating, len(rest))):
        chosen[n] = by_name[n]
    return list(chosen.values())


PROOFS = pathlib.Path(__file__).parent / "data" / "compile_logs.json.gz"


def _read_proofs() -> dict:
    try:
        with gzip.open(PROOFS, "rt") as f:
            proofs = json.load(f)
    except (OSError, ValueError):
        return {}
    return proofs if isinstance(proofs, dict) else {}


@pytest.fixture(scope="module")
def proofs(request):
    """Seeds the kernel cache from ``PROOFS`` (unless ``LIK_COMPILE_FRESH``); yields the set of cache
    keys the checks add as this run's fixed part, which ``LIK_COMPILE_RECORD=1`` writes to ``PROOFS``
    once the module's checks have passed (a failed check would record a part of the proofs)."""
    if _cached():
        lc.seed_logs(_read_proofs())
    keys: set = set()
    failed = request.session.testsfailed
    yield keys
    if os.environ.get("LIK_COMPILE_RECORD") and keys and request.session.testsfailed == failed:
        _record_proofs(keys)


def _record_proofs(keys: set) -> None:
    """Write the logs of ``keys`` (this run's fixed part, all in the cache now) to ``PROOFS``."""
    logs = {k: lc.cached_log(k) for k in sorted(keys)}
    missing = [k for k, log in logs.items() if log is None]
    assert not missing, f"{len(missing)} builds of this check are not in the kernel cache to record"
    PROOFS.parent.mkdir(exist_ok=True)
    tmp = PROOFS.with_suffix(".tmp")
    with gzip.open(tmp, "wt", compresslevel=9) as f:
        json.dump(logs, f, sort_keys=True, separators=(",", ":"))
    os.replace(tmp, PROOFS)


def _compile_seed() -> int:
    """``LIK_COMPILE_SEED``, else the day's number: a failure names the seed that reproduces it."""
    return int(os.environ.get("LIK_COMPILE_SEED") or datetime.date.today().toordinal())


def test_ci_sample_covers_every_pair_and_family():
    cfgs = dispatch.all_forward_configs(90)
    sample = _ci_sample(cfgs, seed=1)
    assert len(sample) < len(cfgs) // 10
    for f in _FEATURES:  # every value of every feature is built
        assert {getattr(c, f) for c in sample} == {getattr(c, f) for c in cfgs}, f
    assert {c.name for c in _ci_sample(cfgs, seed=1)} == {c.name for c in sample}  # reproducible by seed
    assert {c.name for c in _ci_sample(cfgs, seed=2)} != {c.name for c in sample}  # and rotating


def _families(cfgs: list) -> list:
    """The register-heaviest tile of each kernel family among ``cfgs`` (as ``_ci_sample`` takes them)."""
    families: dict[tuple, tuple] = {}
    for c in sorted(cfgs, key=lambda c: c.name):
        key = (c.argmax, c.multi, c.wgmma, c.split, c.tma, c.tokm, c.qhalf, c.packed, c.cand, c.strided, c.min_blocks)
        weight = (c.dp * c.mt * c.bn, c.warps, c.stages)
        if key not in families or weight > families[key][0]:
            families[key] = (weight, c)
    return [c for _, c in families.values()]


@pytest.mark.parametrize("arch", [89, 90])
def test_fp8_variants_compile_without_spills(arch, proofs):
    # Every FP8 kernel family (its heaviest tile) on the architectures that have e4m3 tensor cores,
    # with the quantiser; the CI check above samples them among the rest.
    spec = dispatch.elem_spec("float8_e4m3fn")
    cfgs = _families([c for c in dispatch.all_forward_configs(arch) if c.elem == spec.code])
    assert {c.wgmma for c in cfgs} == ({True} if arch == 90 else {False})  # sm_90 emulates FP8's mma.sync
    got = lc.check_all([arch], cfgs, other_kernels=False, workers=WORKERS, cache=_cached())
    by_name = {c.name: c for c in cfgs}
    assert {r["kernel"] for r in got} >= set(by_name)
    problems = [p for r in got for p in _row_problems(r, by_name.get(r["kernel"]), arch)]
    from lik_cupy._runtime.kernels import QUANTIZE

    quant = lc.compile_logs([(QUANTIZE.file, d, arch) for d in QUANTIZE.variants], workers=WORKERS, cache=_cached())
    for log in quant:
        problems += _row_problems({"kernel": spec.quantiser_kernel, "arch": f"sm_{arch}",
                                   **lc.resource_usage(log, spec.quantiser_kernel)}, None, arch)
    assert not problems, "\n".join(problems)
    proofs.update(r["key"] for r in got)
    proofs.update(lc.cache_key(QUANTIZE.file, d, arch) for d in QUANTIZE.variants)


def test_check_all_compiles_without_spills(tmp_path, request, proofs):
    archs = list(dispatch.SUPPORTED_ARCHS)
    assert set(archs) >= {80, 86, 89, 90}
    everything = bool(os.environ.get("LIK_COMPILE_ALL"))
    seed = _compile_seed()
    all_cfgs = {arch: dispatch.all_forward_configs(arch) for arch in archs}
    for arch, twin in _NO_PAIR_COVER.items():  # the premise of skipping its cover
        assert {c.name for c in all_cfgs[arch]} <= {c.name for c in all_cfgs[twin]}, (arch, twin)
    built = {arch: (cfgs if everything else _ci_sample(cfgs, seed, arch not in _NO_PAIR_COVER))
             for arch, cfgs in all_cfgs.items()}
    per_arch = {arch: [] for arch in archs}
    rows_all = lc.check_all(archs, built, workers=WORKERS, cache=_cached())
    for r in rows_all:
        per_arch[int(r["arch"][3:].rstrip("a"))].append(r)
    print(f"\ncompile check: seed {seed}, " + ", ".join(
        f"sm_{a} {len(built[a])} of {len(all_cfgs[a])} forward configurations" for a in archs))

    rows, problems = [], []
    for arch in archs:
        cfgs = {c.name: c for c in built[arch]}
        got = per_arch[arch]
        for r in got:  # wgmma kernels build for sm_90a, the rest for the plain architecture
            want = cfgs[r["kernel"]].target(arch) if r["kernel"] in cfgs else None
            assert r["arch"] in ({f"sm_{want}"} if want else {f"sm_{arch}", f"sm_{arch}a"}), r
        names = {r["kernel"] for r in got}
        missing = set(cfgs) - names
        assert not missing, f"sm_{arch}: no compile result for {sorted(missing)[:5]}"
        assert {"lik_sum_partials", "lik_topk_merge", "lik_check_offsets_i32", "lik_check_offsets_i64", "lik_check_range_i32",
                "lik_mask_spans"} <= names
        assert {f"lik_bwd_{k}[elem={e},vec={v}]" for k in ("dq", "keys", "dd_csr", "cast") for e in (0, 1, 2)
                for v in (0, 1)} <= names
        fused = {r["kernel"] for r in got if r["kernel"].startswith("lik_hidden_maxsim")}  # sm_90a alone
        assert len(fused) == (2 * len(HIDDEN_FUSED.variants) if arch == 90 else 0), (arch, sorted(fused))
        seen = set()
        for r in got:
            key = (r["kernel"], r["arch"])
            if key in seen:  # lik_sum_partials is compiled into every module: report it once per arch
                continue
            seen.add(key)
            rows.append(r)
            problems += _row_problems(r, cfgs.get(r["kernel"]), arch)

    table = _table(rows)
    (tmp_path / "compile_check.txt").write_text(table)
    if problems:
        problems.append(f"(reproduce with LIK_COMPILE_SEED={seed})")
    print(f"\ncompile check: {len(rows)} kernels, table in {tmp_path / 'compile_check.txt'}\n{table}")
    request.node.add_report_section("call", "compile table", table)  # shown with -rA, whatever -s says
    assert not problems, "\n".join(problems)
    # the fixed part: the day's rotating share is left out, so that it compiles on later days
    rotating = set()
    for arch, cfgs in all_cfgs.items():
        fixed = {c.name for c in _ci_sample(cfgs, seed, arch not in _NO_PAIR_COVER, rotating=0)}
        rotating |= {(c.name, arch) for c in built[arch] if c.name not in fixed}
    proofs.update(r["key"] for r in rows_all if (r["kernel"], int(r["arch"][3:].rstrip("a"))) not in rotating)


def test_recorded_proofs_are_ptxas_logs_under_cache_keys():
    proofs = _read_proofs()
    if not proofs:
        pytest.skip(f"no recorded proofs at {PROOFS}")
    assert all(re.fullmatch(r"[0-9a-f]{40}", k) and "Compiling entry function" in v for k, v in proofs.items())


@pytest.mark.skipif(not os.environ.get("LIK_COMPILE_ALL_DIMS"),
                    reason="opt-in (LIK_COMPILE_ALL_DIMS=1): 10-15 minutes an architecture on two cores")
@pytest.mark.parametrize("arch", dispatch.SUPPORTED_ARCHS)
def test_every_padded_dim_compiles_without_spills(arch):
    # The CI check above samples dims; every padded dim up to 512 names kernels of its own (their
    # query fragments and staging loops differ), which this builds: the rest of the whole set.
    sampled = {c.name for c in dispatch.all_forward_configs(arch)}
    every = [c for c in dispatch.all_forward_configs(arch, sorted(set(range(16, 513, 16)) | set(DIMS)))
             if c.name not in sampled]
    assert every, "every padded dim adds nothing to the sampled configurations"
    got = lc.check_all([arch], every, other_kernels=False, workers=WORKERS, cache=_cached())
    cfgs = {c.name: c for c in every}
    assert {r["kernel"] for r in got} >= set(cfgs)
    problems = [p for r in got for p in _row_problems(r, cfgs.get(r["kernel"]), arch)]
    assert not problems, f"{len(problems)} problems in {len(every)} kernels:\n" + "\n".join(problems[:40])


# ---------------------------------------------------------------- (b) cache key


@pytest.fixture
def src_copy(tmp_path, monkeypatch):
    copy = tmp_path / "cuda_src"
    shutil.copytree(lc.source_dir(), copy)
    monkeypatch.setattr(lc, "source_dir", lambda: copy)
    return copy


def test_cache_key_covers_every_included_file(src_copy):
    defines = _small_cfg().defines()
    k0 = lc.cache_key(SRC, defines, 80)
    assert k0 == lc.cache_key(SRC, dict(reversed(list(defines.items()))), 80)  # define order is irrelevant

    with open(src_copy / "common.cuh", "a") as f:
        f.write("\n// a comment changes nothing in the code but must change the key\n")
    k1 = lc.cache_key(SRC, defines, 80)
    assert k1 != k0

    with open(src_copy / SRC, "a") as f:
        f.write("\n// edited\n")
    k2 = lc.cache_key(SRC, defines, 80)
    assert k2 not in (k0, k1)

    # includes are followed recursively
    (src_copy / "extra.cuh").write_text("#pragma once\n")
    with open(src_copy / "common.cuh", "a") as f:
        f.write('#include "extra.cuh"\n')
    k3 = lc.cache_key(SRC, defines, 80)
    assert k3 not in (k0, k1, k2)
    (src_copy / "extra.cuh").write_text("#pragma once\n// changed\n")
    k4 = lc.cache_key(SRC, defines, 80)
    assert k4 not in (k0, k1, k2, k3)
    assert lc.cache_key(SRC, defines, 80) == k4  # deterministic

    (src_copy / "extra.cuh").unlink()
    with pytest.raises(FileNotFoundError, match="extra.cuh"):
        lc.cache_key(SRC, defines, 80)


def test_cache_key_names_nvrtcs_build_not_only_its_version(monkeypatch):
    """The key named NVRTC by major.minor alone: 12.9.41 and 12.9.86 shared entries, so a compiler fix
    of a patch release never reached a kernel cached by the release before it."""
    build = lc.nvrtc_build()
    major, minor = lc.nvrtc_version()
    assert re.fullmatch(rf"{major}\.{minor}\.\d+ \(\S+\)", build), build  # release with its patch level, build
    defines = _small_cfg().defines()
    keys = set()
    for b in ("12.9.41 (CL-35404655)", "12.9.86 (CL-36037853)", "12.9.86 (CL-36037854)"):
        monkeypatch.setattr(lc, "nvrtc_build", lambda b=b: b)
        keys.add(lc.cache_key(SRC, defines, 80))
    assert len(keys) == 3


def test_kernels_compile_from_the_sources_their_key_hashes(src_copy, tmp_path, monkeypatch):
    """NVRTC looked up a quoted include in the working directory (the main source's includes) and
    beside the including header before the package's sources, while the key hashed the package's
    file: a ``common.cuh`` in the directory a program ran from (a common name in CUDA projects) or
    a stray header beside one of ours was compiled in and cached under the key of our sources."""
    defines = _small_cfg().defines()
    work = tmp_path / "work"
    (work / "fwd").mkdir(parents=True)
    for name in ("common.cuh", "fwd/config.cuh", "fwd/common.cuh"):
        (work / name).write_text("#error a header of the working directory was compiled in\n")
    monkeypatch.chdir(work)
    assert lc.nvrtc_compile("checks.cu", {}, 80).cubin[:4] == b"\x7fELF"
    assert lc.nvrtc_compile(SRC, defines, 80).cubin[:4] == b"\x7fELF"
    (src_copy / "fwd" / "common.cuh").write_text("#error a header beside fwd/config.cuh was compiled in\n")
    assert lc.nvrtc_compile(SRC, defines, 80).cubin[:4] == b"\x7fELF"


def test_a_source_changed_after_its_key_is_not_cached_under_that_key(src_copy, tmp_path, monkeypatch):
    """The key hashed the sources, then NVRTC read them again: a source edited (or a package
    upgraded in place) in between was cached under the key of the sources before the change."""
    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path / "kc"))
    defines = _small_cfg().defines()
    expected = lc.nvrtc_compile(SRC, defines, 80).cubin
    real_key = lc.cache_key

    def key_then_edit(*a, **k):
        key = real_key(*a, **k)
        with open(src_copy / "common.cuh", "a") as f:
            f.write("\n#define LIK_EDITED_AFTER_THE_KEY 1\nstatic_assert(!LIK_EDITED_AFTER_THE_KEY, \"edited\");\n")
        return key

    monkeypatch.setattr(lc, "cache_key", key_then_edit)
    assert lc.cubin_path(SRC, defines, 80).read_bytes() == expected


def test_cache_key_covers_defines_and_arch():
    defines = _small_cfg().defines()
    k = lc.cache_key(SRC, defines, 80)
    assert lc.cache_key(SRC, {**defines, "LIK_STAGES": defines["LIK_STAGES"] + 1}, 80) != k
    assert lc.cache_key(SRC, {**defines, "LIK_EXTRA": 1}, 80) != k
    assert lc.cache_key(SRC, {k2: v for k2, v in defines.items() if k2 != "LIK_VEC"}, 80) != k
    assert lc.cache_key(SRC, defines, 86) != k
    assert lc.cache_key(SRC, defines, "90a") != lc.cache_key(SRC, defines, 90)
    assert lc.cache_key(SRC, dict(defines), 80) == k


# ---------------------------------------------------------------- (c) disk cache


def test_disk_cache_hit_and_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path / "kc"))
    assert lc.cache_dir() == tmp_path / "kc"
    cfg = _small_cfg()
    p1 = lc.cubin_path(SRC, cfg.defines(), 80)
    assert p1.parent == tmp_path / "kc" and p1.suffix == ".cubin" and p1.stat().st_size > 0
    meta_path = p1.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    assert meta["sha256"] == hashlib.sha256(p1.read_bytes()).hexdigest()
    assert str(meta["arch"]) == "80" and cfg.name in meta["log"]
    m1, mm1 = p1.stat().st_mtime_ns, meta_path.stat().st_mtime_ns

    calls = []
    real = lc.nvrtc_compile
    monkeypatch.setattr(lc, "nvrtc_compile", lambda *a, **k: calls.append(a) or real(*a, **k))
    p2 = lc.cubin_path(SRC, cfg.defines(), 80)
    assert p2 == p1 and not calls  # a hit: nothing compiled, nothing rewritten
    assert p1.stat().st_mtime_ns == m1 and meta_path.stat().st_mtime_ns == mm1

    good = p1.read_bytes()
    with open(p1, "r+b") as f:  # a truncated entry (e.g. a crash mid-copy by another tool)
        f.truncate(len(good) // 2)
    p3 = lc.cubin_path(SRC, cfg.defines(), 80)
    assert p3 == p1 and len(calls) == 1  # detected and rebuilt
    data = p3.read_bytes()
    assert len(data) == len(good)
    assert json.loads(meta_path.read_text())["sha256"] == hashlib.sha256(data).hexdigest()

    p3.write_bytes(b"\0" * len(good))  # same size, wrong bytes
    assert lc.cubin_path(SRC, cfg.defines(), 80).read_bytes() == data and len(calls) == 2
    meta_path.write_text("{not json")  # a broken metadata file also means a rebuild
    assert lc.cubin_path(SRC, cfg.defines(), 80).read_bytes() == data and len(calls) == 3

    left = sorted(p.name for p in (tmp_path / "kc").iterdir())
    assert left == sorted([p1.name, meta_path.name]), left  # no temporary files left behind


def _hostile(kind: str, path: pathlib.Path, other: pathlib.Path) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would wait for a writer for ever
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")  # endless bytes
    elif kind == "directory":
        path.mkdir()
    elif kind == "deep json":
        path.write_text("[" * 100_000 + "]" * 100_000)  # past the JSON parser's recursion limit
    elif kind == "another key's entry":
        shutil.copyfile(other, path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo and symlinks")
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "directory", "deep json", "another key's entry"])
@pytest.mark.parametrize("member", [".json", ".cubin"])
def test_a_hostile_cache_entry_is_compiled_again_not_read(tmp_path, monkeypatch, kind, member):
    """A cache shared with others may hold anything under a key's name: a FIFO blocked the read for
    ever, a link to /dev/zero read until memory ran out, JSON nested too deep raised RecursionError
    on every call, and another kernel's entry copied under this key was taken as this one."""
    if kind == "deep json" and member == ".cubin":
        pytest.skip("the CUBIN is not parsed")
    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path))
    small, other = _small_cfg(), _small_cfg(argmax=True)
    good = lc.cubin_path(SRC, small.defines(), 80).read_bytes()
    theirs = lc.cubin_path(SRC, other.defines(), 80)
    target = tmp_path / (lc.cache_key(SRC, small.defines(), 80) + member)
    if kind == "another key's entry":
        _hostile(kind, target.with_suffix(".cubin"), theirs)
        _hostile(kind, target.with_suffix(".json"), theirs.with_suffix(".json"))
    else:
        if kind == "directory":
            target.unlink()
        _hostile(kind, target, theirs)
    calls = []
    real = lc.nvrtc_compile
    monkeypatch.setattr(lc, "nvrtc_compile", lambda *a, **k: calls.append(a) or real(*a, **k))
    if kind == "directory":  # a directory cannot be replaced by a file: the process's own directory takes it
        with pytest.warns(RuntimeWarning, match="cannot be written"):
            monkeypatch.setattr(lc, "_fallback", None)
            monkeypatch.setattr(lc, "_warned", False)
            path = lc.cubin_path(SRC, small.defines(), 80)
    else:
        path = lc.cubin_path(SRC, small.defines(), 80)
    assert path.read_bytes() == good and len(calls) == 1
    assert lc.cubin_path(SRC, small.defines(), 80).read_bytes() == good and len(calls) == 1  # then a hit


def test_an_unwritable_cache_falls_back_to_a_directory_of_the_process(tmp_path, monkeypatch):
    """LIK_CACHE_DIR naming a file (or a read-only directory): every kernel load raised an OSError
    after compiling; now the kernels go to a directory of the process's own, with one warning."""
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path / "file"))
    monkeypatch.setattr(lc, "_fallback", None)
    monkeypatch.setattr(lc, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"kernel cache .*file \(LIK_CACHE_DIR\) cannot be written") as w:
        a = lc.cubin_path(SRC, _small_cfg().defines(), 80)
        b = lc.cubin_path(SRC, _small_cfg(argmax=True).defines(), 80)
    assert len(w) == 1 and a.parent == b.parent == lc._fallback and a.is_file() and b.is_file()
    assert (tmp_path / "file").read_text() == "x"


def test_a_killed_writers_temporary_is_swept_by_the_next_write(tmp_path, monkeypatch):
    """A compile killed while writing its entry (SIGKILL, the OOM killer) left its temporary in the
    cache for ever; the next write into the cache now removes it, and only it."""
    from lik_cupy import _atomic

    kc = tmp_path / "kc"
    kc.mkdir()
    monkeypatch.setenv("LIK_CACHE_DIR", str(kc))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = _atomic._HOST.decode()
    left = kc / f".{'0' * 40}.cubin.lik-tmp.{dead.pid}.{host}.0123abcd"
    live = kc / f".{'0' * 40}.cubin.lik-tmp.{os.getpid()}.{host}.0123abcd"  # a writer still running
    for p in (left, live):
        p.write_bytes(b"half a cubin")
    path = lc.cubin_path(SRC, _small_cfg().defines(), 80)
    names = sorted(p.name for p in kc.iterdir())
    assert names == sorted([path.name, path.with_suffix(".json").name, live.name]), names


def test_switch_variables_are_read_strictly(monkeypatch):
    from lik_cupy._base import env

    for value, on in [("1", True), ("TRUE", True), (" yes ", True), ("True", True), ("0", False), ("", False),
                      ("No", False), ("false ", False)]:
        monkeypatch.setenv("LIK_VALIDATE", value)
        assert env.validate_strict() is on, value
    for value in ("on", "2", "enabled"):
        monkeypatch.setenv("LIK_DISABLE_TMA", value)
        with pytest.raises(ValueError, match=f"environment variable LIK_DISABLE_TMA is '{value}'; expected 1, true"):
            env.tma_disabled()
    monkeypatch.setenv("LIK_CACHE_DIR", "   ")  # spaces alone: unset, not a directory named by them
    assert lc.cache_dir().name == "kernels" and lc.cache_dir().is_absolute()


def test_cache_dir_expands_a_leading_tilde(tmp_path, monkeypatch):
    """LIK_CACHE_DIR=~/kernels, as a .env file, a systemd unit or a Dockerfile's ENV pass it (no shell
    to expand it), was taken literally: a directory named '~' made under whatever the working
    directory was, so each working directory compiled its own cache."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LIK_CACHE_DIR", "~/kernels")
    assert lc.cache_dir() == tmp_path / "kernels"


def test_compile_check_reads_what_it_proved_and_compiles_what_changed(tmp_path, monkeypatch, src_copy):
    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path / "kc"))
    calls = []
    real = lc.nvrtc_compile
    monkeypatch.setattr(lc, "nvrtc_compile", lambda *a, **k: calls.append(a) or real(*a, **k))
    cfg = _small_cfg()
    rows = lc.check_all([80], [cfg], other_kernels=False)
    assert len(calls) == 1 and rows[0]["kernel"] == cfg.name and rows[0]["registers"] > 0
    assert lc.check_all([80], [cfg], other_kernels=False) == rows and len(calls) == 1  # proven: read back
    assert lc.check_all([80], [cfg], other_kernels=False, cache=False) == rows and len(calls) == 2
    assert [p.suffix for p in (tmp_path / "kc" / "logs").iterdir()] == [".json"]  # no temporary left

    (log,) = (tmp_path / "kc" / "logs").iterdir()
    log.write_text('{"key": "another", "log": ""}')  # damaged or foreign: compiled again and rewritten
    assert lc.check_all([80], [cfg], other_kernels=False) == rows and len(calls) == 3
    assert json.loads(log.read_text())["log"]
    with open(src_copy / "common.cuh", "a") as f:
        f.write("\n// a changed source is a new key\n")
    changed = lc.check_all([80], [cfg], other_kernels=False)
    assert len(calls) == 4 and changed[0]["key"] != rows[0]["key"]
    assert [dict(r, key=None) for r in changed] == [dict(r, key=None) for r in rows]  # the same resources
    assert len(list((tmp_path / "kc" / "logs").iterdir())) == 2

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path / "file"))  # no cache can be written there
    assert lc.check_all([80], [cfg], other_kernels=False) == changed and len(calls) == 5


def test_compile_check_on_several_processes_matches_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path / "kc"))
    cfgs = [_small_cfg(), _small_cfg(argmax=True)]
    serial = lc.check_all([80], cfgs, other_kernels=False, cache=False)
    assert lc.check_all([80], cfgs, other_kernels=False, workers=2, cache=False) == serial
    assert [r["kernel"] for r in serial] == [cfgs[0].name, "lik_sum_partials", cfgs[1].name]
    assert not (tmp_path / "kc").exists()  # cache=False writes nothing


# ---------------------------------------------------------------- (d) compile errors


def test_compile_error_carries_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path / "kc"))
    defines = {**_small_cfg().defines(), "LIK_DP": 15}
    with pytest.raises(lc.CompileError) as ei:
        lc.nvrtc_compile(SRC, defines, 80)
    msg = str(ei.value)
    assert "NVRTC failed to compile maxsim_fwd.cu for sm_80" in msg and "LIK_DP=15" in msg
    assert "DP must be a multiple of 16" in msg  # the static_assert, from the compiler log
    with pytest.raises(lc.CompileError, match="DP must be a multiple of 16"):
        lc.cubin_path(SRC, defines, 80)
    assert not (tmp_path / "kc").exists() or not any((tmp_path / "kc").iterdir())  # nothing cached

    no_name = {k: v for k, v in _small_cfg().defines().items() if k != "LIK_NAME"}
    with pytest.raises(lc.CompileError, match=r"LIK_NAME and the tile macros are set by lik_cupy\._dispatch "
                                              r"\(FwdConfig\.defines\)"):
        lc.nvrtc_compile(SRC, no_name, 80)


def test_resource_usage_parses_each_kernel():
    cfg = _small_cfg(argmax=True)
    out = lc.nvrtc_compile(SRC, cfg.defines(), 90)
    mine, partials = lc.resource_usage(out.log, cfg.name), lc.resource_usage(out.log, "lik_sum_partials")
    assert mine["registers"] > 0 and partials["registers"] > 0
    assert lc.resource_usage(out.log, "no_such_kernel")["registers"] == 0
    assert out.cubin[:4] == b"\x7fELF"
    assert not mine["wgmma_serialized"]
    note = (f"ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized "
            f"due to program dependence on compiler-inserted WG.AR in divergent path in the function '{cfg.name}'\n")
    assert lc.resource_usage(note + out.log, cfg.name)["wgmma_serialized"] == 1
    assert lc.resource_usage(note + out.log, "lik_sum_partials")["wgmma_serialized"] == 0


def test_recorded_proofs_serialize_wgmma_only_where_known():
    # every recorded Hopper build, checked whether or not today's sample compiles it
    logs = _read_proofs()
    if not logs:
        pytest.skip(f"no recorded proofs at {PROOFS}")
    serialized = {name for log in logs.values() for name in re.findall(r"Compiling entry function '([^']+)'", log)
                  if lc.resource_usage(log, name)["wgmma_serialized"]}
    assert serialized <= WGMMA_SERIALIZED, sorted(serialized - WGMMA_SERIALIZED)


# ---------------------------------------------------------------- (e) dispatch


DIMS = sorted({1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 96, 100, 127, 128, 129, 160, 191, 192, 200,
               255, 256, 257, 300, 320, 384, 400, 448, 500, 511, 512, 513, 640, 768, 1000, 1023, 1024, 2048, 3001,
               4096, 8192})


def _dims(dtype, dims=DIMS):
    """The dims a dtype's kernels take: int8 needs a multiple of 16 up to 4096."""
    return [d for d in dims if dispatch.elem_spec(dtype).dim_ok(d)]


@pytest.mark.parametrize("cc", [80, 86, 87, 89, 90])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_choose_forward_fits_shared_memory(cc, dtype):
    arch = dispatch.arch_of(cc)
    limit = dispatch.SMEM_PER_BLOCK[arch]
    for dim in _dims(dtype):
        for lq in (1, 31, 32, 33, 64, 65, 128, 1000, 5000):
            for argmax in (False, True):
                for vec in (False, True):
                    for wgmma in (True, False):
                        c = dispatch.choose_forward(cc, dtype, dim, lq, argmax, vec, wgmma)
                        where = (cc, dtype, dim, lq, argmax, vec, wgmma, c.name)
                        assert c.smem_bytes <= limit, where
                        if c.split:  # any dim streams through fixed chunks (rows past 128 bytes)
                            assert c.dp in (32, 64, 128) and dim * c.esize > 128, where
                        else:
                            assert not c.split or dtype != "int8", where
                            assert c.dp == dispatch.padded_dim(dim, c.spec) >= dim and c.dp <= 512 and c.dp % 16 == 0, where
                        assert c.elem == dispatch.elem_spec(dtype).code and c.argmax == argmax and c.vec == vec, where
                        assert c.bn % 16 == 0 and c.stages >= 2 and c.threads <= 1024, where
                        assert not c.wgmma or (wgmma and arch == 90 and vec), where
    with pytest.raises(ValueError):
        dispatch.choose_forward(cc, dtype, dispatch.MAX_DIM + 1, 32, False, True)
    if dtype == "int8":
        for bad in (8, 100, 4096 + 16):
            with pytest.raises(ValueError, match="multiple of 16 up to 4096"):
                dispatch.choose_forward(cc, dtype, bad, 32, False, True)


def test_compile_check_covers_the_bucket_dims():
    # everything dispatch picks for the dims all_forward_configs samples is compiled by check_all
    for arch in dispatch.SUPPORTED_ARCHS:
        compiled = {c.name for c in dispatch.all_forward_configs(arch)}
        for spec in (e for e in dispatch.ELEMS if arch >= e.min_arch):
            dtype = spec.name
            for dim in _dims(dtype, (64, 128, 256, 384, 512, 1000, 2048, 4096, 8192)):
                for lq in (1, 32, 33, 64, 65, 128, 1000, 5000):
                    for shared, ld in ((1, 1024), (1, 180), (3, 180), (32, 180), (32, 1024), (1000, 77)):
                        for argmax in (False, True):
                            for vec in (False, True):
                                for wg in (True, False):
                                    for tma in (False, True):
                                        try:
                                            c = dispatch.choose_forward(arch, dtype, dim, lq, argmax, vec, wg, shared,
                                                                        ld, False, tma)
                                        except ValueError:
                                            if arch in spec.emulated_mma:  # refused: only emulated tiles would take it
                                                continue
                                            raise
                                        assert c.name in compiled, (arch, dtype, dim, lq, shared, ld, argmax, vec, wg,
                                                                    tma, c.name)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_tma_only_where_the_kernels_take_it(dtype):
    # TMA stages whole 128-byte rows into swizzled tiles: sm_90, aligned rows, one-shot, 16-bit or
    # int8 (not the fp32 lds path); int8's argmax keeps cp.async on the wgmma tiles (it spills), and
    # so does a single query of at most 128 tokens on them (measured slower). Split-d stages both
    # chunks by TMA on the two-warpgroup tiles (any 16-byte aligned dim: the maps zero-fill past
    # the row), never on the one-warpgroup short-query tiles (measured slower).
    esize = dispatch.elem_spec(dtype).bytes
    for cc in (80, 86, 89, 90):
        for dim in _dims(dtype, (32, 64, 96, 128, 192, 256, 384, 512, 1000, 2048)):
            for lq, shared in ((1, 1), (32, 1), (32, 32), (128, 1), (1000, 1)):
                for argmax in (False, True):
                    for vec in (False, True):
                        c = dispatch.choose_forward(cc, dtype, dim, lq, argmax, vec, True, shared, 300, False, True)
                        # float32: its wgmma tiles take TMA for single short queries too (measured
                        # faster), its mma.sync tiles never (the lds path)
                        one_shot = (not c.split and dim * esize % 128 == 0
                                    and not (c.wgmma and dtype == "int8" and argmax)
                                    and not (c.wgmma and not c.multi and lq <= 128 and dtype != "float32"))
                        split = c.split and c.wgmma and c.warps == 8
                        want = cc == 90 and vec and (dtype != "float32" or c.wgmma) and (one_shot or split)
                        assert c.tma == want, (cc, dim, lq, shared, argmax, vec, c.name)
                        assert c.target(dispatch.arch_of(cc)) == ("90a" if c.tma or c.wgmma else str(cc))
                        off = dispatch.choose_forward(cc, dtype, dim, lq, argmax, vec, True, shared, 300, False, False)
                        # INT8 split-d with the argmax of several queries spills on the cp.async wgmma
                        # tiles, so without TMA it takes the portable ones.
                        int8_fallback = dtype == "int8" and c.split and argmax and shared > 1
                        assert not off.tma and off.split == c.split and (off.wgmma == c.wgmma or int8_fallback)
                        if not c.split:  # split-d tiles differ with their staging (the sweep's order)
                            assert off.bn == c.bn and off.stages == c.stages


@pytest.mark.xfail(
    strict=True,
    reason="CI compiles a sample of dims (64/128/256/384/512 and the split-d widths; 96 for INT8): "
    "choose_forward pads dim to a multiple of 16 and each padded dim names its own kernels, so e.g. "
    "lik_maxsim_fwd_*_d112_* is built only by the opt-in test_every_padded_dim_compiles_without_spills",
)
def test_compile_check_covers_every_dispatchable_config():
    missing = set()
    for arch in dispatch.SUPPORTED_ARCHS:
        compiled = {c.name for c in dispatch.all_forward_configs(arch)}
        for dtype in (e.name for e in dispatch.ELEMS):
            for dim in _dims(dtype):
                for lq in (1, 33, 65):
                    c = dispatch.choose_forward(arch, dtype, dim, lq, False, True)
                    if c.name not in compiled:
                        missing.add((arch, c.name))
    assert not missing, f"{len(missing)} configurations are never compile-checked, e.g. {sorted(missing)[:4]}"


def test_arch_of():
    assert [dispatch.arch_of(c) for c in (80, 86, 87, 89, 90)] == [80, 86, 87, 89, 90]
    with pytest.raises(RuntimeError, match="not supported"):
        dispatch.arch_of(75)


@pytest.mark.parametrize("nd", [1, 7, 65535, 65536, 10**6, 2**24 + 3, 10**9, 2**31 - 1])
@pytest.mark.parametrize("nq,lq", [(1, 32), (3, 300), (1000, 64)])
def test_plan_launch_grid_limits(nd, nq, lq):
    for cc, sms in ((80, 108), (86, 84), (89, 128), (90, 132)):
        for dtype in ("float16", "float32"):
            for shared in (1, nq):
                cfg = dispatch.choose_forward(cc, dtype, 128, lq, False, True, True, shared)
                plan = dispatch.plan_launch(cfg, cc, sms, nq, nd, lq, shared)
                gx, gy, gz = plan.grid
                assert 1 <= gy <= 65535 and gz == 1, (cc, nd, plan)
                if plan.qb > 1:  # whole queries share a tile
                    assert plan.n_qt == 1 and plan.qb * lq <= cfg.bm and plan.qb <= nq
                    assert gx == -(-nq // plan.qb)
                else:
                    assert plan.n_qt * cfg.bm >= lq > (plan.n_qt - 1) * cfg.bm
                    assert gx == nq * plan.n_qt
                assert gy * plan.docs_per_cta >= nd > (gy - 1) * plan.docs_per_cta  # every doc covered, no idle row


def _problem(nq, lq, nd, ld, packed=False):
    from lik_cupy._validate import Problem

    return Problem(framework="cupy", device=0, dtype="float16", nq=nq, lq=lq, nd=nd, ld=0 if packed else ld, dim=1,
                   candidates=False, scores_shape=(nq, nd), argmax_shape=(nq, nd, lq), q_valid=None,
                   d_valid="offsets" if packed else None, d_packed=packed, ntok=nd * ld if packed else 0)


def test_forward_refuses_counts_whose_last_indices_pass_int32():
    # Nd = 2**31 - 1 padded documents (4 GB at d = 1 in fp16) pass the per-count check, but the plan's
    # last CTA starts at document 2**31 - 2 with a run of 32,769: its int end (j0 + docs_per_cta)
    # wrapped negative, the CTA scored nothing and the last score was never written. Lq or Ld within
    # a tile of 2**31 - 1 took a tile's rows or tokens (and a masked document's mask reads) past it.
    from lik_cupy._runtime.launch import check_extents

    cfg = dispatch.choose_forward(90, "float16", 16, 1, False, False, False, 1)
    nd = 2**31 - 1
    plan = dispatch.plan_launch(cfg, 90, 132, 1, nd, 1, 1)
    assert (plan.grid[1] - 1) * plan.docs_per_cta < nd <= plan.grid[1] * plan.docs_per_cta
    assert (plan.grid[1] - 1) * plan.docs_per_cta + plan.docs_per_cta >= 2**31  # what the kernel's int held
    with pytest.raises(ValueError, match=rf"Nd \+ {plan.docs_per_cta} \(a CTA's run of documents past the last\) = "
                                         rf"{nd + plan.docs_per_cta} does not fit the kernel's 32-bit index"):
        check_extents(_problem(1, 1, nd, 1), plan)
    for lq, ld, name in ((2**31 - 100, 1, "Lq"), (1, 2**31 - 100, "Ld")):
        plan = dispatch.plan_launch(cfg, 90, 132, 1, 1, lq, 1)
        with pytest.raises(ValueError, match=rf"{name} \+ 1024 \(a tile's .* past the last\) = {2**31 + 924} "):
            check_extents(_problem(1, lq, 1, ld), plan)
    # packed documents: a block's search of the offsets past Nd (their CTAs take shares of tokens)
    plan = dispatch.plan_launch(cfg, 90, 132, 1, 2**31 - 1000, 1, 1)
    with pytest.raises(ValueError, match=r"Nd \+ 1024 \(a block.s search of the offsets past the last\) = 2147483672 "):
        check_extents(_problem(1, 1, 2**31 - 1000, 1, packed=True), plan)
    # what fits passes: the largest counts of each with room for their last tile and run
    plan = dispatch.plan_launch(cfg, 90, 132, 1, 2**31 - 1025, 1, 1)
    check_extents(_problem(1, 1, 2**31 - 1025, 1, packed=True), plan)
    for nd in (1, 10**9, 2**31 - 40_000):
        plan = dispatch.plan_launch(cfg, 90, 132, 1, nd, 1, 1)
        check_extents(_problem(2**31 - 1, 2**31 - 1025, nd, 2**31 - 1025), plan)


@pytest.mark.parametrize("nq,lq", [(1, 32), (2, 100), (1, 300), (40, 32), (1000, 32)])
@pytest.mark.parametrize("nd,ntok", [(1, 0), (1, 100), (3, 257), (10, 5000), (62, 253_952), (1000, 269_332),
                                     (50, 10**9)])
def test_plan_launch_token_split(nq, lq, nd, ntok):
    # Packed documents scored by single-query one-shot tiles split into token shares: one wave of
    # CTAs for at most a quarter wave of query tiles and at most a quarter as many documents as
    # the CTAs a query tile may have, whole-document CTAs for at most half the SMs, each share at
    # least _SPLIT_MIN_TILES tiles.
    for cc, sms in ((80, 108), (90, 132)):
        for dtype in ("float16", "int8", "float32"):
            for packed in (False, True):
                cfg = dispatch.choose_forward(cc, dtype, 128, lq, False, True, True, 1, 300, packed)
                plan = dispatch.plan_launch(cfg, cc, sms, nq, nd, lq, 1, ntok)
                gx, gy, _ = plan.grid
                resident = sms * dispatch.ctas_per_sm(cfg, cc)
                shares = min(resident // gx, -(-ntok // (dispatch.tables.SPLIT_MIN_TILES * cfg.bn)))
                want = cfg.token_split and ntok > 0 and gx * 4 <= resident and nd * 4 <= resident // gx \
                    and 2 * gx * nd <= sms and shares > 1
                assert plan.token_split == want, (cc, dtype, packed, plan)
                if want:
                    assert gy == shares and gx * gy <= min(resident, dispatch.SPLIT_MAX_CTAS)
                else:
                    assert plan == dispatch.plan_launch(cfg, cc, sms, nq, nd, lq, 1)
    # The scratch layout the host sizes (token_split.nbytes) is the one the kernel fixes.
    src = (pathlib.Path(__file__).parent.parent / "cuda_src" / "fwd" / "tile_scheduler.cuh").read_text()
    assert f"#define LIK_SPLIT_COUNTS {dispatch.SPLIT_MAX_CTAS} " in src
    # refined argmax tiles keep a third array (split_res: the maxima's residues), sized by the host too
    assert "split_res(void* buf, int bm)" in src
    ctas, bm = 7, 128
    assert token_split.nbytes(ctas, bm, True, True) - token_split.nbytes(ctas, bm, True) == ctas * 2 * bm * 4
    assert token_split.nbytes(ctas, bm, False, True) == token_split.nbytes(ctas, bm, False)
    if (nq, lq, nd, ntok) == (1, 32, 62, 253_952):  # the sweep's case that splits
        cfg = dispatch.choose_forward(90, "float16", 128, 32, False, True, True, 1, 300, True)
        assert dispatch.plan_launch(cfg, 90, 132, 1, 62, 32, 1, 253_952).token_split
    # Which tiles split: packed one-shot single-query 16-bit and INT8 tiles, and float32's wgmma ones
    # (not its mma.sync ones), not split-d, not multi-query.
    assert dispatch.choose_forward(90, "float16", 128, 32, False, True, True, 1, 300, True).token_split
    assert dispatch.choose_forward(80, "bfloat16", 128, 32, True, True, False, 1, 300, True).token_split
    assert dispatch.choose_forward(90, "int8", 128, 32, False, True, True, 1, 300, True).token_split
    assert not dispatch.choose_forward(90, "int8", 2048, 32, False, True, True, 1, 300, True).token_split
    assert not dispatch.choose_forward(90, "float16", 128, 32, False, True, True, 1, 300, False).token_split
    assert dispatch.choose_forward(90, "float32", 128, 32, False, True, True, 1, 300, True).token_split
    assert dispatch.choose_forward(90, "float32", 128, 32, False, True, True, 1, 300, True, False, True).token_split
    assert not dispatch.choose_forward(80, "float32", 128, 32, False, True, True, 1, 300, True).token_split
    assert not dispatch.choose_forward(90, "float16", 128, 32, False, True, True, 32, 300, True).token_split
    assert not dispatch.choose_forward(90, "float16", 2048, 32, False, True, True, 1, 300, True).token_split


# One run on an H200 (d = 128, fp16, one query, bench/suites/bench_small_grid.py): (Lq, Ld, B, padded
# ms with whole documents, ms of the same documents packed through maxsim_varlen's token split), the
# measurements tables.PADDED_SPLIT_MIN_LD cites.
def _split_evidence():
    """(run, dtype, Lq, Ld, B, whole ms, split ms) of each one-query cell of the committed A/B runs
    behind tables.PADDED_SPLIT_MIN_LD (bench_small_grid.py --ab: fp16 on an H200 and an H100, INT8
    on the H100)."""
    cells = []
    for run, dtype in (("nvidia-h200", "float16"), ("nvidia-h100-80gb-hbm3", "float16"),
                       ("int8_nvidia-h100-80gb-hbm3", "int8")):
        data = json.loads((pathlib.Path(__file__).parent / "data" / f"small_grid_ab_{run}.json").read_text())
        # (a cell whose forced split could not split ran the same launch twice: no evidence)
        cells += [(run, dtype, c["Lq"], c["Ld"], c["B"], c["ms"]["padded_whole"], c["ms"]["padded_split"])
                  for c in data["cells"] if c["Nq"] == 1 and "padded_whole" in c["ms"] and "padded_split" in c["ms"]
                  and c["padded_split_grid"] != c["padded_whole_grid"]]
    return cells


@pytest.mark.parametrize("run,dtype,lq,ld,b,whole_ms,split_ms", _split_evidence())
def test_padded_token_split_rule_follows_the_measurements(run, dtype, lq, ld, b, whole_ms, split_ms):
    # The rule splits padded documents where the split measured at least 10% faster, never where
    # it measured more than 5% slower (H200 and H100 SXM: 132 SMs, the Hopper tiles dispatch picks
    # there), and always where it measured twice as fast.
    cfg = dispatch.choose_forward(90, dtype, 128, lq, False, True, True, 1, ld, False, True).strided_tile
    split = dispatch.plan_launch(cfg, 90, 132, 1, b, lq, 1, b * ld).token_split
    if split:
        assert split_ms < 0.9 * whole_ms
    if split_ms > 1.05 * whole_ms:
        assert not split
    if split_ms < 0.5 * whole_ms:  # the cases issue 30 is about
        assert split


@pytest.mark.parametrize("nq,lq", [(1, 32), (2, 100), (1, 300), (3, 1024), (40, 32)])
@pytest.mark.parametrize("nd,ld", [(1, 1), (1, 40_000), (3, 4096), (8, 4095), (5, 16_384), (62, 32_768),
                                   (300, 32_768)])
def test_plan_launch_padded_token_split(nq, lq, nd, ld):
    # Padded documents split under the packed rule's grid conditions from PADDED_SPLIT_MIN_LD tokens,
    # on the padded tile's strided twin (16-bit and INT8 single-query one-shot tiles only; a
    # tokens-on-M INT8 tile's twin has the query rows on M, as below TOKM_MIN_LD).
    for cc, sms in ((80, 108), (90, 132)):
        for dtype in ("float16", "bfloat16", "int8", "float32"):
            for shared in (1, nq):
                cfg = dispatch.choose_forward(cc, dtype, 128, lq, False, True, True, shared, ld, False, cc == 90)
                strided = cfg.strided_tile
                if strided is None:  # float32 splits on its wgmma tiles only
                    assert (dtype == "float32" and not cfg.wgmma) or cfg.multi or cfg.split
                    continue
                assert (dtype != "float32" or cfg.wgmma) and strided.packed and strided.token_split
                assert strided.name.endswith("_strided") and strided.name != cfg.name
                base = dataclasses.replace(strided, packed=False, strided=False)
                if cfg.tokm:
                    assert base == dataclasses.replace(cfg, tokm=False, stages=2) == cfg.queries_on_m
                    below = dispatch.choose_forward(cc, dtype, 128, lq, False, True, True, shared,
                                                    dispatch.tables.TOKM_MIN_LD - 1, False, True)
                    assert base == dataclasses.replace(below, tma=True)  # (tokens-on-M tiles take TMA at any Lq)
                    cfg = base
                assert base == cfg
                assert strided.smem_bytes == cfg.smem_bytes
                assert strided.min_blocks == (1 if strided.int8_argmax_strided else cfg.min_blocks)
                plan = dispatch.plan_launch(strided, cc, sms, nq, nd, lq, shared, nd * ld)
                whole = dispatch.plan_launch(strided, cc, sms, nq, nd, lq, shared)
                rows = whole.grid[0]
                resident = sms * dispatch.ctas_per_sm(strided, cc)
                min_ld = dispatch.tables.PADDED_SPLIT_MIN_LD[0 if strided.bm <= 64 else 1]
                shares = min(resident // rows, -(-nd * ld // (dispatch.tables.SPLIT_MIN_TILES * strided.bn)))
                want = rows * 4 <= resident and nd * 4 <= resident // rows and 2 * rows * nd <= sms and ld >= min_ld \
                    and shares > 1
                assert plan.token_split == want, (cc, dtype, plan)
                if want:
                    assert plan.grid == (rows, shares, 1) and rows * shares <= dispatch.SPLIT_MAX_CTAS
    assert dispatch.padded_split_min_ld(dispatch.choose_forward(90, "float16", 128, 32, False, True).strided_tile) \
        == dispatch.tables.PADDED_SPLIT_MIN_LD[0]
    with pytest.raises(ValueError, match="token-split tile"):
        dispatch.FwdConfig(elem=2, dp=128, warps=4, mt=1, bn=64, stages=2, qreg=False, argmax=False, vec=True,
                           packed=True, strided=True)


# ---------------------------------------------------------------- (f) the split-d table

SWEEP = os.path.join(os.path.dirname(__file__), "data", "sweep_split_d_nvidia-h100-80gb-hbm3.json")
TOKM_SWEEP = os.path.join(os.path.dirname(__file__), "data", "sweep_int8_tokm_nvidia-h100-80gb-hbm3.json")
SHORT_SWEEP = os.path.join(os.path.dirname(__file__), "data", "sweep_short_nvidia-h200.json")
SPLIT_SHORT_SWEEP = os.path.join(os.path.dirname(__file__), "data", "sweep_split_short_nvidia-h100-80gb-hbm3.json")


@pytest.mark.parametrize("dim", [520, 640, 1000, 2048, 4096, 8192])
def test_wide_dims_always_split(dim):
    # no one-shot tile holds more than 512 columns, on any architecture or query length
    for cc in (80, 86, 89, 90, 120):
        for lq in (1, 32, 77, 1024):
            for wg in (True, False):
                for dtype in ("float16", "bfloat16", "float32"):  # int8 stops at 512 (no split-d)
                    assert dispatch.choose_forward(cc, dtype, dim, lq, False, True, wg).split


@pytest.mark.parametrize("cc", [80, 86, 89, 90, 120])
def test_split_table_per_bucket_and_arch(cc):
    arch = dispatch.arch_of(cc)
    for dim in dispatch.DIM_BUCKETS:
        for lq in (32, 1024):
            for wg in (True, False):
                c = dispatch.choose_forward(cc, "float16", dim, lq, False, True, wg)
                hopper = wg and arch == 90 and lq > 64
                arch_key, family = dispatch.split_family(arch, hopper, dim)
                start = dispatch.tables.SPLIT_FROM.get((arch_key, family, lq <= 64), dispatch.tables.SPLIT_FROM_DEFAULT)
                assert c.split == (dim > 512 or dim >= start), (cc, dim, lq, wg, c.name)
                # short queries: one warpgroup on Hopper for rows of 128 or 256 bytes, and split-d
                short = wg and arch == 90 and lq <= 64 and (dim in (64, 128) or c.split)
                assert c.wgmma == (hopper or short), (cc, dim, lq, wg, c.name)
                assert c.warps == 4 if short else True, (cc, dim, lq, wg, c.name)
    if arch not in (80, 86, 89, 90):  # unknown GPUs: split-d only where one-shot cannot run
        assert all((arch, f, s) not in dispatch.tables.SPLIT_FROM for f in ("mma", "wgmma") for s in (True, False))
        assert not dispatch.choose_forward(cc, "float16", 512, 1024, False, True).split


def test_short_query_tiles_match_the_committed_sweep():
    # each padded single-query case of the sweep: dispatch's tile is within 3% of the fastest
    with open(SHORT_SWEEP) as f:
        rows = json.load(f)["rows"]
    checked = 0
    for r in rows:
        m = re.fullmatch(r"(fp16|int8) (\d+)x(\d+) B=(\d+)", r["case"])
        if not m:
            continue
        dtype = {"fp16": "float16", "int8": "int8"}[m.group(1)]
        times = {t["config"]: t["ms"] for t in r["tiles"] if "ms" in t}
        chosen = dispatch.choose_forward(90, dtype, 128, int(m.group(2)), False, True, True, 1, int(m.group(3)),
                                         False, True).name
        assert chosen in times, (r["case"], chosen)
        assert times[chosen] <= 1.03 * min(times.values()), (r["case"], chosen, times[chosen], min(times.values()))
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("shape,lq", [("colpali", 1024), ("textual", 32)])
def test_split_table_matches_the_committed_sweep(shape, lq):
    # At every dim of the sweep (one-shot and split-d, TMA and cp.async candidates), what the
    # tables choose on an sm_90 with TMA is within 5% of the fastest configuration measured.
    with open(SWEEP) as f:
        rows = [r for r in json.load(f)["rows"] if "ms" in r and r["shape"] == shape and r["config"]
                and r["impl"] not in ("ours", "flash_maxsim", "lik")]
    by_dim: dict = {}
    for r in rows:
        by_dim.setdefault(r["dim"], {})[r["config"]] = r["ms"]
    assert len(by_dim) >= 5, f"the sweep has {len(by_dim)} {shape} dims"
    for dim, times in by_dim.items():
        chosen = dispatch.choose_forward(90, "float16", dim, lq, False, True, tma=True).name
        if chosen.endswith("_qh"):  # half query stages: their own sweep (the next test)
            continue
        assert chosen in times, (dim, chosen, sorted(times))
        assert times[chosen] <= 1.05 * min(times.values()), (dim, chosen, times[chosen], min(times.values()))


def test_short_split_table_matches_the_committed_sweep():
    # A single query of <= 32 tokens at split-d widths: the tile chosen is within 3% of the fastest
    # measured (best of the sweep's rounds), and every candidate gave the dispatch pick's bits.
    with open(SPLIT_SHORT_SWEEP) as f:
        rows = json.load(f)["rows"]
    best: dict = {}
    for r in rows:
        if r["config"].startswith("lik_"):
            assert r["bitwise_equal_to_dispatch"], r
            key = (r["lq"], r["ld"], r["dim"])
            best.setdefault(key, {})
            best[key][r["config"]] = min(r["ms"], best[key].get(r["config"], float("inf")))
    assert len(best) >= 4
    for (lq, ld, dim), times in best.items():
        chosen = dispatch.choose_forward(90, "float16", dim, lq, False, True, ld=ld, tma=True).name
        assert chosen.endswith("_qh") and chosen in times, (lq, dim, chosen)
        assert times[chosen] <= 1.03 * min(times.values()), (lq, dim, chosen, times[chosen], min(times.values()))


def test_int8_tokens_on_m_rule_matches_the_committed_sweep():
    # One INT8 query of Lq >= 100 on an sm_90 with TMA: at every shape of the sweep, the tile
    # dispatch picks is within 3% of the fastest INT8 candidate measured, and the tokens-on-M
    # tiles are taken exactly from Ld = 512 (never with argmax, several short queries per tile,
    # dim 256, or without TMA).
    with open(TOKM_SWEEP) as f:
        rows = [r for r in json.load(f)["rows"] if r["config"].startswith("lik_")]
    shapes: dict = {}
    for r in rows:
        shapes.setdefault((r["lq"], r["ld"]), {})[r["config"]] = r["ms"]
    assert len(shapes) >= 6
    for (lq, ld), times in shapes.items():
        chosen = dispatch.choose_forward(90, "int8", 128, lq, False, True, True, 1, ld, False, True)
        assert chosen.tokm == (ld >= 512), (lq, ld, chosen.name)
        assert chosen.name in times, (lq, ld, chosen.name)
        assert times[chosen.name] <= 1.03 * min(times.values()), (lq, ld, chosen.name, min(times.values()))
    for args in (("int8", 128, 1024, True, True, True, 1, 1024, False, True),  # argmax
                 ("int8", 128, 32, False, True, True, 32, 1024, False, True),  # several queries per tile
                 ("int8", 256, 1024, False, True, True, 1, 1024, False, True),  # dots past 2^22
                 ("int8", 128, 1024, False, True, True, 1, 1024, False, False),  # no TMA
                 ("float16", 128, 1024, False, True, True, 1, 1024, False, True)):
        assert not dispatch.choose_forward(90, *args).tokm, args
    assert dispatch.choose_forward(90, "int8", 128, 1024, False, True, True, 1, 1024, True, True).tokm  # packed


DOC_COST_SWEEPS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "data", "sweep_doc_cost_*.json")))


def test_doc_cost_matches_the_committed_sweeps():
    # The work a packed document counts for beside its tokens (FwdConfig.doc_cost, in tiles of the
    # kernel's document tokens) is within 5% of the fastest variant measured on every corpus (median
    # over the committed runs), and at least twice as fast as shares of tokens alone where the
    # lengths drift along the corpus.
    one, many = (dispatch.choose_forward(90, "float16", 128, 32, False, True, True, nq, 264, True) for nq in (1, 32))
    tiles = one.doc_cost / one.bn
    assert many.multi and many.doc_cost == many.bn * tiles  # the sweep's two kernels
    runs: dict = {}
    for path in DOC_COST_SWEEPS:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                runs.setdefault((r["case"], r["queries"]), {}).setdefault(r["variant"], []).append(r["us"])
    assert len(DOC_COST_SWEEPS) >= 2 and len(runs) >= 8
    chosen = f"{tiles:g} tiles"
    for key, variants in runs.items():
        med = {v: statistics.median(ts) for v, ts in variants.items() if v.endswith(" tiles")}
        assert med[chosen] <= 1.05 * min(med.values()), (key, med)
        if key[0].startswith("500 x 16, then"):
            assert 2 * med[chosen] <= med["0 tiles"], (key, med)


@pytest.fixture
def fake_hopper(monkeypatch):
    """``warmup`` on a stand-in sm_90 GPU (TMA usable): the kernels it would load, as (source, defines, target)."""
    from lik_cupy._base.device import DeviceProps
    from lik_cupy._runtime import launch, warmup

    monkeypatch.setattr(warmup, "gpu_available", lambda: True)
    monkeypatch.setattr(warmup, "present", int)
    monkeypatch.setattr(warmup, "device_properties", lambda dev: DeviceProps("stand-in H100", 90, 132))
    monkeypatch.setattr(launch, "tma_usable", lambda: not os.environ.get("LIK_DISABLE_TMA"))
    loaded = []
    monkeypatch.setattr(lc, "get_module", lambda name, defines, target, dev, entry=None: loaded.append(
        (name, defines.get("LIK_NAME", entry), str(target))))
    monkeypatch.delenv("LIK_DISABLE_WGMMA", raising=False)
    monkeypatch.delenv("LIK_DISABLE_TMA", raising=False)
    return loaded


def test_warmup_loads_the_kernels_calls_choose(fake_hopper, monkeypatch):
    """warmup(dtypes=("float8_e4m3fn",)) on an sm_90 GPU raised ValueError ('float8_e4m3fn on sm_90 runs on
    its wgmma tiles only'): it also chose for unaligned operands, which no FP8 kernel there takes (such a
    call is refused). And under LIK_DISABLE_WGMMA=1 it loaded the wgmma tiles, which calls then never
    run, instead of the mma.sync ones they do."""
    from lik_cupy import warmup

    assert warmup(dims=(128,), dtypes=("float8_e4m3fn",), device=0) == len(fake_hopper) > 0
    want = {dispatch.choose_forward(90, "float8_e4m3fn", 128, lq, False, True, True, tma=True).name for lq in (32, 1024)}
    assert want <= {k for _, k, _ in fake_hopper}

    fake_hopper.clear()
    monkeypatch.setenv("LIK_DISABLE_WGMMA", "1")
    warmup(dims=(128,), dtypes=("float16",), device=0)
    assert fake_hopper and all(target == "90" for _, _, target in fake_hopper), fake_hopper
    want = {dispatch.choose_forward(90, "float16", 128, lq, False, vec, False).name for lq in (32, 1024)
            for vec in (True, False)}
    assert {k for _, k, _ in fake_hopper} == want


def test_token_split_drop_oldest_survives_a_key_moved_meanwhile(monkeypatch):
    """_drop_oldest waits for the device, which lets other threads run; one moving that same buffer to
    the back (its pop, then its re-insert, outside the lock) could leave the key out of the dict just
    then, and the drop's `del` raised KeyError in the thread that was only making a new buffer."""
    import sys
    import types

    key = (0, 111)

    def sync():  # another thread, mid-move: popped, not yet re-inserted
        token_split._buffers.pop(key)

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda d: contextlib.nullcontext(),
                                                            runtime=types.SimpleNamespace(deviceSynchronize=sync)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(token_split, "_buffers", {key: object(), (0, 222): object()})
    token_split._drop_oldest()
    assert list(token_split._buffers) == [(0, 222)]
