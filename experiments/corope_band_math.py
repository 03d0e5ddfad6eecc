"""The polynomial band of Co-RoPE's scores and its gradients, checked in float64 (no kernel).

PERF_NOTES session 26 replaces the per-pair sin/cos of the low frequencies by a Taylor series
in the in-tile phase: with the keys in tiles of ``BLOCK_N``, a row's mileage to key ``j`` is
``delta = carry + local`` (``carry``: the gates of the later tiles, ``0 <= local < BLOCK_N``);
with ``B = (carry + c) w`` (``c = BLOCK_N / 2``), ``p = Rot(B) q``, ``y = (local - c) w_ref``
(``w_ref`` the band's largest frequency) and ``K_n = s_n (w / w_ref)^n / n! (-J)^(n mod 2) k``
(``J`` the quarter turn, ``s_n = -1`` where ``n mod 4 >= 2``: ``(-J)^2 = -1``), a band
frequency's score is
``sum_n y^n p . K_n``. The forward's patch (``experiments/patches/corope_fwd_taylor_band.patch``)
forms the scores so; a backward would also need, per tile and term:

* ``dq = Rot(-B) sum_n (dS y^n) @ K_n``            (the tile's keys; ``B`` per row and tile)
* ``dk = sum_n C_n^T (dS y^n)^T @ p``              (``K_n = C_n k``)
* ``g = sum_h dS w_ref sum_n n y^(n-1) p . K_n``   (the mileage gradient, the phase path)

This script builds them for one KV group from random queries, keys, mileages and score
gradients ``dS``, and compares them with autograd of the exact scores
``<q, Rot(-delta w) k>`` over the band's frequencies, so that a kernel can start from
formulas known to be right. It prints the largest error of each, relative to the largest
value (the series' truncation at ``terms`` terms and float64 rounding).

    python experiments/corope_band_math.py
"""

from __future__ import annotations

import math

import torch


def rotate(x1, x2, angle):
    """``Rot(angle)`` of the pairs ``(x1, x2)``: ``(x1 cos - x2 sin, x1 sin + x2 cos)``."""
    c, s = angle.cos(), angle.sin()
    return x1 * c - x2 * s, x1 * s + x2 * c


def exact_scores(q, k, delta, w):
    """``[G, N, N]``: ``sum_d q1 kr1 + q2 kr2`` with ``kr = Rot(-delta w) k`` over the
    frequencies ``w`` (``q [G, N, 2F]``, ``k [N, 2F]``, ``delta [N, N]``)."""
    F = w.numel()
    phi = delta[..., None] * w  # [N, N, F]
    kr1, kr2 = rotate(k[None, :, :F], k[None, :, F:], -phi)  # [N(i), N(j), F]
    return (q[:, :, None, :F] * kr1 + q[:, :, None, F:] * kr2).sum(-1)


def band_terms(w, terms):
    """``C_n`` as ``(coef [terms, F], odd [terms])``: ``Rot(-x) = sum_n x^n / n! (-J)^n``, so
    the pair ``(x1, x2)`` maps to ``coef (x1, x2)`` for even ``n`` and ``coef (x2, -x1)``
    (``-J``) for odd ``n``, with ``coef = s_n (w / w_ref)^n / n!`` carrying ``(-J)^2 = -1``."""
    r = w / w.abs().max()
    n = torch.arange(terms, dtype=w.dtype)
    sign = 1.0 - 2.0 * (n % 4 >= 2).to(w.dtype)
    coef = (
        sign[:, None]
        * r[None, :] ** n[:, None]
        / torch.tensor([math.factorial(int(i)) for i in n], dtype=w.dtype)[:, None]
    )
    return coef, (n % 2 == 1)


def apply_c(coef, odd, x1, x2):
    """``C_n`` of the pairs: ``(coef x1, coef x2)``, or ``(coef x2, -coef x1)`` when odd."""
    return (coef * x2, -coef * x1) if odd else (coef * x1, coef * x2)


def apply_ct(coef, odd, a1, a2):
    """``C_n^T`` of the pairs: ``(coef a1, coef a2)``, or ``(-coef a2, coef a1)`` when odd."""
    return (-coef * a2, coef * a1) if odd else (coef * a1, coef * a2)


