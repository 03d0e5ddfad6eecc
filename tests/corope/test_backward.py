"""The fused Co-RoPE-GQA backward (corope/backward.py) against autograd through the reference.

Every case draws fresh random q, k, v and a random cotangent ``do``, runs the kernel on
the forward's ``o`` and ``lse`` taken from the reference, and applies flash-attention's
rule to dq, dk and dv: the kernel's error against float64 autograd (on the same rounded
inputs) is at most twice the error of the reference run in the kernel's dtype.

For fp32 inputs that baseline is autograd through the reference in fp32. For fp16 and
bf16 inputs the reference itself computes in fp32 (it upcasts), so its baseline is
"fp32 math on the half-precision inputs, gradients rounded to half": the honest best a
PyTorch implementation can do in that dtype, and a stricter bar than a pure-half run.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import triton
import triton.language as tl
from torch.utils.checkpoint import checkpoint
from triton.runtime.errors import OutOfResources

from corope import backward, corope_attention, forward
from corope.backward import corope_bwd
from corope.naive import corope_attention_ref, corope_inv_freq
from tests.helpers import (
    DEVICE,
    ON_GPU,
    assert_close,
    assert_close_to_baseline,
    deterministic_algorithms,
)


def _inputs(B, HQ, HKV, N, D, dtype):
    """Random q, k, v, do in ``dtype``; the fp64 truth uses these same rounded values."""
    q = torch.randn(B, HQ, N, D, device=DEVICE).to(dtype)
    k = torch.randn(B, HKV, N, D, device=DEVICE).to(dtype)
    v = torch.randn(B, HKV, N, D, device=DEVICE).to(dtype)
    do = torch.randn(B, HQ, N, D, device=DEVICE).to(dtype)
    return q, k, v, do


def _ref_grads(q, k, v, do, dtype, learn=False, **kw):
    """(o, lse, dq, dk, dv) of autograd through the reference with inputs cast to ``dtype``;
    ``learn``: the default frequencies as a leaf too (fp32, fp64 for fp64), and their
    gradient last."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    if learn:
        R = kw.get("rope_dim") or q.shape[-1]
        wd = torch.float64 if dtype == torch.float64 else torch.float32
        w = corope_inv_freq(R, 10000.0, None, q.device, wd).clone().requires_grad_()
        kw = dict(kw, inv_freq=w)
        leaves.append(w)
    o, lse = corope_attention_ref(*leaves[:3], return_lse=True, **kw)
    return o.detach(), lse.detach(), *torch.autograd.grad(o, leaves, do.to(dtype))


def _check(B, HQ, HKV, N, D, rope_dim=None, leader="first", detach_mileage=False,
           dtype=torch.float32, deterministic=False, learn=False, **bwd_kw):  # fmt: skip
    """Checks the kernel's dq, dk, dv (and with ``learn`` dinv_freq) against the reference's;
    returns the inputs, the forward's o and lse, the frequencies and (dq, dk, dv)."""
    q, k, v, do = _inputs(B, HQ, HKV, N, D, dtype)
    kw = dict(rope_dim=rope_dim, leader=leader, detach_mileage=detach_mileage, learn=learn)
    truth = _ref_grads(q, k, v, do, torch.float64, **kw)
    o, lse, *baseline = _ref_grads(q, k, v, do, dtype, **kw)
    R = D if rope_dim is None else rope_dim
    w = corope_inv_freq(R, 10000.0, None, q.device)
    grads = corope_bwd(
        do, q, k, v, o, lse.float(), w, D**-0.5, R, leader, detach_mileage, deterministic,
        freq_grad=learn, **bwd_kw,
    )  # fmt: skip
    assert (grads[3] is None) != learn
    names = ("dq", "dk", "dv", "dinv_freq")[: 3 + learn]
    for name, out, ref, base, like in zip(
        names, grads, truth[2:], baseline, (q, k, v, w), strict=False
    ):
        assert out.dtype == like.dtype and out.shape == like.shape, name
        # row-major, whatever layout the kernel accumulated in (what autograd and the
        # custom op's fake implementation promise)
        assert out.is_contiguous(), f"{name} strides {out.stride()}"
        if ref.abs().max() == 0:
            # N = 1: one key, P = 1, dS = 0, so dq = dk = 0 exactly; the kernel's dP - Drow
            # is a difference of two fp32 dot products and leaves rounding residue.
            assert out.abs().max() <= 1e-5, f"{name}: {out.abs().max():.3e} where 0 is exact"
            continue
        if name == "dinv_freq":
            if dtype != torch.float32:  # the baseline's gradients are rounded to the dtype
                base = base.to(dtype).float()
            # A sum of B HQ N^2 / 2 terms a frequency: its fp32 noise is many roundings, and
            # the largest of R/2 such errors passed twice the baseline's by chance (2.3x, the
            # RMSE at 1.5-1.8x, fp32): a margin of 1e-6 of its largest value (~16 roundings).
            assert_close_to_baseline(name, out, ref, base, atol_floor=1e-6 * ref.abs().max())
            continue
        assert_close_to_baseline(name, out, ref, base)
    return q, k, v, do, o, lse, w, grads[:3]


# (B, HQ, HKV, N, D, rope_dim, leader): group sizes 1, 2, 3, 4, 8, 16; N not a multiple of
# the interpreter's 32-row tile; both leaders; rope_dim < D (pass-through channels); a head
# dim that is not a power of two.
CASES = [
    pytest.param(1, 1, 1, 1, 64, None, "first", id="G1-N1-D64"),
    pytest.param(2, 2, 2, 63, 64, None, "first", id="B2-G1-N63-D64"),
    pytest.param(1, 4, 2, 64, 128, None, "first", id="G2-N64-D128"),
    pytest.param(1, 4, 2, 40, 128, 96, "mean", id="G2-N40-D128-R96-mean"),
    pytest.param(1, 6, 2, 33, 64, None, "mean", id="G3-N33-D64-mean"),
    pytest.param(1, 4, 1, 63, 64, 32, "first", id="G4-N63-D64-R32"),
    pytest.param(1, 8, 1, 47, 64, None, "mean", id="G8-N47-D64-mean"),
    pytest.param(1, 8, 1, 20, 64, 48, "first", id="G8-N20-D64-R48"),
    pytest.param(1, 16, 1, 35, 64, None, "mean", id="G16-N35-D64-mean"),
    pytest.param(1, 7, 1, 30, 64, None, "first", id="G7-N30-D64"),
    pytest.param(2, 12, 2, 25, 64, 32, "mean", id="B2-G6-N25-D64-R32-mean"),
    pytest.param(1, 2, 1, 45, 96, None, "first", id="G2-N45-D96"),
]


