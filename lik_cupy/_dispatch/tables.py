"""The measured tuning tables of the forward kernels, as literal data.

Each table says which tiles to try first for a class of problems; ``select.py`` reads them and
``plan.py`` reads the grid constants. The comment above each table names the sweep behind it
(``tests/data/`` holds the sweeps tests check the rules against; the rest are in
``bench/results/archive/``). Re-tuning means editing a table here and committing the sweep beside it.
"""

from __future__ import annotations

# Smallest dim bucket that runs split-d (dim chunks streamed through the ring
# with the document tiles) rather than one-shot (the whole dim of the query tile
# staged once), keyed by (architecture, kernel family, short query). Families:
#   "wgmma"  Hopper, one-shot wgmma (dim a multiple of 64) against split-d wgmma;
#   "wgmma-odd"  Hopper, other dims: one-shot mma.sync against split-d wgmma;
#   "mma"    mma.sync both ways (every other GPU, short queries, fp32, unaligned rows).
# Short = at most 64 query rows per tile. From bench/results/archive/sweep_split_d_nvidia-h200.json
# (fp16, ColPali Lq=Ld=1024 B=128 and textual Lq=32 Ld=180 B=1024):
#   - wgmma: one-shot 0.062/0.120 ms at d=128/256 vs split 0.080/0.144; split
#     0.207 ms at 384 vs one-shot 0.242. With TMA staging on both sides the same split holds
#     (sweep_split_d_nvidia-h100-80gb-hbm3.json): one-shot 0.091 vs split 0.105 ms at d=256,
#     split 0.146 vs one-shot 0.164 at 384.
#   - short queries on Hopper: one-shot (mma.sync, TMA) and the one-warpgroup split tiles are
#     level at d=384/512 (0.0525 vs 0.0521, 0.0684 vs 0.0679 ms on the H100), so split-d
#     starts where one-shot tiles stop fitting.
#   - wgmma-odd: split wgmma beats one-shot mma.sync already at d=128 (0.080 vs 0.102 ms).
#   - mma, long queries: split 0.222 ms at 256 vs one-shot 0.236, and 0.32 vs 0.55 at 384;
#     short queries: one-shot stays ahead through 512 (0.059 vs 0.074 ms).
# The mma rows of sm_80/86/89 reuse the H200 measurement of the same kernels (no such GPU
# was measured), fp32 reuses the 16-bit rows. An architecture not listed splits only
# above 512, where one-shot tiles stop fitting.
SPLIT_FROM: dict[tuple[int, str, bool], int] = {
    (90, "wgmma", False): 384, (90, "wgmma-odd", False): 128,
    (80, "mma", False): 256, (80, "mma", True): 1024,
    (86, "mma", False): 256, (86, "mma", True): 1024,
    (89, "mma", False): 256, (89, "mma", True): 1024,
    (90, "mma", False): 256, (90, "mma", True): 1024,
}
SPLIT_FROM_DEFAULT = 1024

