"""GPTQ (Frantar et al., 2022): error-compensating quantisation of a [N, K] weight into any block format.

Given H = X^T X (K x K) from calibration activations X [tokens, K], GPTQ quantises W column by column along K
and, after each column, spreads that column's error over the not-yet-quantised columns so that X W^T moves as
little as possible. With U the upper Cholesky factor of H^-1 (H^-1 = U^T U):

    err_j = (w_j - q_j) / U[j, j];   W[:, j+1:] -= err_j  outer  U[j, j+1:]

Columns are processed in batches of `block` ("lazy batch"): updates inside a batch are applied at once,
the rest of W gets one matrix product per batch. The scale of each group of `fmt.block` columns is chosen
(MX rule, or NVFP4's E4M3 rule) from the current error-updated values when the group starts. NVFP4's tensor
scale comes from the original weight.
"""

from __future__ import annotations

import numpy as np

from decapybara.model.quant.blocks import (
    QuantTensor,
    divide_by_scale,
    get_format,
    nvfp4_tensor_scale,
    select_scales,
)
from decapybara.model.quant.elements import encode_elements
from decapybara.model.quant.packing import pack_codes


def _inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper U with U^T U = (H + damp * mean(diag H) * I)^-1; a zero diagonal (dead column) becomes 1."""
    h = h.copy()
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += damp * np.mean(np.diag(h))
    try:
        lower = np.linalg.cholesky(h)
        eye = np.eye(len(h))
        linv = np.linalg.solve(lower, eye)  # L^-1
        hinv = linv.T @ linv  # H^-1 = L^-T L^-1
        return np.linalg.cholesky(hinv).T
    except np.linalg.LinAlgError:
        raise ValueError("GPTQ: the Hessian is not positive definite after damping; raise `damp`") from None


def gptq_quantize(w: np.ndarray, h: np.ndarray, fmt: str, damp: float = 0.01,
                  block: int = 128) -> QuantTensor:
    """Quantise weight `w` [N, K] to `fmt` with GPTQ under the calibration Hessian `h` = X^T X [K, K].

    `block` (the lazy-batch width) must be a multiple of the format's block; K is zero-padded like `quantize`.
    """
    f = get_format(fmt)
    w = np.asarray(w, np.float32)
    h = np.asarray(h, np.float64)
    if w.ndim != 2 or h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"GPTQ needs w [N, K] and H [K, K], got {w.shape} and {h.shape}")
    if block <= 0 or block % f.block:
        raise ValueError(f"GPTQ block {block} must be a positive multiple of {fmt}'s block {f.block}")
    if not (np.isfinite(w).all() and np.isfinite(h).all()) or damp < 0:
        raise ValueError("GPTQ needs finite w and H and damp >= 0")
    n, k = w.shape
    kp = f.padded(k)
    ts = nvfp4_tensor_scale(w) if f.tensor_scale else None
    wk = np.zeros((n, kp))  # [N, Kp] float64 working copy, padding columns are dead
    wk[:, :k] = w
    hp = np.zeros((kp, kp))
    hp[:k, :k] = h
    wk[:, np.diag(hp) <= 0] = 0.0
    u = _inverse_cholesky(hp, damp)  # [Kp, Kp] upper

    codes = np.zeros((n, kp), np.uint8)  # element codes, packed at the end
    scodes = np.zeros((n, kp // f.block), np.uint8)
    table = f.elem.table
    svals = np.ones(n)
    for i1 in range(0, kp, block):
        i2 = min(i1 + block, kp)
        w1 = wk[:, i1:i2].copy()  # [N, b] this batch, updated eagerly
        err1 = np.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for j in range(i2 - i1):  # one column at a time, vectorised over the N rows
            col = i1 + j
            if col % f.block == 0:
                sc, sv = select_scales(w1[:, None, j:j + f.block], f, ts)  # [N, 1]
                scodes[:, col // f.block], svals = sc[:, 0], sv[:, 0]
            c = encode_elements(f.elem, divide_by_scale(w1[:, j], svals))
            codes[:, col] = c
            q = table[c] * svals
            e = (w1[:, j] - q) / u1[j, j]
            w1[:, j:] -= np.outer(e, u1[j, j:])
            err1[:, j] = e
        wk[:, i2:] -= err1 @ u[i1:i2, i2:]
    return QuantTensor(fmt, (n, k), pack_codes(codes, f.bits), scodes, ts)
