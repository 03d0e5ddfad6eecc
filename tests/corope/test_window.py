"""Co-RoPE with a causal sliding window (``window=``): the reference, the fused forward and
backward, the decoding step and the public function.

Query ``i`` sees key ``j`` iff ``i + NK - NQ - window < j <= i + NK - NQ``. The mileage of a key
it sees sums the gates of the keys between them, all inside the window, so with unit gates a
windowed Co-RoPE is windowed RoPE attention. The kernels are checked with flash-attention's
rule against the float64 reference on the same rounded inputs, as in test_forward.py and
test_backward.py; the interpreter's tiles are 32 keys (forward and backward) and 32 (forward,
G = 2) or 64 (backward) query rows, so the windows below are narrower and wider than a tile.
"""

from __future__ import annotations

import pytest
import torch

from corope import backward, corope_attention, corope_attention_ref
from corope.backward import corope_bwd, swept_tiles
from corope.forward import corope_fwd
from corope.naive import corope_inv_freq
from fused_rope.naive import rope_attention_ref
from tests.helpers import DEVICE, assert_close, assert_close_to_baseline

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _inputs(B, HQ, HKV, NQ, NK, D, dtype):
    q = torch.randn(B, HQ, NQ, D, device=DEVICE).to(dtype)
    k, v = (torch.randn(B, HKV, NK, D, device=DEVICE).to(dtype) for _ in range(2))
    return q, k, v


def test_unit_gates_with_a_window_are_windowed_rope_attention():
    q, k, v = (x.double() for x in _inputs(1, 4, 2, 40, 40, 32, F32))
    for window in (1, 7, 33):
        got = corope_attention_ref(q, k, v, unit_gates=True, window=window)
        want, _ = rope_attention_ref(q, k, v, window=window)
        # RoPE's reference rounds its angles (position x frequency) to fp32, as its kernels
        # take them; Co-RoPE's phases stay fp64: ~1e-7 apart at these 40 positions.
        assert_close(f"window {window}", got, want, atol=2e-6, rtol=1e-6)


def test_a_window_of_every_key_changes_nothing():
    q, k, v = _inputs(1, 4, 2, 20, 30, 64, F32)
    with torch.no_grad():
        for window in (30, 31, 1000):
            got = corope_attention(q, k, v, window=window)
            assert torch.equal(got, corope_attention(q, k, v)), window
        ref = corope_attention_ref(q, k, v, window=30)
        # past int64, as the kernels' API takes it: the reference's mask overflowed
        huge = corope_attention_ref(q, k, v, window=10**30)
    assert torch.equal(ref, corope_attention_ref(q, k, v)) and torch.equal(huge, ref)


def _check_forward(B, HQ, HKV, NQ, NK, D, window, dtype, rope_dim=None, leader="first"):
    q, k, v = _inputs(B, HQ, HKV, NQ, NK, D, dtype)
    R = rope_dim or D
    w = corope_inv_freq(R, 10000.0, None, q.device)
    o, lse = corope_fwd(q, k, v, w, D**-0.5, R, leader, window)
    kw = dict(rope_dim=rope_dim, leader=leader, return_lse=True, window=window)
    o64, lse64 = corope_attention_ref(q.double(), k.double(), v.double(), **kw)
    o_base, lse_base = corope_attention_ref(q, k, v, **kw)
    if dtype != F32:  # the kernel's score product takes the rotated key in q's dtype
        _, lse_base = corope_attention_ref(q, k, v, rotated_key_dtype=dtype, **kw)
    assert_close_to_baseline("o", o, o64, o_base)
    assert_close_to_baseline("lse", lse, lse64, lse_base)