# Split-d tiles, best first. Hopper: (bn, dim chunk, stages).
# - Two warpgroups x 64 query rows, both chunks of a stage staged by TMA (the default on an
#   sm_90 with a CUDA 12+ driver): 256-token tiles at four stages lead at every split bucket,
#   704-766 TF/s from d=384 to 2048 against 605-667 for the best 128-token tile and 462-575 for
#   cp.async staging (sweep_split_d_nvidia-h100-80gb-hbm3.json; one-shot TMA tiles give 749 at
#   d=256).
# - The same staged by cp.async (TMA turned off), by dim bucket: 128-token tiles at three
#   stages (two CTAs per SM) up to 1024, 256-token tiles (one CTA, a third less traffic per MMA)
#   from 2048 (sweep_split_d_nvidia-h200.json: 1.08 vs 1.11 ms at 2048, 2.27 vs 2.33 at 4096).
# - One warpgroup (64 rows) for a short query: memory-bound, 64-token tiles six stages deep by
#   cp.async stream D at 2.8-2.9 TB/s on an H100, 3-30% ahead of 128- and 256-token tiles, of
#   TMA staging (whose whole-box copies pay for the rows past each document) and of the
#   mma.sync split tiles (same sweep, textual Lq=32, Ld=180, d=768..2048).
# - A single query of at most 32 tokens stages 32 query rows per stage instead of 64 (qhalf:
#   12 KB a stage at 64 x 64): 128-dim chunks four stages deep are fastest or within 1% of it
#   from d=768 to 4096 on an H100, 2-4% ahead of the 64-row stages and level with flash-maxsim
#   (0.98-1.04x; sweep_split_short_nvidia-h100-80gb-hbm3.json, textual Lq=32 and 20, Ld=180).
# mma.sync: (warps, mt, bn, dim chunk, stages) keyed by (fp32, query-length bucket); fp32
# chunks are 32 wide so a stage's bytes match.
WGMMA_SPLIT_TMA = ((256, 64, 4), (256, 64, 3), (128, 64, 4))
WGMMA_SPLIT_NARROW = ((128, 64, 3), (256, 64, 4), (128, 128, 3))
WGMMA_SPLIT_WIDE = ((256, 64, 4), (128, 64, 3))
WGMMA_SPLIT_WIDE_FROM = 2048
WGMMA_SPLIT_SHORT = ((64, 64, 6), (64, 64, 4))
WGMMA_SPLIT_SHORT_QHALF = ((64, 128, 4), (64, 64, 8), (64, 64, 4))
SPLIT_TABLE: dict[tuple[bool, int], tuple[tuple[int, int, int, int, int], ...]] = {
    (False, 32): ((2, 1, 64, 64, 4), (2, 1, 64, 64, 3)),
    (False, 64): ((4, 1, 64, 64, 4), (4, 1, 64, 64, 3)),
    (False, 128): ((4, 2, 128, 64, 3), (4, 2, 128, 32, 4), (4, 2, 64, 64, 3)),
    (True, 32): ((2, 1, 64, 32, 4), (2, 1, 64, 32, 3)),
    (True, 64): ((4, 1, 64, 32, 4), (4, 1, 64, 32, 3)),
    (True, 128): ((4, 2, 64, 32, 3), (4, 2, 32, 32, 3)),
}


# (warps, mt, bn, stages) in order of preference, keyed by
# (16-bit or fp32, dim bucket, query-length bucket). Short queries use short
# row tiles so no tensor-core work is spent on padding rows; long queries use
# 32 rows per warp so each staged document fragment feeds two mma.
MMA_TABLE: dict[tuple[bool, int, int], tuple[tuple[int, int, int, int], ...]] = {
    # fp16 / bf16. d <= 128 at 32 rows: four stages 4-5% ahead of three (sweep_tiles_nvidia-h200.json)
    (False, 64, 32): ((2, 1, 64, 4), (2, 1, 64, 3), (2, 1, 32, 3)),
    (False, 64, 64): ((4, 1, 64, 3), (4, 1, 32, 3)),
    (False, 64, 128): ((4, 2, 64, 3), (4, 2, 32, 3), (4, 2, 32, 2)),
    (False, 128, 32): ((2, 1, 64, 4), (2, 1, 64, 3), (2, 1, 32, 3)),
    (False, 128, 64): ((4, 1, 64, 3), (4, 1, 32, 3)),
    (False, 128, 128): ((4, 2, 64, 3), (4, 2, 32, 3), (4, 2, 32, 2)),
    (False, 256, 32): ((2, 1, 64, 3), (2, 1, 32, 2)),
    (False, 256, 64): ((8, 1, 64, 3), (8, 1, 64, 2), (4, 1, 32, 3), (4, 1, 32, 2)),
    (False, 256, 128): ((8, 1, 64, 3), (8, 1, 64, 2), (4, 1, 32, 3), (4, 1, 32, 2)),
    (False, 512, 32): ((2, 1, 64, 2), (2, 1, 32, 2)),
    (False, 512, 64): ((4, 1, 64, 2), (4, 1, 32, 2), (2, 1, 32, 2)),
    (False, 512, 128): ((4, 1, 64, 2), (4, 1, 32, 2), (2, 1, 32, 2)),
    # fp32 on tf32
    (True, 64, 32): ((2, 1, 64, 3), (2, 1, 32, 2)),
    (True, 64, 64): ((4, 1, 64, 3), (4, 1, 32, 2)),
    (True, 64, 128): ((4, 1, 64, 3), (4, 1, 32, 2)),
    (True, 128, 32): ((2, 1, 64, 3), (2, 1, 32, 2)),
    (True, 128, 64): ((4, 1, 64, 3), (4, 1, 32, 2)),
    (True, 128, 128): ((4, 1, 64, 3), (4, 1, 32, 2)),
    (True, 256, 32): ((2, 1, 32, 2), (2, 1, 16, 2), (1, 1, 16, 2)),
    (True, 256, 64): ((4, 1, 32, 2), (2, 1, 32, 2), (2, 1, 16, 2), (1, 1, 16, 2)),
    (True, 256, 128): ((4, 1, 32, 2), (2, 1, 32, 2), (2, 1, 16, 2), (1, 1, 16, 2)),
    (True, 512, 32): ((2, 1, 32, 2), (2, 1, 16, 2), (1, 1, 16, 2)),
    (True, 512, 64): ((4, 1, 32, 2), (2, 1, 32, 2), (2, 1, 16, 2), (1, 1, 16, 2)),
    (True, 512, 128): ((4, 1, 32, 2), (2, 1, 32, 2), (2, 1, 16, 2), (1, 1, 16, 2)),
}