def band_forward_backward(q, k, delta, dS, w, block_n: int, terms: int):
    """Scores ``[G, N, N]``, ``dq [G, N, 2F]``, ``dk [N, 2F]`` and ``g [N, N]`` of the band
    through the series, tile by tile as a kernel sweeps them (causal: ``dS`` is 0 past the
    diagonal)."""
    G, N, two_f = q.shape
    F = two_f // 2
    c = block_n / 2
    w_ref = w.abs().max()
    coef, odd = band_terms(w, terms)
    scores = torch.zeros(G, N, N, dtype=q.dtype)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    g = torch.zeros(N, N, dtype=q.dtype)
    for t0 in range(0, N, block_n):
        keys = slice(t0, min(N, t0 + block_n))
        # a row's carry over this tile: its mileage to the tile's last key it sees
        last = torch.clamp(torch.arange(N), max=keys.stop - 1)
        last = torch.maximum(last, torch.tensor(t0))
        carry = delta[torch.arange(N), last]  # [N]
        local = delta[:, keys] - carry[:, None]  # [N, T], in [0, block_n) where causal
        y = (local - c) * w_ref
        angle = (carry[:, None] + c) * w  # [N, F]: B
        p1, p2 = rotate(q[..., :F], q[..., F:], angle)  # [G, N, F]
        k1, k2 = k[keys, :F], k[keys, F:]
        dS_t = dS[:, :, keys]  # [G, N, T]
        T = []  # p . K_n, [G, N, T] each
        a1 = torch.zeros(G, N, F, dtype=q.dtype)  # sum_n (dS y^n) @ K_n, unrotated frame
        a2 = torch.zeros_like(a1)
        for n in range(terms):
            kn1, kn2 = apply_c(coef[n], bool(odd[n]), k1, k2)  # [T, F]
            T.append(p1 @ kn1.T + p2 @ kn2.T)
            weighted = dS_t * y**n  # [G, N, T]
            a1 += weighted @ kn1
            a2 += weighted @ kn2
            e1, e2 = apply_ct(coef[n], bool(odd[n]),
                              torch.einsum("gnt,gnf->tf", weighted, p1),
                              torch.einsum("gnt,gnf->tf", weighted, p2))  # fmt: skip
            dk[keys, :F] += e1
            dk[keys, F:] += e2
        scores[:, :, keys] = sum(y**n * T[n] for n in range(terms))
        dq1, dq2 = rotate(a1, a2, -angle)  # Rot(-B): back to q's frame
        dq[..., :F] += dq1
        dq[..., F:] += dq2
        slope = sum(n * y ** (n - 1) * T[n] for n in range(1, terms))
        g[:, keys] = w_ref * (dS_t * slope).sum(0)
    return scores, dq, dk, g


def check(seed: int = 0, G: int = 2, N: int = 40, F: int = 8, block_n: int = 16,
          theta: float = 1e4, terms: int = 12) -> dict[str, float]:  # fmt: skip
    """The largest error of the series' scores, dq, dk and g against autograd of the exact
    scores, each over that tensor's largest value, for the top ``F`` of ``2 F`` frequencies
    of base ``theta`` (float64)."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    w = theta ** (-torch.arange(F, 2 * F, **f64) / (2 * F))  # the band: the low frequencies
    q = torch.randn(G, N, 2 * F, generator=gen, **f64).requires_grad_()
    k = torch.randn(N, 2 * F, generator=gen, **f64).requires_grad_()
    z = torch.rand(N, N, generator=gen, **f64).tril()  # gates z[i, t], t <= i
    # delta[i, j] = sum_{j < t <= i} z[i, t]: an exclusive suffix sum along the keys
    delta = (z.flip(-1).cumsum(-1).flip(-1) - z).tril().requires_grad_()
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    dS = torch.randn(G, N, N, generator=gen, **f64) * causal
    s = exact_scores(q, k, delta, w)
    dq_ref, dk_ref, g_ref = torch.autograd.grad((s * dS).sum(), (q, k, delta))
    with torch.no_grad():
        s_band, dq, dk, g = band_forward_backward(q, k, delta, dS, w, block_n, terms)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    return {
        "scores": rel(s_band * causal, s.detach() * causal),
        "dq": rel(dq, dq_ref),
        "dk": rel(dk, dk_ref),
        "g": rel(g * causal, g_ref * causal),
    }


def main() -> None:
    for terms in (4, 8, 12):
        errors = check(terms=terms)
        print(f"{terms:2d} terms: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))


if __name__ == "__main__":
    main()
