"""What a chunked Gated DeltaNet prefill on bf16 tensor cores would cost in precision (CPU, numpy, ~1 minute).

    python3 bench/deltanet_chunk_precision.py            # H=4 heads x T=1,024 tokens, dk = dv = 128

The GPU's prefill runs the gated delta rule token by token (decapybara/kernels/deltanet_prefill.cu `gdn_recurrent`,
float arithmetic). The chunked form (the numpy reference `gated_delta_chunk`: the UT transform per 64-token chunk)
turns it into matrix products that tensor cores could run, but MMAs take bf16 operands. This models each
product's operand rounding (bf16 round to nearest even, float32 sums) and prints the output's and the final
state's largest error against the float64-within-chunk reference, relative to their largest magnitude, for:
every product in float32; in one bf16 term; the "split" products as hi + lo terms (three MMAs:
a_hi b_hi + a_lo b_hi + a_hi b_lo) and the rest in one term. The products: kk = (beta k) k^T, qk = q k^T
(intra-chunk scores), ws = W S, qs = (q exp(G)) S, av = (scores) V_new, kv = K_dec^T V_new (the state update).
The triangular solve is modelled as float32. Inputs as the model makes them: L2-normed q (times dk^-0.5) and k,
log decays -A softplus(a + dt), beta = sigmoid(b).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decapybara.backend.numpy_backend import gated_delta_chunk

PRODUCTS = ("kk", "qk", "ws", "qs", "av", "kv")


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (nearest even), as float64."""
    a = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((a + 0x7FFF + ((a >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


def f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float64)


def product(a: np.ndarray, b: np.ndarray, mode: str) -> np.ndarray:
    """a @ b with operands as an MMA would take them: "f32", "bf16" (one term), "split" (hi + lo, 3 MMAs)."""
    if mode == "f32":
        return f32(a @ b)
    ah, bh = bf16(a), bf16(b)
    if mode == "bf16":
        return f32(ah @ bh)
    return f32(ah @ bh + bf16(a - ah) @ bh + ah @ bf16(b - bh))


def chunked(q, k, v, g, beta, state, modes: dict[str, str], chunk: int = 64):
    """(outputs [H, T, dv], final state) of the UT-transform chunked rule with each product in `modes`."""
    h, n, _ = q.shape
    out = np.empty((h, n, v.shape[2]))
    st = state.astype(np.float64)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        c = e - s
        qc, kc, vc, gc, bc = q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e]
        cum = f32(np.cumsum(gc, axis=1))
        lower = np.tril(np.ones((c, c), bool))
        diff = cum[:, :, None] - cum[:, None, :]
        decay = np.where(lower, np.exp(np.where(lower, diff, 0.0)), 0.0)
        k_beta, v_beta = f32(kc * bc[..., None]), f32(vc * bc[..., None])
        strict = product(k_beta, kc.transpose(0, 2, 1), modes["kk"]) * decay * ~np.eye(c, dtype=bool)
        rhs = np.concatenate([v_beta, f32(k_beta * np.exp(cum)[..., None])], axis=2)
        sol = f32(np.linalg.solve(np.eye(c)[None] + f32(strict), rhs))
        new_v, k_cum = sol[..., :v.shape[2]], sol[..., v.shape[2]:]
        intra = f32(product(qc, kc.transpose(0, 2, 1), modes["qk"]) * decay)
        v_new = f32(new_v - product(k_cum, st, modes["ws"]))
        out[:, s:e] = f32(product(f32(qc * np.exp(cum)[..., None]), st, modes["qs"])
                          + product(intra, v_new, modes["av"]))
        k_dec = f32(kc * np.exp(cum[:, -1:] - cum)[..., None])
        st = f32(st * np.exp(cum[:, -1])[:, None, None] + product(k_dec.transpose(0, 2, 1), v_new, modes["kv"]))
    return out, st


def main(heads: int = 4, tokens: int = 1024, dim: int = 128) -> None:
    rng = np.random.default_rng(0)

    def normed(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q = f32(normed(rng.standard_normal((heads, tokens, dim))) * dim ** -0.5)
    k = f32(normed(rng.standard_normal((heads, tokens, dim))))
    v = f32(rng.standard_normal((heads, tokens, dim)))
    big_a = rng.uniform(1.0, 16.0, heads)[:, None]
    g = f32(-big_a * np.log1p(np.exp(rng.standard_normal((heads, tokens)) + 1.0)) * 0.05)
    beta = f32(1.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((heads, tokens)))))
    state0 = np.zeros((heads, dim, dim), np.float32)
    ref_state = state0.copy()
    ref = gated_delta_chunk(*(x.astype(np.float32) for x in (q, k, v, g, beta)), ref_state)
    print(f"{heads} heads x {tokens} tokens, dk = dv = {dim}; error / max |reference|")
    print(f"{'products':<44}{'output':>10}{'state':>10}")
    cases = [("every product float32", {}, "f32"), ("every product one bf16 term", {}, "bf16"),
             ("split: ws, qs, kv (the state's)", {"ws", "qs", "kv"}, "bf16"),
             ("split: ws, qs, kv, av", {"ws", "qs", "kv", "av"}, "bf16"),
             ("split: ws, qs, kv, av, qk", {"ws", "qs", "kv", "av", "qk"}, "bf16"),
             ("split: every product", set(PRODUCTS), "bf16")]
    for label, split, rest in cases:
        modes = {p: "split" if p in split else rest for p in PRODUCTS}
        out, st = chunked(q, k, v, g, beta, state0, modes)
        err = np.abs(out - ref).max() / np.abs(ref).max()
        serr = np.abs(st - ref_state).max() / np.abs(ref_state).max()
        print(f"{label:<44}{err:>10.1e}{serr:>10.1e}")


if __name__ == "__main__":
    main()