# 3xTF32 one-shot tiles (precision "fp32"), (warps, mt, bn, stages) by query-length bucket, tried
# before the fp32 rows of MMA_TABLE (bench/results/archive/sweep_x3_nvidia-h200.json, d = 128):
# every warp splits the whole staged document tile into TF32 halves for its own rows, so two
# m-tiles per warp (32 rows) at 32 query tokens and eight warps at 128+ pay that once for more
# MMAs: 16% less time than the TF32 pick at 32 x 300 and 32 x 1024, 32-39% at 128 x 1024 and
# 1024 x 1024. (The argmax of several queries at d >= 256 skips the two m-tile row: it spills on
# sm_80; select.choose_forward.)
X3_TABLE: dict[int, tuple[tuple[int, int, int, int], ...]] = {
    32: ((2, 2, 32, 3),),
    64: ((4, 1, 64, 3),),
    128: ((8, 1, 64, 3), (4, 2, 64, 3)),
}

# Hopper warpgroup-MMA tiles; 8 warps = 2 warpgroups x 64 query rows. Relative
# cost per staged document token of each tile width, so that a shorter tile wins
# where it pads documents less (Ld=180: 192 tokens in 64- or 96-token tiles
# against 256).
# - One query per tile, from bench/results/archive/sweep_tiles_nvidia-h200.json:
#   128-token tiles run 12-17% faster per token than 64-token ones.
# - Several short queries per tile, from bench/results/archive/sweep_bn_multiquery_nvidia-h200.json
#   (32 queries of 32 tokens, Ld 128..512): 96-token tiles about 10% faster per
#   token than 64, and 128 (one CTA per SM at three stages) 17-30% slower.
# 128-token tiles: two stages (two CTAs per SM, one's epilogue hiding under the other's
# MMA) beat three at Lq = 128, 512 and 1024 (7-10%, sweep_tiles_nvidia-h200.json).
WGMMA_BN_COST = {128: 1.0, 64: 1.12}
WGMMA_BN_COST_MULTI = {96: 0.9, 64: 1.0, 128: 1.25}


WGMMA_STAGES = {128: (2, 3), 96: (3, 2), 64: (3, 2)}