# (B, HQ, HKV, NQ, NK, D, window, dtype, rope_dim, leader): windows of one key, narrower and
# wider than a tile, a chunk continuing a cache (NQ < NK), rope_dim < D, both leaders.
FORWARD_CASES = [
    pytest.param(1, 4, 2, 70, 70, 64, 1, F32, None, "first", id="G2-N70-W1"),
    pytest.param(1, 4, 2, 100, 100, 64, 5, F32, None, "mean", id="G2-N100-W5-mean"),
    pytest.param(1, 8, 1, 130, 130, 64, 45, F16, 48, "first", id="G8-N130-W45-R48-f16"),
    pytest.param(2, 2, 1, 37, 150, 32, 64, F32, None, "first", id="B2-G2-NQ37-NK150-W64"),
    pytest.param(1, 4, 1, 1, 90, 64, 20, F32, None, "mean", id="G4-NQ1-NK90-W20-mean"),
]
FORWARD_GPU_CASES = [
    pytest.param(1, 32, 8, 4096, 4096, 128, 1000, BF16, None, "first", id="G4-N4096-W1000-bf16"),
    pytest.param(2, 16, 2, 777, 777, 64, 129, F16, 32, "mean", id="B2-G8-N777-W129-R32-f16"),
    pytest.param(1, 8, 2, 300, 2000, 256, 333, BF16, None, "first", id="G4-NQ300-NK2000-W333"),
    pytest.param(1, 4, 4, 500, 500, 128, 1, F32, None, "first", id="G1-N500-W1-f32"),
]


@pytest.mark.parametrize("B, HQ, HKV, NQ, NK, D, window, dtype, rope_dim, leader", FORWARD_CASES)
def test_forward(B, HQ, HKV, NQ, NK, D, window, dtype, rope_dim, leader):
    _check_forward(B, HQ, HKV, NQ, NK, D, window, dtype, rope_dim, leader)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B, HQ, HKV, NQ, NK, D, window, dtype, rope_dim, leader", FORWARD_GPU_CASES
)
def test_forward_gpu(B, HQ, HKV, NQ, NK, D, window, dtype, rope_dim, leader):
    _check_forward(B, HQ, HKV, NQ, NK, D, window, dtype, rope_dim, leader)


def _check_backward(B, HQ, HKV, N, D, window, dtype=F32, leader="first", detach=False,
                    deterministic=False, learn=False, **bwd_kw):  # fmt: skip
    """The backward kernel's dq, dk, dv (and with ``learn`` dinv_freq) against autograd
    through the reference; returns the kernel's gradients."""
    q, k, v = _inputs(B, HQ, HKV, N, N, D, dtype)
    do = torch.randn(B, HQ, N, D, device=DEVICE).to(dtype)
    w = corope_inv_freq(D, 10000.0, None, q.device)

    def reference(cd):
        leaves = [x.detach().to(cd).requires_grad_() for x in (q, k, v)]
        if learn:
            # a copy: in fp32, .to() returned the shared default tensor itself, which this made
            # a learned leaf for every later call that defaulted to it (default_inv_freq now
            # refuses it)
            wd = torch.float64 if cd == torch.float64 else F32
            leaves.append(w.to(wd, copy=True).requires_grad_())
        o, lse = corope_attention_ref(
            *leaves[:3], inv_freq=leaves[3] if learn else None, leader=leader,
            detach_mileage=detach, window=window, return_lse=True,
        )  # fmt: skip
        return o.detach(), lse.detach(), torch.autograd.grad(o, leaves, do.to(cd))

    _, _, truth = reference(torch.float64)
    o, lse, baseline = reference(dtype)
    grads = corope_bwd(do, q, k, v, o, lse.float(), w, D**-0.5, D, leader, detach,
                       deterministic, freq_grad=learn, window=window, **bwd_kw)  # fmt: skip
    names = ("dq", "dk", "dv", "dinv_freq")[: 3 + learn]
    for name, out, ref, base in zip(names, grads, truth, baseline, strict=False):
        if ref.abs().max() == 0:
            # a window of one key: P = 1, dS = 0, so dq = 0 exactly; the kernel's dP - Drow
            # is a difference of two fp32 dot products and leaves rounding residue
            assert out.abs().max() <= 1e-5, f"{name}: {out.abs().max():.3e} where 0 is exact"
        elif name == "dinv_freq":  # a sum of many pairs' terms: test_backward.py's margin
            assert_close_to_baseline(name, out, ref, base, atol_floor=1e-6 * ref.abs().max())
        else:
            assert_close_to_baseline(name, out, ref, base)
    return grads


# (B, HQ, HKV, N, D, window, dtype, leader): the interpreter's backward tile is 64 rows.
BACKWARD_CASES = [
    pytest.param(1, 4, 2, 70, 64, 1, F32, "first", id="G2-N70-W1"),
    pytest.param(1, 4, 2, 130, 64, 17, F32, "mean", id="G2-N130-W17-mean"),
    pytest.param(2, 4, 1, 100, 64, 64, F16, "first", id="B2-G4-N100-W64-f16"),
    pytest.param(1, 2, 1, 150, 32, 90, F32, "first", id="G2-N150-W90-D32"),
]