@pytest.mark.parametrize("B, HQ, HKV, N, D, rope_dim, leader", CASES)
def test_backward_fp32(B, HQ, HKV, N, D, rope_dim, leader):
    _check(B, HQ, HKV, N, D, rope_dim, leader)


@pytest.mark.slow
@pytest.mark.parametrize("leader", ["first", "mean"])
def test_backward_long_sequence(leader):
    # Sixteen query tiles in the interpreter: carries across many key tiles.
    _check(1, 2, 1, 500, 64, None, leader)


@pytest.mark.parametrize(
    "B, HQ, HKV, N, D, rope_dim, leader",
    [
        pytest.param(1, 2, 2, 63, 64, None, "first", id="G1-N63-D64"),
        pytest.param(1, 4, 1, 64, 128, 64, "mean", id="G4-N64-D128-R64-mean"),
        pytest.param(1, 8, 1, 37, 64, None, "first", id="G8-N37-D64"),
    ],
)
def test_backward_fp16(B, HQ, HKV, N, D, rope_dim, leader):
    _check(B, HQ, HKV, N, D, rope_dim, leader, dtype=torch.float16)


@pytest.mark.parametrize("storage", ["BNHD", "BHDN"])
def test_backward_strided_inputs(storage):
    # [B, N, H, D] storage viewed as [B, H, N, D], or [B, H, D, N] (the channels' stride N):
    # the kernel reads any strides.
    B, HQ, HKV, N, D = 1, 4, 2, 50, 64
    view = {
        "BNHD": lambda h: torch.randn(B, N, h, D, device=DEVICE).transpose(1, 2),
        "BHDN": lambda h: torch.randn(B, h, D, N, device=DEVICE).transpose(-1, -2),
    }[storage]
    q, k, v, do = (view(h) for h in (HQ, HKV, HKV, HQ))
    o, lse, *_ = _ref_grads(q, k, v, do, torch.float32)
    w = corope_inv_freq(D, 10000.0, None, q.device)
    args = (w, D**-0.5, D, "first", False, True)  # deterministic: on the GPU atomics reorder
    strided = corope_bwd(do, q, k, v, o, lse, *args)[:3]
    dense = (x.contiguous() for x in (do, q, k, v, o))
    for a, b in zip(strided, corope_bwd(*dense, lse, *args)[:3], strict=True):
        assert torch.equal(a, b)