# One warpgroup (4 warps, 64 query rows) for queries of at most 64 rows, from
# tests/data/sweep_short_nvidia-h200.json: a single query streams D at 4.1-4.5 TB/s on these
# tiles against 3.7-4.1 on the portable mma.sync tiles (8-15% less time at Lq = 32 and 64,
# Ld = 180..1024, padded and packed, INT8 too); two warpgroups (half their rows padding) and
# TMA staging were slower. Relative cost per staged document token: 64- and 128-token tiles
# are within 2% of each other on long documents, so the shorter one wins where it pads less;
# INT8's 64-token tiles ran 22% slower (Ld = 1024). Measured at d = 128 (256-byte rows), the
# widest rows this rule takes. By element type (every one with wgmma tiles has a row).
_SHORT_WGMMA_COST_16BIT = {64: 1.0, 128: 0.98}
# FP8 takes INT8's row (the same one-byte tiles): on an H200 its picks ran within 1% of the best of
# seven (tokens, stages) candidates in each of bench_fp8.py's cells (32 x 300 and 32 x 1,024 against
# 10,000 documents, ColPali 1,024 x 1,030 x 1,000: tests/data/sweep_fp8_nvidia-h200.json).
_SHORT_WGMMA_COST_8BIT = {128: 1.0, 64: 1.22}
SHORT_WGMMA_COST = {"float16": _SHORT_WGMMA_COST_16BIT, "bfloat16": _SHORT_WGMMA_COST_16BIT, "int8": _SHORT_WGMMA_COST_8BIT,
                    "float8_e4m3fn": _SHORT_WGMMA_COST_8BIT, "float32": {64: 1.0, 128: 1.0}}
SHORT_WGMMA_STAGES = {64: (4, 3), 128: (2, 3)}
# float32 (TF32 wgmma, d = 128): 64-token tiles two stages deep by TMA lead, 64 and 128 tokens at
# two or three stages within 1% (0.0411-0.0416 ms for 32 tokens x 1,000 documents of 300, H200);
# four stages (one CTA an SM) 16% behind (bench/results/latest/fp32_wgmma_sweep_nvidia-h200.json).
SHORT_WGMMA_STAGES_TF32 = {64: (2, 3), 128: (3, 2)}
# Refined float32 (the default's float32 accuracy on TF32 wgmma) for queries of at most
# REFINE_TOKM_MAX_LQ tokens, one a tile, without the argmax, against documents of REFINE_TOKM_MIN_LD
# tokens or more: one-warpgroup tiles of 64 x 64 with the document tokens on M (LIK_TOKM with
# LIK_REFINE, cuda_src/fwd/refine_m.cuh), their stage counts in order of preference (empty: never).
# From bench/results/latest/refine_tokm_sweep_nvidia-h200.json (one query, d = 128, Ld 128 to
# 2,048, padded and packed, 300,000 tokens a cell): at 32 query tokens 0.80-0.93 of the time of
# the queries-on-M refined tile, the same bits; at 64, 1.00-1.15 (twice the exact work at each
# document's end). Three stages (one CTA an SM) took 1.6-1.9x two.
REFINE_TOKM_STAGES = (2,)
REFINE_TOKM_MAX_LQ = 32
REFINE_TOKM_MIN_LD = 128
# FP8 tiles of a short single query (at most 128 tokens) stage documents by TMA with the argmax, or
# when the documents are packed or padded to fewer than FP8_SHORT_TMA_BELOW_LD tokens; by cp.async
# otherwise (other 16-bit and 8-bit types: cp.async; select.py, _wgmma_tma). From
# bench/results/archive/fp8_short_tma_nvidia-h200/ (a 32-token query, d = 128), scores: padded
# 1,000 x 300 and 10,000 x 180 11-13% faster on TMA, 10,000 x 512, 768 and 1,024 6-8% slower, packed
# 10-35% faster at 180, 300 and 1,024; with the argmax, padded 10-12% faster at 180, 300 and 1,024.
FP8_SHORT_TMA_BELOW_LD = 512
# float32 at precision "tf32" on the one-warpgroup tile (a query of at most 64 tokens) stages padded
# documents of this many tokens or more by cp.async, shorter or packed ones by TMA; the refined tiles
# (the default's float32 accuracy) always by TMA. From
# bench/results/archive/f32_short_tma_nvidia-h200/ab_f32_tiles.json (one query, d = 128, H200, kernel
# ms, TMA against cp.async): padded 32 x 300 0.0414 against 0.0424; 32 x 512 0.0684 against 0.0638,
# 768 0.1005 against 0.0937, 1,024 0.1329 against 0.1214 (64 tokens: 0.1331 against 0.1217; with the
# argmax 0.1350 against 0.1292), 2,048 0.1331 against 0.1213 (500 documents); packed 1,024 within 1.3%
# either way; the refined tiles 20% slower by cp.async.
TF32_SHORT_TMA_BELOW_LD = 512
# float32 at precision "tf32", one query of 65-128 tokens (the two-warpgroup tile), scores only, against
# documents of TF32_MID_MIN_LD tokens or more: this (tokens, stages) first. From
# bench/results/archive/f32_short_tma_nvidia-h200/ab_f32_bn96.json (d = 128, H200, kernel ms, 96
# tokens against the 128 chosen before): 80, 100 and 128 query tokens x 1,000 documents of 1,024
# 0.1254-0.1258 against 0.1320-0.1322, of 768 0.0949 against 0.0999, 500 of 2,048 0.1261-0.1264
# against 0.1321-0.1323, 10,000 of 1,024 1.179 against 1.241, packed 0.1319 against 0.1365; at 512
# tokens 2% slower (64 tokens three stages deep led there by 1%), with the argmax 5% slower.
TF32_MID_TILE = (96, 2)
TF32_MID_MIN_LD = 768
# Keyed by element bytes: float32 (TF32 wgmma) takes d = 128 too, whose 512-byte rows stage as many
# tokens per byte as a 16-bit d = 256.
SHORT_WGMMA_MAX_ROW_BYTES = {1: 256, 2: 256, 4: 512}


