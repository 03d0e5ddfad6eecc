"""The attention custom ops check their tensors when called directly through ``torch.ops``.

The public functions validate their arguments, but ``torch.ops.fused_rope.rope_attention_fwd``,
the rotation ops (``torch.ops.fused_rope.rope``, ``rope_qk``, ``rope_``) and the others are
reachable on their own, and their kernels index by the shapes they are
given: before these checks a ``v`` with fewer keys than ``k``, or a short ``inv_freq``, ran and
read past the tensor's end. Each bad call must raise ``ValueError``/``TypeError`` naming the
argument before any kernel runs (so these tests need neither a GPU nor the interpreter); the
valid call passes the same checks.
"""

from __future__ import annotations

import pytest
import torch

import corope  # noqa: F401 - registers the corope ops
import fused_rope  # noqa: F401 - registers the fused_rope ops
from corope import attention as corope_attention_module
from fused_rope import attention as attention_module
from fused_rope import rope as rope_module

B, HQ, HKV, N, D, R = 1, 4, 2, 8, 32, 32


def _qkv(dtype=torch.float16):
    q = torch.randn(B, HQ, N, D, dtype=dtype)
    k, v = (torch.randn(B, HKV, N, D, dtype=dtype) for _ in range(2))
    return q, k, v


def _fwd_args(**change):
    """The arguments of ``fused_rope::rope_attention_fwd``, valid unless changed."""
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, inv_freq=torch.ones(R // 2), q_pos=None, k_pos=None, causal=True,
                softmax_scale=D**-0.5, interleaved=False, rope_dim=R, attention_factor=1.0,
                window=0)  # fmt: skip
    return {**args, **change}


def _bwd_args(**change):
    """The arguments of ``fused_rope::rope_attention_bwd``, valid unless changed."""
    fwd = _fwd_args()
    q = fwd["q"]
    args = dict(do=torch.randn_like(q), dlse=torch.zeros(B, HQ, N), **fwd)
    args["o"], args["lse"] = torch.randn_like(q), torch.zeros(B, HQ, N)
    order = ["do", "dlse", "q", "k", "v", "o", "lse", "inv_freq", "q_pos", "k_pos", "causal",
             "softmax_scale", "interleaved", "rope_dim", "attention_factor", "window"]  # fmt: skip
    args = {**args, **change}
    return {name: args[name] for name in order}


def _short(x, dim=2):
    return x.narrow(dim, 0, x.shape[dim] - 1)