@pytest.mark.parametrize("B, HQ, HKV, N, D, window, dtype, leader", BACKWARD_CASES)
def test_backward(B, HQ, HKV, N, D, window, dtype, leader):
    _check_backward(B, HQ, HKV, N, D, window, dtype, leader)


@pytest.mark.parametrize(
    "key_tiles, deterministic, detach, learn",
    [
        (1, False, False, False),
        (2, True, False, False),
        (1, True, True, False),
        (2, False, False, True),
    ],  # fmt: skip
)
def test_backward_split_sweeps(key_tiles, deterministic, detach, learn):
    """Each query tile's windowed sweep split over programs of ``key_tiles`` key tiles: the
    splits start at the window's first tile, and the gate tail's per-split sums follow."""
    _check_backward(1, 4, 2, 200, 64, 40, leader="mean", detach=detach,
                    deterministic=deterministic, learn=learn,
                    key_tiles_per_program=key_tiles)  # fmt: skip


@pytest.mark.parametrize("deterministic", [False, True])
def test_gate_tail_on_fewer_rows_takes_the_sweeps_splits(monkeypatch, deterministic):
    """The gate tail on 32-row tiles after a 64-row sweep (its shared-memory fallback): a
    split's key range starts at the window of the sweep's query tile, not of the tail's, or
    the per-split sums of the phase gradient would pair with the wrong keys."""
    monkeypatch.setattr(backward, "_launch_configs", lambda *a: iter([(64, 32, 4, 2)]))
    monkeypatch.setattr(backward, "_FITTED", {})
    real = backward._gate_tail_kernel
    rows = []

    class FewerRows:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                if kw["BLOCK_M"] == 64:  # as if 64 rows did not fit: the launcher tries 32
                    raise backward.OutOfResources(1, 0, "shared memory")
                rows.append(kw["BLOCK_M"])
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(backward, "_gate_tail_kernel", FewerRows())
    _check_backward(1, 4, 2, 160, 64, 40, deterministic=deterministic, key_tiles_per_program=1)
    assert rows == [32]


def test_keys_before_the_window_are_never_read():
    """NaN in v and k at the first 32 keys: the rows whose tiles' windows all start past the
    first key tile, and the backward's gradients of the rows and keys of query tiles that do,
    stay finite, which holds only if neither kernel loads that tile for them (a loaded NaN
    value reaches every row of the tile through ``P @ V``, whose hidden weights are 0). The
    bounds hold for every tile either kernel takes (forward: at most 128 keys and 32 rows at
    G = 2; backward: 64 rows, 32 keys), with window 16: the forward's row tiles from 160 on,
    the backward's from 256 on."""
    N, D, W = 320, 64, 16
    q, k, v = _inputs(1, 4, 2, N, N, D, F32)
    k[:, :, :32] = float("nan")
    v[:, :, :32] = float("nan")
    w = corope_inv_freq(D, 10000.0, None, q.device)
    o, lse = corope_fwd(q, k, v, w, D**-0.5, D, "first", W)
    assert o[:, :, 160:].isfinite().all() and lse[:, :, 160:].isfinite().all()
    assert not o[:, :, :32].isfinite().any()  # the rows that see the poisoned keys
    do = torch.randn_like(q)
    dq, dk, dv, _ = corope_bwd(do, q, k, v, o, lse, w, D**-0.5, D, "first", False, window=W)
    assert dq[:, :, 256:].isfinite().all()
    assert dk[:, :, 256:].isfinite().all() and dv[:, :, 256:].isfinite().all()


@pytest.mark.parametrize("key_tiles", [None, 1])
def test_keys_a_row_does_not_see_get_no_gradient_from_it(key_tiles):
    """A cotangent on the last row only: the keys before its window get exactly zero dk and
    dv. The gates are masked to the window, so the gate gradient of those keys is 0 exactly,
    not the difference of two sums of the row's phase gradient (``C - Sg``) that rounding
    leaves a residue of."""
    N, D, W = 150, 64, 40
    q, k, v = _inputs(1, 4, 2, N, N, D, F32)
    w = corope_inv_freq(D, 10000.0, None, q.device)
    o, lse = corope_fwd(q, k, v, w, D**-0.5, D, "first", W)
    do = torch.zeros_like(q)
    do[:, :, -1] = torch.randn_like(do[:, :, -1])
    dq, dk, dv, _ = corope_bwd(do, q, k, v, o, lse, w, D**-0.5, D, "first", False,
                               key_tiles_per_program=key_tiles, window=W)  # fmt: skip
    hidden = slice(0, N - W)
    assert dk[:, :, hidden].abs().max() == 0 and dv[:, :, hidden].abs().max() == 0
    assert dq[:, :, :-1].abs().max() == 0
    assert dk[:, :, N - W :].abs().max() > 0  # the keys it sees do get gradient