# INT8 tiles with document tokens on the wgmma M side (LIK_TOKM in cuda_src/fwd/config.cuh), from
# tests/data/sweep_int8_tokm_nvidia-h100-80gb-hbm3.json: per-token scales in registers and one
# fused multiply-add per similarity make Lq >= 100 against documents of 512+ tokens 2-11% faster
# than the best standard tile (ColPali 1024 x 1024: 8%), two to five stages within 3%; the
# cross-warp max each document costs makes them level at Ld = 300 and 13% slower at 180. They
# need the dot products below 2^22 (dim <= 224) and TMA's 128-byte rows, so d = 128.
TOKM_MIN_LD = 512
TOKM_STAGES = 4


# Documents one CTA streams (about, at most): a longer run fills and drains its ring less often, a
# shorter one leaves a smaller last wave. From bench/results/archive/sweep_docs_per_cta_nvidia-h100-80gb-hbm3.json:
# 128 makes 32 queries of 32 tokens against 20,000-100,000 documents of 180 tokens 1-2% faster than
# 32 (top-100 retrieval too), 8 and 16 are 2-5% slower, and single-query, ColPali and ragged shapes
# do not change. One wave (a run of every document a CTA will ever see) gained another 0.5%, but
# leaves the grid no slack when fewer CTAs are resident than planned (another kernel beside it).
DOCS_PER_CTA = 128


# Token split (packed documents, single-query tiles, at most a quarter of a wave of query tiles,
# at most a quarter as many documents as the CTAs a query tile may have, and whole-document CTAs
# for at most half the SMs: INT8's small tiles, several to an SM, passed the second test at 128
# documents of 4,096 tokens, where one CTA a document already fills the GPU and the split took
# 0.050 ms against 0.043 whole; small_grid_ab_int8_nvidia-h100-80gb-hbm3.json): the grid's y side
# cuts the corpus into equal token shares, one wave in all, each share at least this many document
# tiles. Whole-document CTAs leave most of the wave idle when documents are that few: one query
# against 62 documents of 4,096 tokens took 33.5 us that way and 24.5 us split (flash-maxsim:
# 36.9). Merging the pieces of split documents costs about 5 us at the end of the kernel, so
# corpora of more documents keep whole-document CTAs: 128 of 2,000 tokens 23.7 us whole against
# 24.5 split, 1,000 of 16..512 tokens 26.7 against 28.8 (H200,
# bench/results/archive/sweep_token_split_nvidia-h200.json; on an H100, _h100-80gb-hbm3.json: 62 of
# 4,096 36.0 whole, 30.7 split, flash-maxsim 38.7; 128 of 2,000 28.6 whole, 31.0 split).
SPLIT_MIN_TILES = 4
SPLIT_MAX_CTAS = 4096  # CTAs of one token-split launch at most (the arrival counts it may use)


