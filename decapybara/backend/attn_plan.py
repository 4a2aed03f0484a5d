"""Work planning of paged attention (decapybara/kernels/attn_prefill.cu, decapybara/kernels/attn_decode.cu): pure
arithmetic, so the split rules are tested on any machine (tests/test_attn_plan.py);
decapybara/backend/cupy_attention.py turns the plans into device metadata and launches,
decapybara/backend/cuda_graph.py sizes its decode graphs by them.

A work item is a tile of `block_m` query rows (row = token * g + head in group, g = nq / nkv) of one sequence
over a key range [begin, end); long ranges are split (split-K, "flash decoding") so that 1..12 decoding
sequences still fill the GPU, and the reduce merges the parts in order. `DECODE` holds the tensor-core decode
kernel's settings: its switch and launch shapes (read by cupy_attention) and the split rule of its plans
(`decode_splits`).
"""

from __future__ import annotations

import os

import numpy as np

BLOCK_N = 32  # keys per tile (one per lane)
MIN_KEYS_PER_SPLIT = 64  # general kernel: short decode contexts still spread over many CTAs
# decode kernel: on / off; warps per CTA and 16-key tiles in flight per warp (lowered to fit the shared
# memory) for bf16 pages, and (mx_warps, mx_stages) for microscaled ones; accumulator chains of the scores;
# the split rule of its plans (`decode_splits`): "min_keys", "fill_ctas" / "fill_eff", "short_keys" /
# "short_ctas"; "graph_cap" the most splits a decode graph takes (0: `graph_split_cap`'s rule); "mixed" 1: the
# decode rows of a mixed step (sequences of one new token beside chunks) run the decode kernel too, planned as a
# pure decode batch of them, rather than 128-row CTAs of the prefill kernel (env DECAPYBARA_DECODE_MIXED=0: off);
# "gate" 1: a pure decode plan's qwen3_5 output gate in the decode kernel's final items and attention_reduce
# (cupy_attention `gate_fuses`), 0: in a launch of its own after them; "verify_one_pass" 1: a verification
# graph's two tokens a sequence attend in one decode-kernel launch (and one reduce), each (sequence, token) a
# one-token sequence of the plan, where 0 runs a launch (and a reduce) a token (env
# DECAPYBARA_VERIFY_ONE_PASS=0; decapybara/backend/cuda_graph.py `_one_pass`)
DECODE = {"enabled": os.environ.get("DECAPYBARA_DECODE_ATTN", "1") != "0", "warps": 4, "stages": 3,
          "mx_warps": 4, "mx_stages": 3, "chains": 2, "min_keys": 512, "fill_ctas": 128, "fill_eff": 0.8,
          "short_keys": 128, "short_ctas": 32, "graph_cap": 0,
          "mixed": int(os.environ.get("DECAPYBARA_DECODE_MIXED", "1") != "0"), "gate": 1,
          "verify_one_pass": int(os.environ.get("DECAPYBARA_VERIFY_ONE_PASS", "1") != "0")}