FUSED_FWD_CASES = {
    "v with fewer keys": (dict(v=_short(_qkv()[2])), ValueError, "k and v must be"),
    "k of another head dim": (dict(k=torch.randn(B, HKV, N, 2 * D).half()), ValueError,
                              "k and v must be"),  # fmt: skip
    "heads not grouped": (dict(q=torch.randn(B, 3, N, D).half()), ValueError, "multiple"),
    "short inv_freq": (dict(inv_freq=torch.ones(R // 2 - 1)), ValueError, "inv_freq must have"),
    "rope_dim past D": (dict(rope_dim=D + 2, inv_freq=torch.ones(D // 2 + 1)), ValueError,
                        "rope_dim must be"),  # fmt: skip
    "mixed dtypes": (dict(v=_qkv()[2].float()), TypeError, "share a dtype"),
    "fp64 inputs": (dict(zip("qkv", _qkv(torch.float64), strict=True)), TypeError, "q must have"),
    "3-d q": (dict(q=torch.randn(HQ, N, D).half()), ValueError, "q must have 4 dimensions"),
    "query positions of another length": (
        dict(q_pos=torch.zeros(1, N - 1), k_pos=torch.zeros(1, N)), ValueError, "q_pos must be"),
    "key positions of another batch": (
        dict(q_pos=torch.zeros(1, N), k_pos=torch.zeros(3, N)), ValueError, "k_pos must be"),
    "negative window": (dict(window=-1), ValueError, "window"),
    "window without causal": (dict(window=4, causal=False), ValueError, "causal"),
    "negative softmax_scale": (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
}  # fmt: skip

FUSED_BWD_CASES = {
    "o with fewer rows": (
        dict(o=_short(torch.randn(B, HQ, N, D).half())),
        ValueError,
        "o must have q's shape",
    ),  # fmt: skip
    "do of another dtype": (
        dict(do=torch.randn(B, HQ, N, D).bfloat16()),
        ValueError,
        "do must have q's shape",
    ),  # fmt: skip
    "lse of another shape": (dict(lse=torch.zeros(B, HQ, N - 1)), ValueError, "lse must be"),
    "lse in half precision": (dict(lse=torch.zeros(B, HQ, N).half()), TypeError, "lse must"),
    "v with fewer keys": (dict(v=_short(_qkv()[2])), ValueError, "k and v must be"),
}


@pytest.mark.parametrize("case", list(FUSED_FWD_CASES))
def test_fused_forward_op_refuses_what_its_kernel_cannot_index(case):
    change, exc, match = FUSED_FWD_CASES[case]
    with pytest.raises(exc, match=match):
        torch.ops.fused_rope.rope_attention_fwd(*_fwd_args(**change).values())


@pytest.mark.parametrize("case", list(FUSED_BWD_CASES))
def test_fused_backward_op_refuses_what_its_kernels_cannot_index(case):
    change, exc, match = FUSED_BWD_CASES[case]
    with pytest.raises(exc, match=match):
        torch.ops.fused_rope.rope_attention_bwd(*_bwd_args(**change).values())


def test_fused_ops_checks_pass_valid_calls():
    """The checks alone (no kernel): valid arguments, positions and angles included."""
    attention_module._check_fwd_op(*_fwd_args().values())
    attention_module._check_bwd_op(*_bwd_args().values())
    angles = dict(q_pos=torch.zeros(B, N, R // 2), k_pos=torch.zeros(1, N, R // 2))
    attention_module._check_fwd_op(*_fwd_args(**angles).values())


def _corope_args(**change):
    """The arguments of ``corope::attention``, valid unless changed."""
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, inv_freq=torch.ones(R // 2), softmax_scale=D**-0.5, rope_dim=R,
                leader="first", detach_mileage=False, deterministic=False, window=0)  # fmt: skip
    return {**args, **change}


def _corope_bwd_args(**change):
    """The arguments of ``corope::attention_backward``, valid unless changed."""
    fwd = _corope_args()
    q = fwd.pop("q")
    args = dict(do=torch.randn_like(q), q=q, k=fwd["k"], v=fwd["v"], o=torch.randn_like(q),
                lse=torch.zeros(B, HQ, N), inv_freq=fwd["inv_freq"],
                softmax_scale=fwd["softmax_scale"], rope_dim=R, leader="first",
                detach_mileage=False, deterministic=False, freq_grad=False, window=0)  # fmt: skip
    return {**args, **change}


COROPE_CASES = {
    "v with fewer keys": (dict(v=_short(_qkv()[2])), ValueError, "one shape"),
    "more queries than keys": (dict(q=torch.randn(B, HQ, N + 1, D).half()), ValueError,
                               "k needs at least"),  # fmt: skip
    "short inv_freq": (dict(inv_freq=torch.ones(R // 2 - 1)), ValueError, "inv_freq must have"),
    "head dim the kernels lack": (
        dict(zip("qkv", (torch.randn(B, h, N, 48).half() for h in (HQ, HKV, HKV)), strict=True)),
        ValueError, "head dim D must be one of"),
    "unknown leader": (dict(leader="last"), ValueError, "leader"),
    "negative window": (dict(window=-2), ValueError, "window"),
}  # fmt: skip

COROPE_BWD_CASES = {
    "do with fewer rows": (
        dict(do=_short(torch.randn(B, HQ, N, D).half())),
        ValueError,
        "do must have q's shape",
    ),  # fmt: skip
    "lse of another shape": (dict(lse=torch.zeros(B, HQ + 1, N)), ValueError, "lse must be"),
    "fewer queries than keys": (
        dict(q=_short(torch.randn(B, HQ, N, D).half())),
        ValueError,
        "k must be",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(COROPE_CASES))
def test_corope_forward_and_decode_ops_refuse_what_their_kernels_cannot_index(case):
    change, exc, match = COROPE_CASES[case]
    args = _corope_args(**change)
    with pytest.raises(exc, match=match):
        torch.ops.corope.attention(*args.values())
    if "window" not in change:  # the decoding op has no window
        decode = [args[name] for name in ("q", "k", "v", "inv_freq", "softmax_scale", "rope_dim",
                                          "leader")]  # fmt: skip
        with pytest.raises(exc, match=match):
            torch.ops.corope.decode(*decode)


@pytest.mark.parametrize("case", list(COROPE_BWD_CASES))
def test_corope_backward_op_refuses_what_its_kernels_cannot_index(case):
    change, exc, match = COROPE_BWD_CASES[case]
    with pytest.raises(exc, match=match):
        torch.ops.corope.attention_backward(*_corope_bwd_args(**change).values())


def test_corope_ops_checks_pass_valid_calls():
    corope_attention_module._check_attention_op(*_corope_args().values())
    corope_attention_module._check_attention_backward_op(*_corope_bwd_args().values())
    step = _corope_args(q=torch.randn(B, HQ, 1, D).half())
    corope_attention_module._check_decode_op(
        *(step[name] for name in ("q", "k", "v", "inv_freq", "softmax_scale", "rope_dim", "leader"))
    )


def _meta(args):
    return {n: x.to("meta") if isinstance(x, torch.Tensor) else x for n, x in args.items()}


@pytest.mark.parametrize("which", ["q", "do"])
def test_fused_ops_checks_refuse_a_head_past_int32_indexing(which):
    """A head whose strides span 2**31 elements or more (meta tensors: no memory) is refused by
    the ops' checks as by the public function, o's cotangent included."""
    strides = (HQ * 2**32, 2**32, 2**29, 1)  # 8 rows 2**29 apart: 3.8e9 elements a head
    args = _meta(_bwd_args())
    args[which] = torch.empty_strided((B, HQ, N, D), strides, device="meta", dtype=torch.float16)
    with pytest.raises(ValueError, match=f"{which} spans .* int32 indexing"):
        attention_module._check_bwd_op(*args.values())


def test_fused_ops_checks_refuse_more_programs_than_a_grid_axis_holds():
    q = torch.empty(1, 2**16 + 2, N, D, device="meta", dtype=torch.float16)
    args = _meta(_fwd_args(q=q))
    with pytest.raises(ValueError, match="batch x query heads must be at most"):
        attention_module._check_fwd_op(*args.values())


def _rotation_args(op, **change):
    """The arguments of ``fused_rope::rope_qk`` (``op="rope_qk"``), ``rope`` or ``rope_`` (the
    one tensor ``x``), valid unless changed: q ``[B, HQ, N, D]``, k ``[B, HKV, N, D]``, an
    angle table ``[N, R/2]``."""
    q, k, _ = _qkv()
    args = dict(q=q, k=k, angles=torch.zeros(N, R // 2), layout="half", rope_dim=R, q_scale=1.0,
                k_scale=1.0, rotary_scale=1.0, conjugate=False, offset=0)  # fmt: skip
    args = {**args, **change}
    if op == "rope_qk":
        return args
    names = ["q", "angles", "layout", "rope_dim", "q_scale", "rotary_scale"]
    names += ["conjugate", "offset"] if op == "rope" else ["offset"]
    return {name: args[name] for name in names}


ROTATION_CASES = {
    "a short angle table": (dict(angles=torch.zeros(N - 1, R // 2)), ValueError, "positions"),
    "angles for fewer frequencies": (dict(angles=torch.zeros(N, R // 2 - 1)), ValueError,
                                     "last dimension"),  # fmt: skip
    "angles of another batch": (dict(angles=torch.zeros(3, N, R // 2)), ValueError, "batch"),
    "a short inv_freq": (dict(angles=torch.ones(R // 2 - 1)), ValueError, "inv_freq must have"),
    "half-precision angles": (dict(angles=torch.zeros(N, R // 2).half()), TypeError, "angles"),
    "rope_dim past D": (dict(rope_dim=D + 2, angles=torch.zeros(N, D // 2 + 1)), ValueError,
                        "rope_dim"),  # fmt: skip
    "an odd rope_dim": (dict(rope_dim=R - 1), ValueError, "rope_dim"),
    "an unknown layout": (dict(layout="pairs"), ValueError, "layout"),
    "an offset with a table": (dict(offset=3), ValueError, "position_offset"),
    "a negative offset": (dict(angles=torch.ones(R // 2), offset=-1), ValueError,
                          "position_offset"),  # fmt: skip
    "fp64 inputs": (dict(q=_qkv(torch.float64)[0], k=_qkv(torch.float64)[1]), TypeError,
                    "must have dtype"),  # fmt: skip
}  # fmt: skip

QK_CASES = {
    "k shorter than q": (dict(k=_short(_qkv()[1])), ValueError, "at least q's length"),
    "k of another head dim": (dict(k=torch.randn(B, HKV, N, 2 * D).half()), ValueError,
                              "head dim"),  # fmt: skip
    "k of another dtype": (dict(k=_qkv()[1].bfloat16()), TypeError, "q's dtype"),
}  # fmt: skip


@pytest.mark.parametrize(
    "op, case",
    [(op, case) for op in ("rope", "rope_qk", "rope_") for case in ROTATION_CASES]
    + [("rope_qk", case) for case in QK_CASES],  # the one-tensor ops take no k
)
def test_rotation_ops_refuse_what_their_kernel_cannot_index(op, case):
    change, exc, match = {**ROTATION_CASES, **QK_CASES}[case]
    with pytest.raises(exc, match=match):
        getattr(torch.ops.fused_rope, op)(*_rotation_args(op, **change).values())


def test_in_place_rotation_op_refuses_what_it_cannot_write():
    x = torch.randn(B, HQ, N, 2 * D).half()[..., ::2]  # last stride 2
    with pytest.raises(ValueError, match="contiguous last dimension"):
        torch.ops.fused_rope.rope_(*_rotation_args("rope_", q=x).values())
    shared = torch.randn(1, 1, N, D).half().expand(B, HQ, N, D)  # heads share memory
    with pytest.raises(ValueError, match="share memory"):
        torch.ops.fused_rope.rope_(*_rotation_args("rope_", q=shared).values())


def test_rotation_ops_checks_pass_valid_calls():
    """The checks alone (no kernel): angle tables shared or per batch, inv_freq with an
    offset, q shorter than k, and (out of place) a strided last dimension, which the ops copy."""
    rope = rope_module
    for change in (
        {},
        dict(angles=torch.zeros(B, N, R // 2)),
        dict(angles=torch.ones(R // 2), offset=5),
        dict(q=_short(_qkv()[0]), layout="interleaved"),
        dict(rope_dim=R // 2, angles=torch.zeros(1, N, R // 4)),
    ):
        rope._check_rope_qk_op(*_rotation_args("rope_qk", **change).values())
    strided = torch.randn(B, HQ, N, 2 * D).half()[..., ::2]
    rope._check_rope_op(*_rotation_args("rope", q=strided).values())
    rope._check_rope_inplace_op(*_rotation_args("rope_").values())