def test_backward_mixed_strides():
    # Each of q, do, o read with its own strides: q as a [B, N, H, D] buffer, do contiguous,
    # o with its head dim reversed in memory.
    B, HQ, HKV, N, D = 1, 4, 2, 40, 64
    q = torch.randn(B, N, HQ, D, device=DEVICE).transpose(1, 2)
    k, v = (torch.randn(B, HKV, N, D, device=DEVICE) for _ in range(2))
    do = torch.randn(B, HQ, N, D, device=DEVICE)
    o, lse, *_ = _ref_grads(q, k, v, do, torch.float32)
    o = o.flip(-1).contiguous().flip(-1)
    w = corope_inv_freq(D, 10000.0, None, q.device)
    args = (w, D**-0.5, D, "first", False, True)  # deterministic: on the GPU atomics reorder
    mixed = corope_bwd(do, q, k, v, o, lse, *args)[:3]
    dense = corope_bwd(do, q.contiguous(), k, v, o.contiguous(), lse, *args)[:3]
    for a, b in zip(mixed, dense, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("leader", ["first", "mean"])
def test_backward_detach_mileage(leader):
    _check(1, 4, 2, 63, 64, None, leader, detach_mileage=True)


def test_detach_mileage_changes_the_gradients():
    # The mileage path carries real gradient: dropping it moves dq and dk but not dv.
    # Deterministic: the default's atomic adds reorder on the GPU, and dv must match bitwise.
    q, k, v, do, o, lse, w, full = _check(1, 4, 2, 50, 64, deterministic=True)
    cut = corope_bwd(do, q, k, v, o, lse.float(), w, 64**-0.5, 64, "first", True, True)
    for name, a, b in zip(("dq", "dk"), full[:2], cut[:2], strict=True):
        assert (a - b).abs().max() > 1e-3 * a.abs().max(), name
    torch.testing.assert_close(full[2], cut[2], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_deterministic(dtype):
    q, k, v, do, o, lse, w, first = _check(
        1, 6, 2, 100, 64, None, "mean", dtype=dtype, deterministic=True
    )
    again = corope_bwd(do, q, k, v, o, lse.float(), w, 64**-0.5, 64, "mean", False, True)[:3]
    for name, a, b in zip(("dq", "dk", "dv"), first, again, strict=True):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize(
    "key_tiles, leader, dtype, heads, detach, ordered",
    [
        (1, "first", torch.float32, None, False, False),
        (2, "mean", torch.float32, None, False, False),
        (3, "first", torch.float16, None, False, False),
        (2, "first", torch.float32, 1, False, False),
        (2, "first", torch.float32, None, True, False),
        (2, "mean", torch.float32, None, False, True),
        (3, "first", torch.float16, 1, False, True),
        (1, "first", torch.float32, None, True, True),
    ],
)
def test_backward_split_key_sweep(key_tiles, leader, dtype, heads, detach, ordered, monkeypatch):
    """Each query tile's key sweep split over programs of ``key_tiles`` key tiles (what short
    sequences get on the GPU): the mileage carry enters a split from its own gates pre-pass and
    the gate gradient from the per-split phase-gradient sums; 7 key tiles in the interpreter.
    ``heads = 1``: also one launch per head (the shared-memory fallback), whose per-split sums
    add up before the gate tail. ``detach``: the mileage held constant (no gate tail).
    ``ordered``: the deterministic mode, whose splits add dq and dqL into copies of their own
    (summed afterwards) and wait on the key tiles' counters."""
    import corope.backward as backward

    if heads is not None:
        monkeypatch.setattr(backward, "_launch_configs", lambda *a: iter([(64, 32, 4, heads)]))
        monkeypatch.setattr(backward, "_FITTED", {})
    B, HQ, HKV, N, D = 1, 4, 2, 200, 64
    q, k, v, do = _inputs(B, HQ, HKV, N, D, dtype)
    kw = dict(leader=leader, detach_mileage=detach)
    truth = _ref_grads(q, k, v, do, torch.float64, **kw)
    o, lse, *baseline = _ref_grads(q, k, v, do, dtype, **kw)
    w = corope_inv_freq(D, 10000.0, None, q.device)
    grads = corope_bwd(do, q, k, v, o, lse.float(), w, D**-0.5, D, leader, detach, ordered,
                       key_tiles_per_program=key_tiles)[:3]  # fmt: skip
    for name, out, ref, base in zip(("dq", "dk", "dv"), grads, truth[2:], baseline, strict=True):
        assert_close_to_baseline(name, out, ref, base)


@pytest.mark.parametrize(
    "case",
    [
        dict(B=1, HQ=4, HKV=2, N=64, D=128, id="G2-N64-D128"),
        dict(B=1, HQ=4, HKV=2, N=40, D=128, rope_dim=96, leader="mean", id="G2-R96-mean"),
        dict(B=2, HQ=4, HKV=1, N=63, D=64, rope_dim=32, id="B2-G4-N63-R32"),
        dict(B=1, HQ=4, HKV=2, N=50, D=64, detach_mileage=True, id="detach-mileage"),
        dict(B=1, HQ=6, HKV=2, N=100, D=64, leader="mean", deterministic=True, id="determ"),
        dict(B=1, HQ=4, HKV=2, N=200, D=64, key_tiles_per_program=2, id="split"),
        dict(B=1, HQ=4, HKV=2, N=200, D=64, key_tiles_per_program=3, heads=1, id="split-slices"),
        dict(B=1, HQ=4, HKV=1, N=64, D=64, dtype=torch.float16, id="fp16"),
    ],
    ids=lambda c: c["id"],
)
def test_backward_learned_frequencies(case, monkeypatch):
    """dinv_freq (``freq_grad``, learned frequencies) against float64 autograd through the
    reference, by flash-attention's rule: one share a program (split sweeps, one launch per
    head slice where ``heads = 1``), summed by the launcher; with the mileage held constant
    it is still the phase's ``delta * dphi``."""
    import corope.backward as backward

    case = dict(case)
    case.pop("id")
    if (heads := case.pop("heads", None)) is not None:
        monkeypatch.setattr(backward, "_launch_configs", lambda *a: iter([(64, 32, 4, heads)]))
        monkeypatch.setattr(backward, "_FITTED", {})
    _check(**case, learn=True)


def test_corope_attention_learns_its_frequencies():
    """Through the public op: autograd reaches inv_freq (an fp64 leaf too, through the fp32
    copy the kernels take) and agrees with the reference's gradient (that the backward forms
    none unless asked: test_forward.py's test_backward_options_reach_the_kernel)."""
    q, k, v, do = _inputs(1, 4, 2, 40, 64, torch.float32)
    for dtype in (torch.float32, torch.float64):
        w = corope_inv_freq(64, 500.0, None, q.device, dtype).clone().requires_grad_()
        ref_w = w.detach().clone().requires_grad_()
        (got,) = torch.autograd.grad(corope_attention(q, k, v, inv_freq=w), w, do)
        (want,) = torch.autograd.grad(corope_attention_ref(q, k, v, inv_freq=ref_w), ref_w, do)
        assert got.dtype == dtype
        assert_close("dinv_freq", got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


def test_key_tiles_per_program_splits_only_short_sequences(monkeypatch):
    """The launch heuristic on a 132-SM GPU (issue 3's shapes): about 8 programs per SM where
    the query tiles are fewer, no split where they are enough or under the interpreter."""
    import corope.backward as backward

    choose = backward._key_tiles_per_program.__wrapped__  # uncached: the patches apply
    monkeypatch.setattr(backward, "num_sms", lambda device: 132)
    monkeypatch.setattr(backward, "interpreting", lambda: False)
    cuda = torch.device("cuda")
    # (B * HKV, N) -> key tiles a program, with the 64 x 32 tiles of G <= 4
    expected = {(8, 1024): 3, (2, 4096): 8, (2, 16384): 125, (8, 16384): 512, (1, 64): 2}
    for (groups, n), tiles in expected.items():
        assert choose(groups, n, 64, 32, cuda) == tiles, (groups, n)
    assert choose(8, 1024, 64, 32, torch.device("cpu")) == 32
    monkeypatch.setattr(backward, "interpreting", lambda: True)
    assert choose(8, 1024, 64, 32, cuda) == 32


def test_items_a_copy_bound_the_deterministic_copies(monkeypatch):
    """The deterministic mode's splits (key tiles a program): as many as the default's, fewer
    where their copies of dq and dqL would pass DETERMINISTIC_COPY_BYTES, one where even one
    copy does. Its chains (query tiles a chain): one tile a chain where every tile's copies of
    dk and dv fit, longer chains where they would not, one chain of every tile where even one
    copy does not fit."""
    import corope.backward as backward

    monkeypatch.setattr(backward, "DETERMINISTIC_COPY_BYTES", 1000)
    items = backward._items_a_copy
    assert items(64, 100, at_least=8) == 8  # 8 splits, 800 bytes
    assert items(64, 100, at_least=4) == 7  # 16 splits would take 1600
    assert items(64, 400, at_least=4) == 32  # 2 copies
    assert items(64, 5000, at_least=4) == 64  # one, over the bound alone
    assert items(8, 100) == 1  # 8 chains of one tile, 800 bytes
    assert items(16, 100) == 2  # 10 copies at most: 8 chains of 2
    assert items(16, 300) == 6  # 3 chains (6, 6, 4)
    assert items(16, 5000) == 16  # one, over the bound alone


def test_dk_parts_per_warp_only_where_rows_follow_warps():
    """dk's per-warp partial adds: only for the 64-row, 4-warp tiles (16 rows a warp)."""
    import corope.backward as backward

    assert backward._dk_parts(64, 4) == 4
    for block_m, warps in ((32, 4), (16, 4), (16, 8)):  # narrow tiles, fp32's 8 warps
        assert backward._dk_parts(block_m, warps) == 1


def test_backward_split_needs_a_positive_int():
    q, k, v, do = _inputs(1, 2, 1, 8, 64, torch.float32)
    lse = torch.zeros(1, 2, 8, device=DEVICE)
    w = corope_inv_freq(64, 10000.0, None, q.device)
    args = (do, q, k, v, q, lse, w, 0.125, 64, "first", False)
    with pytest.raises(ValueError, match="^key_tiles_per_program must be >= 1, got 0"):
        corope_bwd(*args, key_tiles_per_program=0)
    with pytest.raises(TypeError, match="^key_tiles_per_program must be an int or None"):
        corope_bwd(*args, key_tiles_per_program=2.0)


_FIRST = object()


class _RecordsLaunches:
    """Stands in for a kernel and records each launch's configuration (the values of the
    ``keys`` arguments) and positional arguments. Launches of the configuration ``fails`` (by default the first one
    seen; None: none) raise OutOfResources, as a tile too large for shared memory does on the
    GPU (before it runs); the rest launch."""

    def __init__(self, kernel, keys=("BLOCK_M", "BLOCK_N", "G"), fails=_FIRST):
        self.kernel, self.keys, self.fails, self.configs, self.args = kernel, keys, fails, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            config = tuple(kwargs[key] for key in self.keys)
            self.configs.append(config)
            self.args.append(args)
            if config == (self.configs[0] if self.fails is _FIRST else self.fails):
                raise OutOfResources(300000, 232448, "shared memory")
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_launch_configs_take_at_most_four_heads_a_program():
    """A group wider than SLICE_HEADS is swept in slices (the narrower tile that holds every
    head costs more than the slices' extra sin/cos); the fallbacks are fewer rows, then
    narrower slices."""
    import corope.backward as backward

    bf16 = torch.bfloat16
    assert backward.SLICE_HEADS == 4
    for group in (4, 5, 7, 8, 16):
        assert next(backward._launch_configs(group, 128, bf16)) == (64, 32, 4, 4)
    assert next(backward._launch_configs(3, 128, bf16)) == (64, 32, 4, 3)
    assert next(backward._launch_configs(8, 256, bf16)) == (16, 32, 4, 4)
    assert list(backward._launch_configs(8, 128, bf16)) == [
        (64, 32, 4, 4), (32, 32, 4, 4), (16, 32, 4, 4),
        (64, 32, 4, 2), (32, 32, 4, 2), (16, 32, 4, 2),
        (64, 32, 4, 1), (32, 32, 4, 1), (16, 32, 4, 1),
    ]  # fmt: skip


class _SnapshotsLaunches:
    """Stands in for a kernel: keeps each launch's arguments, and copies of the storage of
    the tensor arguments ``at`` (positions) taken before the launch runs, then of those
    ``after`` taken after it."""

    def __init__(self, kernel, at, after=()):
        self.kernel, self.at, self.after, self.launches = kernel, at, after, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            snapshots = [args[i]._base.clone() for i in self.at]
            self.launches.append((args, kwargs, snapshots))
            self.kernel[grid](*args, **kwargs)
            snapshots += [args[i]._base.clone() for i in self.after]

        return launch


@pytest.mark.skipif(ON_GPU, reason="counts the interpreter's tiles (the GPU autotunes others)")
@pytest.mark.parametrize("leader", ["first", "mean"])
def test_backward_deterministic_splits_add_into_copies_of_their_own(monkeypatch, leader):
    """The deterministic mode's split sweeps: split ``s`` adds its dq and dqL (sweep and gate
    tail alike) into copy ``s`` of a ``[splits, B, H, D, N]`` buffer, and there to exactly the
    rows that see one of its keys, so that no element gets adds from two programs (which the
    interpreter, running programs one after another, could not show as a race)."""
    import corope.backward as backward

    sweep = _SnapshotsLaunches(backward._corope_bwd_kernel, at=(10, 11))  # DQ, DQL
    tail = _SnapshotsLaunches(backward._gate_tail_kernel, at=(3,))  # DQL
    monkeypatch.setattr(backward, "_corope_bwd_kernel", sweep)
    monkeypatch.setattr(backward, "_gate_tail_kernel", tail)
    monkeypatch.setattr(backward, "_FITTED", {})
    key_tiles = 2
    _check(1, 4, 2, 200, 64, None, leader, deterministic=True, key_tiles_per_program=key_tiles)
    ((args, kw, _),) = sweep.launches
    ((_, _, (dql_before,)),) = tail.launches
    dq, dql = args[10]._base, args[11]._base
    splits = args[23]
    assert splits == 4 and dq.shape[0] == dql.shape[0] == splits  # 7 key tiles, 2 a program
    # the tail's own adds, and the sweep's (the copies start at zero)
    parts = {"dq": dq, "dqL (sweep)": dql_before, "dqL (tail)": dql - dql_before}
    rows = torch.arange(200, device=dq.device)
    for name, part in parts.items():
        touched = part.abs().sum(dim=(1, 2, 3)) > 0  # [splits, N]
        for s in range(splits):
            first_key = s * key_tiles * kw["BLOCK_N"]
            assert torch.equal(touched[s], rows >= first_key), (name, s)


@pytest.mark.skipif(ON_GPU, reason="counts the interpreter's tiles (the GPU autotunes others)")
@pytest.mark.parametrize("leader", ["first", "mean"])
@pytest.mark.parametrize("parts", [4, 1])
def test_backward_deterministic_chains_add_into_copies_of_their_own(monkeypatch, leader, parts):
    """The deterministic mode's chains of query tiles, each adding into copies of its own of
    the ``[B, HKV, N, D]`` buffers (dk's score part, dk's gate parts from the sweep and from the
    gate tail, dv), there to exactly the keys its tiles see. dk's score part has a copy a chain
    for each of the 64-row tile's 4 row groups (``[4 * chains, ...]``, group ``p``'s adds from
    rows ``16 p`` to ``16 p + 15`` of a tile) where a chain's 7 copies fit the bound: with room
    for 14 copies, the 5 query tiles (N = 260) form 2 chains of 3 (the second chain's last
    program is past the last tile, and does nothing). Where 7 do not fit (room for 6), dk's
    score part is one copy a chain, summed across the groups, and the 4 kinds of copies fit
    once: one chain of 5. The gradients, the frequencies' too, are the reference's
    (``_check``), the key sweeps split (copies of dq a split) on top. Chains that shared their
    counters would wait forever: the suite's timeout fails the test (``tests/conftest.py``)."""
    import corope.backward as backward

    N = 260
    one_copy = 4 * 2 * N * 64  # fp32 [B * HKV, N, D]
    # room for copies, query tiles a chain, chains, splits (copies of dq: 3 one_copy each)
    room, chain, chains, splits = {4: (14, 3, 2, 3), 1: (6, 5, 1, 2)}[parts]
    monkeypatch.setattr(backward, "DETERMINISTIC_COPY_BYTES", room * one_copy)
    # dk's score part as the sweep left it (the gate parts are added into its first copies)
    sweep = _SnapshotsLaunches(backward._corope_bwd_kernel, at=(), after=(12,))
    tail = _SnapshotsLaunches(backward._gate_tail_kernel, at=())
    monkeypatch.setattr(backward, "_corope_bwd_kernel", sweep)
    monkeypatch.setattr(backward, "_gate_tail_kernel", tail)
    monkeypatch.setattr(backward, "_FITTED", {})
    _check(1, 4, 2, N, 64, None, leader, deterministic=True, learn=True, key_tiles_per_program=4)
    ((args, kw, (dk_s,)),) = sweep.launches
    ((tail_args, tail_kw, _),) = tail.launches
    assert kw["BLOCK_M"] == tail_kw["BLOCK_M"] == 64
    assert args[24] == tail_args[11] == chain and kw["DK_PARTS"] == parts
    assert args[23] == splits
    keys = torch.arange(N, device=DEVICE)
    buffers = {"dk": args[12], "dk (sweep's gate part)": args[13], "dv": args[14],
               "dk (tail's gate part)": tail_args[4]}  # fmt: skip
    assert len({x._base.data_ptr() for x in buffers.values()}) == 4
    for name, buffer in buffers.items():
        copies = dk_s if name == "dk" else buffer._base
        groups = parts if name == "dk" else 1
        assert copies.shape[0] == chains * groups, name
        touched = copies.abs().sum(dim=(1, 2, 3)) > 0
        for p in range(groups):
            for c in range(chains):
                # the keys up to the chain's last row (group p's last, for the groups' copies):
                # a row adds to the keys at and before it
                rows = torch.arange(c * chain * 64, min(N, (c + 1) * chain * 64), device=DEVICE)
                if groups > 1:
                    rows = rows[(rows % 64) // 16 == p]
                assert torch.equal(touched[p * chains + c], keys <= rows.max()), (name, p, c)


@pytest.mark.parametrize("leader", ["first", "mean"])
def test_backward_sweeps_a_wide_group_in_slices(monkeypatch, leader):
    """G = 7 at the default configurations: one launch for heads 0-3 of each group and one for
    the remainder, heads 4-6, whose dk, dv and gate contributions add up to the reference's
    gradients (``_check``)."""
    import corope.backward as backward

    fake = _RecordsLaunches(backward._corope_bwd_kernel, keys=("G", "GP"), fails=None)
    monkeypatch.setattr(backward, "_corope_bwd_kernel", fake)
    monkeypatch.setattr(backward, "_FITTED", {})
    _check(1, 14, 2, 40, 64, None, leader)
    assert fake.configs == [(4, 4), (3, 4)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_falls_back_to_a_tile_that_fits(monkeypatch, deterministic):
    # The first configuration fails; the others are slices of the group's heads (one launch
    # each, whose dk, dv and gate contributions add up) with fewer rows. Each must give the
    # reference's gradients, and the one that fitted is reused without retrying.
    import corope.backward as backward

    for configs in ([(16, 16, 4, 6), (16, 16, 4, 3)], [(16, 16, 4, 6), (16, 16, 4, 2)]):
        fake = _RecordsLaunches(backward._corope_bwd_kernel)
        monkeypatch.setattr(backward, "_corope_bwd_kernel", fake)
        monkeypatch.setattr(backward, "_launch_configs", lambda *a, c=configs: iter(c))
        monkeypatch.setattr(backward, "_FITTED", {})
        q, k, v, do, o, lse, w, grads = _check(
            1, 12, 2, 40, 64, None, "mean", deterministic=deterministic
        )
        heads = configs[1][3]
        assert fake.configs == [(16, 16, 6)] + [(16, 16, heads)] * (6 // heads)
        again = corope_bwd(do, q, k, v, o, lse.float(), w, 64**-0.5, 64, "mean", False,
                           deterministic)[:3]  # fmt: skip
        assert fake.configs[1 + 6 // heads :] == [(16, 16, heads)] * (6 // heads)
        if deterministic:
            for name, a, b in zip(("dq", "dk", "dv"), grads, again, strict=True):
                assert torch.equal(a, b), name


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_falls_back_when_a_remainder_slice_does_not_fit(monkeypatch, deterministic):
    """G = 6: the first slice (4 heads) launches and adds its gradients, then the remainder
    slice (2 heads) does not fit. The next configuration must start from zeroed accumulators,
    or the first slice's adds would count twice. The configurations (16-row tiles, which fit
    fp32 on every device; 4 warps, then 2) are fixed here: _launch_configs' own depend on the
    device."""
    import corope.backward as backward

    fake = _RecordsLaunches(backward._corope_bwd_kernel, keys=("num_warps", "G"), fails=(4, 2))
    monkeypatch.setattr(backward, "_corope_bwd_kernel", fake)
    monkeypatch.setattr(
        backward, "_launch_configs", lambda *a: iter([(16, 16, 4, 4), (16, 16, 2, 4)])
    )
    monkeypatch.setattr(backward, "_FITTED", {})
    _check(1, 12, 2, 20, 32, None, "first", deterministic=deterministic)
    assert fake.configs == [(4, 4), (4, 2), (2, 4), (2, 2)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_gate_tail_falls_back_to_fewer_rows(monkeypatch, deterministic):
    # The gate tail has its own shared-memory fallback (the "mean" leader's fp32 qL at D = 256
    # fitted the sweep's 64-row tile but not the tail's on an H100): 64 rows fail, 32 serve,
    # and are then reused. Deterministic: the sweep's 2 query tiles are 2 chains of one, and
    # the tail's 4 tiles then 2 chains of two, whose second tile waits on the first.
    import corope.backward as backward

    fake = _RecordsLaunches(backward._gate_tail_kernel, keys=("BLOCK_M",))
    monkeypatch.setattr(backward, "_gate_tail_kernel", fake)
    monkeypatch.setattr(backward, "_launch_configs", lambda *a: iter([(64, 32, 4, 2)]))
    monkeypatch.setattr(backward, "_FITTED", {})
    q, k, v, do, o, lse, w, grads = _check(
        1, 4, 2, 100, 64, None, "mean", deterministic=deterministic
    )
    assert fake.configs == [(64,), (32,)]
    again = corope_bwd(do, q, k, v, o, lse.float(), w, 64**-0.5, 64, "mean", False,
                       deterministic)[:3]  # fmt: skip
    assert fake.configs == [(64,), (32,), (32,)]
    # query tiles a chain (the tail's argument 11): 2 of the 32-row tiles, or all 4
    assert [args[11] for args in fake.args] == ([1, 2, 2] if deterministic else [2, 4, 4])
    if deterministic:
        for name, a, b in zip(("dq", "dk", "dv"), grads, again, strict=True):
            assert torch.equal(a, b), name


@triton.jit
def _dot_split_kernel(A, B, C, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + rm[:, None] * K + rk[None, :])
    b = tl.load(B + rk[:, None] * N + rn[None, :])
    tl.store(C + rm[:, None] * N + rn[None, :], backward._dot_split(a, b, "ieee"))


@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("fp32_operand", ["a", "b", "neither"])
def test_dot_split_keeps_the_fp32_operand_to_about_fp32_accuracy(fp32_operand, dtype):
    """``_dot_split(a, b)`` with one fp32 operand and one in ``dtype``: the fp32 one split into
    a high and a low part in ``dtype`` leaves a relative error of about eps(dtype)^2, where
    rounding it to ``dtype`` once (what the split avoids) leaves eps(dtype)."""
    eps = torch.finfo(dtype).eps
    a = torch.randn(16, 32, device=DEVICE)
    b = torch.randn(32, 16, device=DEVICE)
    a, b = (x if fp32_operand == name else x.to(dtype) for name, x in (("a", a), ("b", b)))
    c = torch.empty(16, 16, device=DEVICE)
    _dot_split_kernel[(1,)](a, b, c, 16, 32, 16)
    exact = a.double() @ b.double()
    atol = 8 * 32**0.5 * eps**2 + 1e-5
    assert_close("a @ b", c, exact, atol=atol, rtol=4 * eps**2 + 1e-6)
    once = a.to(dtype).double() @ b.to(dtype).double()
    if fp32_operand != "neither":  # a bound that rounding once would fail
        assert (once - exact).abs().max() > atol


@pytest.mark.parametrize("leaf", ["tensor", "parameter"])  # a Parameter takes the custom op
@pytest.mark.parametrize("learn", [False, True])
def test_backward_under_non_reentrant_checkpointing(learn, leaf):
    """torch.utils.checkpoint(use_reentrant=False), PyTorch's recommended mode, lets each saved
    tensor be unpacked once: the backward unpacked them twice and failed (a review's find).
    The checkpointed gradients are the plain ones (the recomputed forward is the same)."""
    q, k, v, do = _inputs(1, 4, 2, 20, 32, torch.float32)
    wrap = torch.nn.Parameter if leaf == "parameter" else lambda x: x.requires_grad_()
    leaves = [wrap(x) for x in (q, k, v)]
    if learn:
        # a copy: the default is a shared tensor, which a leaf of its own would change for
        # every later call (corope_inv_freq)
        leaves.append(corope_inv_freq(32, 10000.0, None, DEVICE).clone().requires_grad_())
    f = lambda q, k, v, *w: corope_attention(q, k, v, inv_freq=w[0] if w else None)
    with deterministic_algorithms():  # the default backward adds with atomics on a GPU
        plain = torch.autograd.grad(f(*leaves), leaves, do)
        ckpt = torch.autograd.grad(checkpoint(f, *leaves, use_reentrant=False), leaves, do)
    assert all(torch.equal(a, b) for a, b in zip(ckpt, plain, strict=True))


def test_autocast_casts_the_inputs_as_sdpa_does():
    """Under autocast corope_attention computes what it computes on inputs in autocast's dtype
    and returns that dtype, as attention through SDPA (and rope_attention) does; the gradients
    reach the fp32 leaves in their dtype."""
    q, k, v, do = _inputs(1, 4, 2, 20, 32, torch.float32)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.float16):
        o = corope_attention(*leaves)
    assert o.dtype == torch.float16
    assert torch.equal(o, corope_attention(q.half(), k.half(), v.half()))
    grads = torch.autograd.grad(o, leaves, do.half())
    assert all(g.dtype == torch.float32 and g.isfinite().all() for g in grads)


def test_backward_of_an_empty_sequence():
    q, k, v = (torch.randn(1, h, 0, 64, device=DEVICE, requires_grad=True) for h in (4, 2, 2))
    corope_attention(q, k, v).sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_backward_validates_inputs():
    q, k, v, do = _inputs(1, 2, 1, 8, 64, torch.float32)
    lse = torch.zeros(1, 2, 8, device=DEVICE)
    w = corope_inv_freq(64, 10000.0, None, q.device)
    args = (do, q, k, v, q, lse, w, 0.125, 64, "first", False)

    def call(**changes):
        names = ("do", "q", "k", "v", "o", "lse", "inv_freq", "s", "rope_dim", "leader", "detach")
        values = dict(zip(names, args, strict=True)) | changes
        return corope_bwd(*values.values())

    with pytest.raises(ValueError, match="^do must have q's shape"):
        call(do=do[:, :, :4])
    with pytest.raises(TypeError, match="^o must have q's dtype"):
        call(o=q.half())
    with pytest.raises(TypeError, match="^lse must have dtype"):
        call(lse=lse.double())
    with pytest.raises(ValueError, match=r"^lse must be \[B, HQ, N\]"):
        call(lse=lse[:, :1])
    with pytest.raises(ValueError, match="^inv_freq must have rope_dim // 2"):
        call(inv_freq=w[:3])
    with pytest.raises(ValueError, match="^leader must be one of"):
        call(leader="last")
    with pytest.raises(ValueError, match="^rope_dim must be even"):
        call(rope_dim=7)
    with pytest.raises(ValueError, match="must be a positive multiple of"):
        call(k=torch.randn(1, 3, 8, 64, device=DEVICE), v=torch.randn(1, 3, 8, 64, device=DEVICE))
    with pytest.raises(TypeError, match="^q must have dtype in"):
        call(q=q.double(), k=k.double(), v=v.double(), do=do.double(), o=q.double())


GPU_CASES = [
    pytest.param(1, 4, 2, 4096, 128, None, "first", id="G2-N4096-D128"),
    pytest.param(1, 8, 1, 4096, 64, None, "mean", id="G8-N4096-D64-mean"),
    pytest.param(2, 8, 2, 1000, 64, 32, "first", id="B2-G4-N1000-D64-R32"),
    pytest.param(1, 16, 1, 777, 128, None, "first", id="G16-N777-D128"),
    # Odd numbers of frequencies (the first frequency loop is unrolled by two), one of them
    # pipelined (from 64 frequencies), at N divisible by 16 (the vector atomic adds).
    pytest.param(1, 4, 1, 304, 64, 42, "first", id="G4-N304-D64-R42"),
    pytest.param(1, 8, 2, 512, 256, 130, "first", id="G4-N512-D256-R130"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B, HQ, HKV, N, D, rope_dim, leader", GPU_CASES)
def test_backward_gpu(B, HQ, HKV, N, D, rope_dim, leader, dtype):
    _check(B, HQ, HKV, N, D, rope_dim, leader, dtype=dtype)


# The kernel's other GPU tile configurations (corope.backward._launch_configs): query tiles
# narrower than the 64-row warpgroup product (large head dims: 16 rows at G = 4, D = 256),
# groups swept in slices of 4 heads (G = 8: two; G = 6: 4 heads, then the remaining 2) and
# the smallest head dim.
NARROW_GPU_CASES = [
    pytest.param(1, 8, 1, 1000, 128, None, "first", id="G8-N1000-D128"),
    pytest.param(1, 12, 2, 513, 128, None, "mean", id="G6-N513-D128-mean"),
    pytest.param(1, 8, 2, 700, 256, None, "mean", id="G4-N700-D256-mean"),
    pytest.param(1, 4, 2, 333, 32, None, "first", id="G2-N333-D32"),
    # The "mean" leader's fp32 gate product at D = 32, which Triton 3.6 miscompiled on an H100
    # before the head dim was padded to 64 (backward.padded_channels): found by
    # test_random_configurations.
    pytest.param(1, 8, 2, 700, 32, None, "mean", id="G4-N700-D32-mean"),
    pytest.param(1, 3, 1, 1506, 32, 20, "mean", id="G3-N1506-D32-R20-mean"),
    # The sweep fits 64 rows, the gate tail (fp32 mean-leader qL) only fewer.
    pytest.param(1, 2, 2, 300, 256, None, "mean", id="G1-N300-D256-mean"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, HQ, HKV, N, D, rope_dim, leader", NARROW_GPU_CASES)
def test_backward_gpu_narrow_tiles(B, HQ, HKV, N, D, rope_dim, leader, dtype):
    _check(B, HQ, HKV, N, D, rope_dim, leader, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "B, HQ, HKV, N, D, rope_dim, leader",
    [GPU_CASES[0], GPU_CASES[2], GPU_CASES[4], NARROW_GPU_CASES[1]],  # G6: head slices
)
def test_backward_learned_frequencies_gpu(B, HQ, HKV, N, D, rope_dim, leader, dtype):
    """dinv_freq on the compiled kernels (the hardware sin/cos for fp16/bf16; split sweeps at
    N = 1000 and below; head slices at G = 6), as test_backward_learned_frequencies."""
    _check(B, HQ, HKV, N, D, rope_dim, leader, dtype=dtype, learn=True)


@pytest.mark.gpu
@pytest.mark.parametrize("chains", [None, 4])
@pytest.mark.parametrize("detach_mileage", [False, True])
@pytest.mark.parametrize(
    "N, D",
    # 64 x 32 tiles; and at D = 256 query tiles of 16 rows under 32-key tiles, where the
    # query tile that first sees a key tile is not the key tile's first row over BLOCK_M
    [(3000, 128), (700, 256)],
)
def test_backward_deterministic_gpu(N, D, detach_mileage, chains, monkeypatch):
    # Many query tiles race for the same key tiles: the default mode's atomics would
    # round differently from run to run, the ordered mode must not. ``chains``: the default
    # copy bound (chains of 3-4 query tiles at D = 128, of 1 at D = 256), or a bound that 4
    # chains' copies of 16 bytes a key channel fill: 2 chains of 23-24 tiles at D = 128 (the
    # copies a warp take 28 bytes; 3 chains of 15-16 without the mileage), 4 of 11 at D = 256;
    # their programs wait on each other.
    if chains is not None:
        monkeypatch.setattr(backward, "DETERMINISTIC_COPY_BYTES", chains * 16 * 2 * N * D)
    q, k, v, do, o, lse, w, first = _check(
        1, 8, 2, N, D, None, "first", detach_mileage, torch.bfloat16, deterministic=True
    )
    args = (do, q, k, v, o, lse.float(), w, D**-0.5, D, "first", detach_mileage, True)
    for learn in (False, True):  # and with the learned frequencies' gradient (another variant)
        names = ("dq", "dk", "dv", "dinv_freq")[: 3 + learn]
        reference = corope_bwd(*args, freq_grad=True) if learn else first
        for _ in range(3):
            again = corope_bwd(*args, freq_grad=learn)[: len(names)]
            for name, a, b in zip(names, reference, again, strict=True):
                assert torch.equal(a, b), f"{name} differs between two deterministic runs"


def _check_end_to_end(B, HQ, HKV, N, D, dtype, leader, scale=1.0, rounded_keys=False, **kw):
    """Both kernels through the public function: the backward runs on the forward kernel's
    own o and lse (whose scores take the rotated key in the input dtype), not the reference's.
    ``scale`` multiplies q and k (logits of standard deviation about ``scale**2``);
    ``rounded_keys``: the baseline is the reference with the rotated keys rounded to ``dtype``
    (``rotated_key_dtype``), what the kernels compute, for logits so large that rounding the
    keys alone takes the kernels past twice the plain baseline's error.
    ``kw``: corope_attention's other options (rope_dim, detach_mileage, theta)."""
    q, k, v, do = _inputs(B, HQ, HKV, N, D, dtype)
    q, k = (x * scale for x in (q, k))
    truth = _ref_grads(q, k, v, do, torch.float64, leader=leader, **kw)
    rounding = dict(rotated_key_dtype=dtype) if rounded_keys else {}
    baseline = _ref_grads(q, k, v, do, dtype, leader=leader, **rounding, **kw)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = corope_attention(q, k, v, leader=leader, **kw)
    grads = torch.autograd.grad(o, (q, k, v), do)
    for name, out, ref, base in zip(
        ("o", "dq", "dk", "dv"),
        (o, *grads),
        truth[:1] + truth[2:],
        baseline[:1] + baseline[2:],
        strict=True,
    ):
        assert_close_to_baseline(name, out, ref, base)


@pytest.mark.parametrize("leader", ["first", "mean"])
def test_end_to_end_fp16(leader):
    _check_end_to_end(1, 4, 1, 63, 64, torch.float16, leader)


@pytest.mark.parametrize("scale", [2.0, 4.0])
def test_end_to_end_fp16_large_logits(scale):
    """The backward recomputes P from the forward's lse, whose scores take the rotated keys
    rounded to the inputs' dtype: it must take them rounded too (unrounded, P drifted from lse
    with the logits: fp16, scale 10, dv 0.24 off, 65x the plain baseline's)."""
    _check_end_to_end(1, 4, 2, 40, 32, torch.float16, "first", scale, rounded_keys=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_end_to_end_large_logits_gpu(dtype):
    _check_end_to_end(1, 8, 2, 700, 128, dtype, "first", 4.0, rounded_keys=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G, N, D", [(4, 1000, 128), (1, 777, 64), (8, 2048, 128)])
def test_end_to_end_gpu(G, N, D, dtype):
    _check_end_to_end(1, 2 * G, 2, N, D, dtype, "first")


@pytest.mark.parametrize(
    "seed", [pytest.param(s, marks=pytest.mark.gpu) if s >= 2 else s for s in range(32)]
)
def test_random_configurations(seed):
    """Options drawn at random, together: group size (padded or not), lengths that are not
    tile multiples, head dim, any even rotary width, leader, detached mileage, theta, dtype,
    and on the GPU the forward's autotune configs pinned in turn (256-channel heads autotune).
    Two small draws in the interpreter."""
    rng = random.Random(seed)
    D = rng.choice([32, 64, 128, 256] if ON_GPU else [32, 64])
    HKV, G = rng.choice([1, 2]), rng.choice([1, 2, 3, 4, 5, 8, 16] if ON_GPU else [1, 2, 3])
    # The float64 autograd reference keeps [B, HKV, N, N, R/2] tensors for its backward (GBs
    # at N = 2000): sizes that fit beside the other test processes sharing the GPU (draws up
    # to N = 2000 failed run with the whole GPU selection in session 32, and passed alone)
    N = rng.randint(1, 1200 if ON_GPU else 70)
    dtype = rng.choice(
        [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float16]
    )
    kw = dict(
        rope_dim=rng.choice([None, 2 * rng.randint(1, D // 2)]),
        detach_mileage=rng.random() < 0.3,
        theta=10.0 ** rng.uniform(2, 6),
    )
    leader = rng.choice(["first", "mean"])
    config = rng.randrange(len(forward.FWD_CONFIGS)) if ON_GPU and D <= 128 else None
    with forward.pinned_config(config) if config is not None else contextlib.nullcontext():
        B = rng.randint(1, 2) if G * HKV <= 8 else 1
        _check_end_to_end(B, G * HKV, HKV, N, D, dtype, leader, **kw)


def test_rotary_pairs_layout_and_errors():
    # [B, H, R/2, n_pad, 2]: (x1, x2) of frequency d at position n side by side, fp32;
    # channels R: (pass-through) are not copied.
    x = torch.randn(2, 3, 5, 8, dtype=torch.bfloat16)
    pairs = backward.rotary_pairs(x, 6, 8)
    assert pairs.shape == (2, 3, 3, 8, 2) and pairs.dtype == torch.float32
    expected = torch.stack((x[..., :3], x[..., 3:6]), dim=-1).float().transpose(2, 3)
    assert torch.equal(pairs[:, :, :, :5], expected)
    with pytest.raises(ValueError, match="rope_dim must be even"):
        backward.rotary_pairs(x, 5, 8)
    with pytest.raises(
        ValueError, match="rope_dim must be even, positive and at most the head dim"
    ):
        backward.rotary_pairs(x, 10, 8)
    with pytest.raises(ValueError, match="n_pad must be at least N = 5, got 4"):
        backward.rotary_pairs(x, 6, 4)