# tensor-core prefill kernel (attn_prefill.cu PREFILL_TC) for every other batch over bf16 or microscaled pages:
# on / off (env DECAPYBARA_PREFILL_ATTN=0); keys a tile for head_dim <= 128 and for larger; "split" 1 carries
# q and P as two bf16 terms each (~16 bits, as the decode kernel), 0 as one (env DECAPYBARA_PREFILL_SPLIT=0:
# FlashAttention's precision, ~3e-3 of the output's scale; 27B layer at 16k 6.45 -> 5.05 ms, a 2,048-token chunk
# at 30k 5,439 -> 5,944 tok/s);
# "wg" 1 takes its warpgroup-MMA build (PREFILL_WG) on Hopper for head_dim 64 / 128 / 256 (env
# DECAPYBARA_PREFILL_WG=0: the mma.sync build everywhere); "warps" 4 or 8 a CTA (64 or 128 query rows: each K / V
# tile read from L2 serves twice the rows); "stages" 1 to 3 (K, V) tile pairs in shared memory over bf16 pages
# (2 or 3: a ring, tile t + stages requested after tile t), "mx_stages" over microscaled pages the kernel decodes
# itself (its loads are not asynchronous: 1 was fastest); "overlap" 1: the wgmma build over a ring of 3 runs tile
# t + 1's softmax beside P(t) V(t) (TC_OVERLAP); 27B layer at 16k: 9.03 ms (mma.sync, 4 warps, 1 stage) -> 6.86
# (wgmma, 8 warps, 2 stages) -> 6.42 (the overlap; docs/perf.md);
# "dequant_tokens": over microscaled pages, the sequences of a plan with at least this many new tokens read their
# pages through bf16 scratch pages decoded once a layer (cupy_attention.dequant_pages; the others, short runs and
# decode rows the decode kernel does not take, in a second launch over the pages themselves; 0: none, env
# DECAPYBARA_PREFILL_DEQUANT=0), their K and V scratch at most "dequant_mb" MiB (262,144 tokens of the 27B shape;
# past it the keys are taken in windows that keep each window's scratch under it, `plan_work`'s `windows`; the
# split-K partial sums, one part a window at least, are not counted): 16 new tokens after 16k
# (one CTA a page, 27B, 6/4 pages) already gained 0.211 -> 0.183 ms a layer, 2,048 tokens 15.0 -> 6.46 ms;
# "diag" the kernel's TC_DIAG (measurement only: wrong results when set; bench/profile_step.py)
PREFILL = {"enabled": os.environ.get("DECAPYBARA_PREFILL_ATTN", "1") != "0", "block_n": 64, "block_n_wide": 32,
           "split": int(os.environ.get("DECAPYBARA_PREFILL_SPLIT", "1") != "0"),
           "wg": int(os.environ.get("DECAPYBARA_PREFILL_WG", "1") != "0"), "warps": 8, "stages": 3, "mx_stages": 1,
           "overlap": 1,
           "dequant_tokens": 16 if os.environ.get("DECAPYBARA_PREFILL_DEQUANT", "1") != "0" else 0,
           "dequant_mb": 1024, "diag": 0}
PREFILL_WG_HEAD_DIMS = (64, 128, 256)
PREFILL_ROWS_PER_WARP = 16  # its CTAs: PREFILL "warps" warps of 16 query rows
DECODE_WAVES = 8  # eager decode plans: at most this many CTAs per SM (one resident each; decode_splits' cap)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_floor(n: int) -> int:
    """The largest power of two <= max(1, n)."""
    return 1 << (max(1, n).bit_length() - 1)