def test_decoding_step_attends_to_the_windows_keys():
    """A decoding step (NQ = 1) with a window takes the decoding kernels over the window's
    keys alone, which equals the reference over every key with the window."""
    q, k, v = _inputs(2, 4, 2, 1, 200, 64, F32)
    with torch.no_grad():
        got = corope_attention(q, k, v, window=37, leader="mean")
        last = corope_attention(q, k[:, :, -37:], v[:, :, -37:], leader="mean")
    assert torch.equal(got, last)
    ref = corope_attention_ref(q.double(), k.double(), v.double(), window=37, leader="mean")
    assert_close("o", got, ref, atol=2e-5, rtol=1e-5)


def test_public_function_trains_through_the_window():
    q, k, v = (x.requires_grad_() for x in _inputs(1, 4, 2, 90, 90, 64, F32))
    o = corope_attention(q, k, v, window=20)
    o.square().sum().backward()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = corope_attention_ref(*leaves, window=20)
    ref.square().sum().backward()
    assert_close("o", o, ref, atol=1e-5, rtol=1e-5)
    for name, x, y in zip(("dq", "dk", "dv"), (q, k, v), leaves, strict=True):
        assert_close(name, x.grad, y.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "window, exc, words",
    [
        (0, ValueError, "window must be at least 1"),
        (-2, ValueError, "window must be at least 1"),
        (2.0, TypeError, "window must be an int or None, got float"),
        (True, TypeError, "window must be an int or None, got bool"),
    ],
)
@pytest.mark.parametrize("fn", [corope_attention, corope_attention_ref])
def test_bad_windows_are_refused(fn, window, exc, words):
    q, k, v = _inputs(1, 2, 1, 8, 8, 32, F32)
    with pytest.raises(exc, match=words):
        fn(q, k, v, window=window)


@pytest.mark.parametrize(
    "window, exc, words",
    [
        (-5, ValueError, "window must be at least 1"),
        (True, TypeError, "got bool"),
        (False, TypeError, "got bool"),
        (2.5, TypeError, "got float"),
    ],
)
def test_backward_launcher_refuses_bad_windows(window, exc, words):
    """corope_bwd checks its window as it checks its other arguments (a negative one ran the
    unwindowed backward, True a window of one key); 0 and None are no window."""
    q, k, v = _inputs(1, 2, 1, 8, 8, 32, F32)
    w = corope_inv_freq(32, 10000.0, None, q.device)
    o, lse = corope_fwd(q, k, v, w, 32**-0.5, 32, "first")
    args = (torch.randn_like(q), q, k, v, o, lse, w, 32**-0.5, 32, "first", False)
    with pytest.raises(exc, match=words):
        corope_bwd(*args, window=window)
    none = corope_bwd(*args, deterministic=True, window=None)
    for a, b in zip(none[:3], corope_bwd(*args, deterministic=True, window=0)[:3], strict=True):
        assert torch.equal(a, b)


def test_swept_tiles_bound_every_query_tiles_sweep():
    for N in (1, 63, 64, 500, 1000):
        for W in (0, 1, 31, 32, 33, 100, 2000):
            for bm, bn in ((64, 32), (32, 32), (16, 64)):
                most = max(
                    backward._tiles_of_query_tile(m, N, bm, bn, W) for m in range(-(-N // bm))
                )
                assert most <= swept_tiles(N, bm, bn, W) <= -(-N // bn), (N, W, bm, bn)
                assert swept_tiles(N, bm, bn, W) <= most + 1, (N, W, bm, bn)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_backward_gpu(dtype):
    _check_backward(1, 32, 8, 2048, 128, 300, dtype)
    _check_backward(2, 8, 2, 1000, 64, 129, dtype, leader="mean", deterministic=True)