# PLAID residual documents (cuda_src/fwd/residual.cuh): (warps, mt, bn, stages) in order of
# preference, keyed by query-length bucket (rows of a tile: 32, 64, 128). Decompressing a tile's
# tokens costs far more instructions than its MMA, so the tiles favour resident CTAs over query
# rows: four warps of 16 rows even for a 32-token query, 32-token tiles three stages deep. Two rows
# of 16 per warp spilled with the argmax on sm_80 (compile check), so long queries take eight
# warps. The last rows are for wide dims where the first do not fit. The first sweep
# (bench/results/latest/residual_nvidia-h200.json, 4,096 candidates of 32-token queries, d = 128)
# timed two warps of 16-token tiles 5-45% faster than the first row; they lead once the GPU tests
# have covered them at these dims (they only ran on wide dims so far).
RESIDUAL_TILES: dict[int, tuple[tuple[int, int, int, int], ...]] = {
    32: ((4, 1, 32, 3), (4, 1, 64, 3), (2, 1, 32, 3), (2, 1, 16, 3)),
    64: ((4, 1, 32, 3), (4, 1, 64, 3), (2, 1, 32, 3), (2, 1, 16, 3)),
    128: ((8, 1, 32, 3), (8, 1, 64, 3), (4, 1, 32, 3), (2, 1, 32, 3), (2, 1, 16, 3)),
}

# Token split of padded documents (LIK_STRIDED: the packed path's shares over padded token
# positions, FwdConfig.strided_tile), under the packed rule's grid conditions, from this padded
# length up: (query tiles of at most 64 rows, longer ones). Whole-document CTAs stream a
# document's Ld tokens each, so one query against a few long pages leaves most SMs idle. From
# tests/data/small_grid_ab_nvidia-h200.json (bench_small_grid.py --ab, fp16, d = 128, one query,
# the split and whole plans of the same tile in one run): at 4,096 tokens the split takes 0.009-0.024
# ms against 0.024-0.032 whole (32 query tokens, 1 to 64 documents), 0.012-0.022 against 0.030
# (256 tokens, 1 to 32) and 0.012-0.021 against 0.030 (1,024 tokens, 1 to 8); at 32,768 tokens
# 0.014-0.213 against 0.18-0.22. At 1,024 tokens it gains nothing (equal, or up to 2x slower on
# one or two documents), so it starts at 4,096 for every tile. The H100 run beside it
# (small_grid_ab_nvidia-h100-80gb-hbm3.json) agrees: 5-12% slower split at 1,024 tokens, 0.37-0.50
# of whole at 4,096 up to 32 documents of 32 query tokens. A tokens-on-M INT8 tile splits on its
# queries-on-M twin (FwdConfig.queries_on_m) under the same rule.
PADDED_SPLIT_MIN_LD = (4096, 4096)


# The fused head's one-pass forward (cuda_src/hidden_maxsim.cu; sm_90a, d = 128, 16-bit): the query rows
# (Nq * Lq) are its second product's N, padded to the first width here that holds them; more rows take the
# streamed pipeline (cuBLAS, normalisation, MaxSim kernels). A CTA's HIDDEN_FUSED_WARPGROUPS warpgroups take
# 64 rows of H each; its TMA ring holds HIDDEN_FUSED_STAGES stages of their rows and W's 128, 64 hidden
# elements each (40 KiB a stage). Two warpgroups took 7% longer than three, and three stages 18% longer than
# four, which five matched (an H200, bf16, 1 x 32 query tokens against 300,000 rows of h = 768:
# bench/results/archive/hidden_maxsim_variants_nvidia-h200/results.json).
HIDDEN_FUSED_QN = (32, 64)
HIDDEN_FUSED_WARPGROUPS = 3
HIDDEN_FUSED_STAGES = 4