def rows_per_warp(head_dim: int, max_rows: int) -> int:
    """Smallest of 1, 2, 4, 8 rows per warp covering `max_rows` rows in one CTA, capped so that a lane holds
    at most 32 accumulators (rows x head_dim / 32)."""
    cap = max(1, min(8, 32 // -(-head_dim // 32)))
    rpw = 1
    while rpw < cap and 4 * rpw < max_rows:
        rpw *= 2
    return rpw


def decode_splits(per_split: int, keys: int, sms: int, pow2: bool = False, cap: int = 0, per_sm: int = 1) -> int:
    """Key splits of a decode-kernel launch whose one split has `per_split` CTAs (sequences x row tiles x KV
    heads), over ranges of up to `keys` keys, on `sms` SMs holding `per_sm` of its CTAs each (`decode_per_sm`),
    by DECODE's rule (`bench/attn_decode.py` ATTN_MIN_KEYS, bf16 pages, one CTA an SM: long splits over about
    one wave beat many short ones, e.g. one sequence at 32k 48 us in 32 splits against 74 in 64, four 131 us in
    8 against 185 in 64; 6/4-bit pages, three CTAs an SM, want three times the CTAs):
    - no split shorter than "min_keys" keys (a CTA's setup, merge and partial write amortised);
    - within that, the fewest splits that bring the launch to "fill_ctas" x `per_sm` CTAs, more while its CTAs
      fill less than "fill_eff" of the slots of their waves (CTAs / (waves x SMs x `per_sm`); twelve sequences
      at 27B shapes over bf16 pages: 8 splits and 384 CTAs in graphs, 5 and 240 in eager plans; "fill_ctas" 0:
      no fill rule, as many splits as "min_keys" allows);
    - but a launch of fewer than "short_ctas" CTAs splits further, down to "short_keys" keys a split (one
      sequence at 1k: 8 splits of 128 keys rather than 2 of 512).
    `pow2`: a power of two (graphs are captured per count); `cap` > 0: at most that many."""
    def floor(n: int) -> int:
        return pow2_floor(n) if pow2 else max(1, n)

    def ceil(n: int) -> int:
        n = max(1, n)
        return 1 << (n - 1).bit_length() if pow2 else n

    by_keys, slots = floor(keys // DECODE["min_keys"]), sms * max(1, per_sm)
    n = by_keys
    if DECODE["fill_ctas"] > 0:
        n = ceil(cdiv(DECODE["fill_ctas"] * max(1, per_sm), per_split))
        while n < by_keys and n * per_split / (cdiv(n * per_split, slots) * slots) < DECODE["fill_eff"]:
            n = 2 * n if pow2 else n + 1
        n = min(n, by_keys)
    if per_split * n < DECODE["short_ctas"]:
        n = max(n, min(ceil(cdiv(DECODE["short_ctas"], per_split)), floor(keys // DECODE["short_keys"])))
    return max(1, min(n, cap) if cap > 0 else n)


def graph_split_cap(per_split: int, sms: int, per_sm: int = 1) -> int:
    """Most key splits a decode graph captures for a launch whose one split has `per_split` CTAs, on `sms` SMs
    holding `per_sm` of its CTAs each: 32, or as many as one wave holds where that is more, as a power of two
    (graphs are captured per count). At 27B shapes (4 KV heads: 4 CTAs a split and sequence) over bf16 pages
    (one CTA an SM) that is 32; over microscaled pages (three) one sequence gets 64 (27B steps at 1 x 32k over
    6/4 pages 2-4% faster in one interleaved run, within the spread in another), while two sequences keep 32
    (64 was 5% slower there: a second wave under a third full; docs/perf.md, fifteenth session).
    DECODE["graph_cap"] > 0 replaces the rule (measurement), rounded down to a power of two."""
    if DECODE["graph_cap"] > 0:
        return pow2_floor(int(DECODE["graph_cap"]))
    return max(32, pow2_floor(sms * max(1, per_sm) // max(1, per_split)))


def plan_work(lengths: list[int], contexts: list[int], g: int, nkv: int, block_m: int,
              splits: int | None = None, waves: int = 2, min_keys: int = MIN_KEYS_PER_SPLIT,
              decode_per_sm: int = 0, *, sms: int,
              windows: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(work [nwork, 5] int32: seq, row0, key_begin, key_end, part (-1: final output); reduce [nreduce, 4]
    int32: seq, row0, first part, number of parts; number of parts) for sequences of `lengths` new tokens on top
    of `contexts`, on a GPU of `sms` SMs. `splits` forces the number of key splits per tile (tests); else
    `decode_splits` for the decode kernel (`decode_per_sm` > 0: its CTAs an SM; at most `waves` CTAs per SM;
    `min_keys` is DECODE's), or about `waves` CTAs per SM with no split shorter than `min_keys` keys. Splits
    are whole BLOCK_N-key tiles, so the count may come out lower than asked. `windows` (per sequence, a multiple
    of BLOCK_N or 0): that sequence's key ranges are also cut at every multiple of its window, so that no item
    reads keys of two windows (the prefill kernel's scratch pages hold one window's at a time)."""
    tiles = []
    for si, (n, ctx) in enumerate(zip(lengths, contexts)):
        rows = n * g
        for row0 in range(0, rows, block_m):
            last_token = (min(rows, row0 + block_m) - 1) // g
            tiles.append((si, row0, ctx + last_token + 1))
    target = waves * sms
    work, reduce, parts = [], [], 0
    for si, row0, kend in tiles:
        if splits is not None:
            n = splits
        elif decode_per_sm > 0:
            n = decode_splits(len(tiles) * nkv, kend, sms, cap=cdiv(target, len(tiles) * nkv),
                              per_sm=decode_per_sm)
        else:
            n = min(cdiv(target, len(tiles) * nkv), max(1, kend // min_keys))
        n = max(1, min(n, cdiv(kend, BLOCK_N)))
        chunk = cdiv(cdiv(kend, n), BLOCK_N) * BLOCK_N
        window = windows[si] if windows is not None else 0
        assert window % BLOCK_N == 0, f"window of {window} keys: whole {BLOCK_N}-key tiles"
        cuts = sorted(set(range(0, kend, chunk)) | (set(range(window, kend, window)) if window else set()))
        if len(cuts) == 1:
            work.append((si, row0, 0, kend, -1))
            continue
        reduce.append((si, row0, parts, len(cuts)))
        for b, e in zip(cuts, cuts[1:] + [kend]):
            work.append((si, row0, b, e, parts))
            parts += 1
    return (np.asarray(work, np.int32).reshape(-1, 5), np.asarray(reduce, np.int32).reshape(-1, 4), parts)
