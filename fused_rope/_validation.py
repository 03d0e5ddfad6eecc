"""Input checks shared by every public function of ``fused_rope`` and ``corope``.

Each raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape,
value or device) with the argument's name and what it got; ``RuntimeError`` where the Triton
interpreter cannot run the kernels at all (``interpreter_blocker``).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import re

import numpy
import torch
import triton
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = ("half", "interleaved")
# Frequencies and angles: a half-precision frequency is off by ~1e-3 of itself, which at
# position 1e4 is radians.
FREQ_DTYPES = (torch.float32, torch.float64)
# The attention kernels add batch and head offsets in int64 but index within a head (fused RoPE
# attention) or a KV group (Co-RoPE) in int32 (fewer registers in the loops): a block they
# index that way must span fewer elements than this.
INT32_INDEX_LIMIT = 2**31
FP32_MAX = torch.finfo(torch.float32).max
FP16_MAX = torch.finfo(torch.float16).max
SOFTMAX_SCALE_MAX = FP32_MAX / math.e  # below FP32_MAX / log2(e) = FP32_MAX / 1.4427
# CUDA's limit on a grid's second axis, where the attention kernels put (batch, head) pairs,
# and on its third, where the RoPE kernel puts the batch
MAX_GRID_AXIS1 = MAX_GRID_AXIS2 = 65535


def element_span(sizes, strides) -> int:
    """1 + the offset, in elements, from the first to the last element of a block of ``sizes``
    with ``strides``: what int32 indexing within the block must hold."""
    return 1 + sum(max(n - 1, 0) * st for n, st in zip(sizes, strides, strict=True))


def check_float_tensor(
    x, name: str, ndim: int | tuple[int, ...] | None = None, dtypes=None
) -> None:
    """``x`` is a floating-point tensor (of one of ``dtypes``) with ``ndim`` dimensions."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:  # the kernels and the references index dense memory
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if x.dim() not in allowed:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dimensions, "
                f"got shape {tuple(x.shape)}"
            )


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors live on one device; returns it."""
    named = [(n, t) for n, t in tensors.items() if t is not None]
    device = named[0][1].device
    for n, t in named[1:]:
        if t.device != device:
            raise ValueError(
                f"{n} is on {t.device} but {named[0][0]} is on {device}: all inputs must share a device"
            )
    return device


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``"3.6.0"`` or ``"2.4.0rc1"``."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def interpreter_blocker(triton_version: str | None = None, numpy_version: str | None = None):
    """Why Triton's interpreter cannot run this package's kernels with the installed (or
    given) Triton and numpy, or ``None`` where it can.

    Triton 3.6's interpreter turns a run-time loop bound into a Python int with ``int()`` of
    a one-element array, which numpy 2.4 no longer allows (triton-lang/triton#9171, fixed
    in 3.7): every kernel with such a loop fails with "only 0-dimensional arrays can be
    converted to Python scalars". The ``dev`` extra pins ``numpy<2.4``; an environment that
    bypasses it (a preinstalled image) gets this message instead of that one.
    """
    triton_version = triton_version or triton.__version__
    numpy_version = numpy_version or numpy.__version__
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        return (
            f"Triton {triton_version}'s interpreter cannot run these kernels with numpy "
            f"{numpy_version} (triton-lang/triton#9171, fixed in Triton 3.7): install "
            "'numpy<2.4' (the dev extra does) or Triton >= 3.7"
        )
    return None


# The values Triton's own reading of a boolean variable takes as true (Triton 3.6 and 3.9).
_TRUE_WORDS = ("1", "true", "on", "yes", "y")


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter: ``TRITON_INTERPRET`` read as Triton
    reads it (``triton.knobs.runtime.interpret``, whose C getter Dynamo cannot trace), set
    before the kernels are imported."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE_WORDS


# Triton picks the interpreter when a kernel is decorated, so at import: the kernel modules
# import this one first.
_INTERPRETING_AT_IMPORT = interpreting()


def check_kernel_device(
    device: torch.device, name: str, dot_dtype: torch.dtype | None = None
) -> None:
    """Triton kernels run on CUDA, or on the CPU through the interpreter only, which must be
    able to run them (``interpreter_blocker``). ``dot_dtype``: the dtype of the kernel's
    tensor-core products, for kernels that have them; the interpreter computes bf16 ones
    wrongly (by ~1e9 on random inputs), so bf16 there is refused rather than returned."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        blocker = interpreter_blocker()
        if blocker is not None:
            raise RuntimeError(f"{name} is on the CPU, for the interpreter, but {blocker}")
        if dot_dtype == torch.bfloat16:
            raise TypeError(
                f"{name} is bfloat16 on the CPU: Triton's interpreter has no bf16 arithmetic "
                "(its bf16 products come out wrong); run bf16 on a GPU, or fp16/fp32 here"
            )
        if not _INTERPRETING_AT_IMPORT:  # Triton itself would fail with "0 active drivers"
            raise RuntimeError(
                f"{name} is on the CPU and TRITON_INTERPRET is set, but it was set after the "
                "kernels were imported, and Triton chooses the interpreter at import: set it "
                "before importing fused_rope or corope"
            )
        return
    raise ValueError(
        f"{name} is on {device}: the Triton kernels need a CUDA tensor "
        "(or TRITON_INTERPRET=1 set before import to run them on the CPU, slowly); "
        "the PyTorch references in the package's naive.py run anywhere"
    )


def as_device(device, name: str = "device") -> torch.device:
    """``device`` (a ``torch.device``, a string such as ``"cuda:1"``, an int GPU index, or None
    for the CPU) as a ``torch.device``; errors name ``name``."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"{name} must be a torch.device, a string or None, got {type(device).__name__}"
        )
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"{name} is not a device: {device!r} ({error})") from None


def check_bool(value, name: str) -> None:
    """``value`` is a ``bool`` (not a truthy string or number, which would switch an option on
    silently: ``"False"`` is true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_window(window, causal: bool, keys: int | None = None) -> int:
    """A causal sliding window: ``None`` (none) or a positive int, the keys a query sees, its
    own included (transformers' ``sliding_window``; FlashAttention's ``window_size=(window - 1,
    0)``). Returns it as an int, 0 for none (the kernels' convention), and 0 too for a window of
    at least ``keys`` (given: NK), which holds every key a query sees causally."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be an int or None, got {type(window).__name__} {window!r}")
    if window < 1:
        raise ValueError(f"window must be at least 1 (the query's own key), got {window}")
    if not causal:
        raise ValueError(f"window={window} needs causal=True (a window left of the diagonal)")
    return 0 if keys is not None and window >= keys else int(window)


def may_overlap(x: torch.Tensor) -> bool:
    """Whether two elements of ``x`` may share memory: False when, with the dimensions sorted
    by stride, each stride passes the furthest offset the smaller ones reach (a sufficient
    test; the rare non-overlapping layouts it cannot prove, such as strides that interleave,
    count as overlapping)."""
    # By stride alone (two dimensions of one stride overlap in either order), in an insertion
    # sort: Dynamo traces no sorted() of symbolic strides (torch.compile(dynamic=True)).
    dims = []
    for stride, size in zip(x.stride(), x.shape, strict=True):
        if size > 1:
            at = 0
            while at < len(dims) and dims[at][0] <= stride:
                at += 1
            dims.insert(at, (stride, size))
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def runs_eagerly(*tensors: torch.Tensor | None) -> bool:
    """Whether a launcher may run its kernels directly rather than through its torch custom op:
    no ``torch.compile``, no ``torch.jit.trace``, no dispatch mode (FakeTensorMode, make_fx's
    tracer, torch.export's) and plain tensors (None: an input not given). Tracers need the op:
    a Triton launch on a fake or proxy tensor fails, and one under ``jit.trace`` would be
    missing from the trace."""
    return (
        not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and _get_current_dispatch_mode() is None
        and all(x is None or type(x) is torch.Tensor for x in tensors)
    )


def check_no_tangent(reference: str, **tensors: torch.Tensor | None) -> None:
    """The kernels' custom ops have a backward but no forward-mode derivative, and PyTorch
    drops the tangents of such an op's inputs (a silent zero): refuse inputs that carry one
    (``torch.func.jvp``, ``torch.autograd.forward_ad``): q, k, v and the frequencies,
    positions or angles alike (None: not given); and the cotangents a backward receives
    (forward-over-reverse), which its kernels would drop as well. ``reference``: the PyTorch
    function that does have one. Not under ``torch.compile``, which has no forward mode."""
    if torch.compiler.is_compiling():
        return
    for name, x in tensors.items():
        if x is not None and forward_ad.unpack_dual(x).tangent is not None:
            raise NotImplementedError(
                f"{name} carries a forward-mode tangent (torch.func.jvp or "
                "torch.autograd.forward_ad), but the Triton kernels have no forward-mode "
                f"derivative; use {reference}"
            )


def under_functorch() -> bool:
    """Whether a torch.func transform (grad, vjp, vmap, jacrev, jvp) wraps the current call."""
    return torch._C._functorch.maybe_current_level() is not None


def check_no_functorch(reference: str) -> None:
    """torch.func transforms (grad, vjp, vmap, jacrev) refuse the autograd of a torch custom
    op (PyTorch's own message then names an autograd.Function the caller never wrote): refuse
    them here, naming the ways that work. Not under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return
    if under_functorch():
        raise NotImplementedError(
            "torch.func transforms (grad, vjp, vmap, jacrev) do not support this Triton "
            "kernel's custom op; differentiate with torch.autograd (loss.backward(), "
            f"torch.autograd.grad), or use {reference}"
        )


def refuse_double_backward(backward_op, reference: str) -> None:
    """Gives a kernel's backward custom op an autograd that refuses to run: a gradient of
    the gradients (``create_graph=True``, then a backward through the first one's results)
    got PyTorch's message about an op "no autograd formula was registered" for, which names
    no way out; this one names ``reference``, whose autograd differentiates twice."""

    def refuse(ctx, *grads):
        raise NotImplementedError(
            f"{backward_op._qualname} has no derivative: the Triton kernels give first-order "
            f"gradients only (create_graph=True cannot be differentiated again); for a "
            f"gradient of the gradients use {reference}"
        )

    backward_op.register_autograd(refuse)


def eager_function(name: str, launch, setup_context, backward) -> type[torch.autograd.Function]:
    """An autograd.Function named ``name`` (its nodes ``{name}Backward``) that runs
    ``launch(*inputs)`` (a custom op's body) with the op's autograd formula (``setup_context``,
    ``backward``, as given to ``register_autograd``): the op's eager path without the op's
    dispatch. Tracers need the op (``runs_eagerly``). On an H200's host the dispatch cost
    118-224 us of a 1.0-1.1 ms eager forward+backward of ``rope_attention`` at Small-1K, and
    48-231 us of a 1.4-1.5 ms one of ``corope_attention`` at N = 512 (two runs of
    ``experiments/host_cost.py --gpu``). The cotangent of an output that is not used arrives as
    None, not as zeros as in the op's autograd: ``backward`` must take None."""

    def forward(ctx, *inputs):
        ctx.set_materialize_grads(False)
        output = launch(*inputs)
        setup_context(ctx, inputs, output)
        return output

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods)


def checked(check):
    """A decorator: ``fn`` runs after ``check`` has seen its arguments (the custom ops' bodies,
    whose callers through ``torch.ops`` skip the public functions' checks)."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            check(*args, **kwargs)
            return fn(*args, **kwargs)

        return run

    return wrap


def on_input_device(fn):
    """``fn``, whose first parameter is a tensor, run with the current CUDA device set to that
    tensor's. Triton launches a kernel on the current device whatever its tensors' device: a
    call on ``cuda:1`` tensors while ``cuda:0`` is current would run on ``cuda:0`` over the
    other GPU's memory (an illegal-address fault, or peer traffic), as under Hugging Face's
    ``device_map``, which spreads a model's layers over GPUs. On the public functions, for
    eager calls (a traced call leaves the guard to the ops the graph calls), and on the custom
    ops' bodies, which compiled graphs call whatever the backend (Inductor guards its device,
    the eager backends do not). A backward needs none: the autograd engine runs a device's
    backward on that device's thread."""
    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def on_device(*args, **kwargs):
        x = args[0] if args else kwargs.get(first)
        if (
            not torch.compiler.is_compiling()
            and isinstance(x, torch.Tensor)
            and x.is_cuda
            and x.device.index != torch.cuda.current_device()
        ):
            with torch.cuda.device(x.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return on_device


def needs_autograd(*xs: torch.Tensor | None) -> bool:
    """Whether a call on ``xs`` (None: an input not given) may be differentiated: autograd
    records it (grad mode, an input requiring grad) or a torch.func transform wraps the inputs.
    The RoPE launchers then go through their autograd.Function (otherwise they run directly,
    without its bookkeeping: host time a decoding step does not need), and ``rope_attention``'s
    "auto" keeps the path whose backward is faster. (Forward-mode tangents are refused before:
    ``check_no_tangent``.)"""
    differentiable = any(x is not None and x.requires_grad for x in xs)
    return (torch.is_grad_enabled() and differentiable) or under_functorch()


def backward_launches_directly(*tensors: torch.Tensor | None) -> bool:
    """Whether a kernel's backward may run its launcher directly, rather than through its
    custom op or autograd.Function: the backward runs eagerly (``runs_eagerly`` over every
    tensor it reads, saved ones and cotangents alike) and is not itself recorded
    (``create_graph=True`` turns grad mode on; torch.func's transforms record it too)."""
    return not torch.is_grad_enabled() and not under_functorch() and runs_eagerly(*tensors)


def check_inv_freq(inv_freq, rope_dim: int, dtypes=FREQ_DTYPES) -> None:
    """``inv_freq`` is a ``[rope_dim // 2]`` tensor of one of ``dtypes`` (default fp32 or fp64:
    frequencies rounded to half precision put far positions off by whole radians)."""
    check_float_tensor(inv_freq, "inv_freq", ndim=1, dtypes=dtypes)
    check_finite_on_cpu(inv_freq, "inv_freq")
    if inv_freq.shape[0] != rope_dim // 2:
        raise ValueError(
            f"inv_freq must have rope_dim // 2 = {rope_dim // 2} entries, got {inv_freq.shape[0]}"
        )


def is_finite(x) -> bool:
    """``math.isfinite`` for a real number, written with comparisons (NaN fails both) so that
    Dynamo traces it where the number is symbolic: ``torch.compile(dynamic=True)`` makes float
    arguments, defaults included, symbolic, and has no ``math.isfinite`` for them."""
    return -math.inf < x < math.inf


def check_scale(value, name: str, limit: float = FP32_MAX) -> float:
    """A scale (``output_scale``, ``attention_factor``, ...) as a float: a real number (numpy's
    included) of magnitude below ``limit``, by default the fp32 range the kernels hold it in."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not -limit < value < limit:  # NaN fails too
        raise ValueError(f"{name} must be finite, of magnitude below {limit:.6g}, got {value}")
    return float(value)


def check_attention_factor(value, limit: float = FP32_MAX) -> float:
    """``attention_factor`` (YaRN's and LongRoPE's magnitude of the rotated channels) as a
    float: positive, where an output scale may be negative. 0 would erase the rotated channels,
    and a negative factor cancels in the attention's products, hiding the mistake there."""
    value = check_scale(value, "attention_factor", limit)
    if value <= 0:
        raise ValueError(f"attention_factor must be positive, got {value}")
    return value


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale`` as a float: a positive finite number, or ``1 / sqrt(head_dim)`` for
    None."""
    if softmax_scale is None:
        # int(): under torch.compile(dynamic=True) the head dim is symbolic; the kernels
        # specialise on it anyway, and a symbolic scale would reach the numeric checks.
        return int(head_dim) ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a number, got {type(softmax_scale).__name__}")
    # The kernels hold it in fp32, times log2(e) (their softmax runs on exp2); NaN fails too.
    if not 0 < softmax_scale < SOFTMAX_SCALE_MAX:
        raise ValueError(
            f"softmax_scale must be positive and below {SOFTMAX_SCALE_MAX:.6g} (finite in fp32 "
            f"times log2(e)), got {softmax_scale!r}"
        )
    return float(softmax_scale)


def check_rope_dim(rope_dim: int | None, head_dim: int) -> int:
    """Resolves ``rope_dim`` (default: the head dim) and checks it is even and at most D."""
    if rope_dim is None:
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(
                f"the head dim (the inputs' last dimension) must be even and positive to "
                f"rotate all its channels (rope_dim=None), got {head_dim}; or pass an even "
                "rope_dim below it"
            )
        rope_dim = int(head_dim)  # a Python int under torch.compile(dynamic=True), as above
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, numbers.Integral):
        raise TypeError(f"rope_dim must be an int, got {type(rope_dim).__name__}")
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(
            f"rope_dim must be even, positive and at most the head dim {head_dim}, got {rope_dim}"
        )
    return int(rope_dim)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_angles(angles, batch: int, seq_len: int, rope_dim: int, name: str = "angles") -> None:
    """``angles`` is ``[N, R/2]``, ``[1, N, R/2]`` (both shared by the batch) or ``[B, N, R/2]``
    and matches the input's B and N."""
    check_float_tensor(angles, name, ndim=(2, 3))
    if angles.shape[-2] != seq_len:
        raise ValueError(f"{name} has {angles.shape[-2]} positions but the input has N={seq_len}")
    if angles.shape[-1] != rope_dim // 2:
        raise ValueError(
            f"{name} has last dimension {angles.shape[-1]}, expected rope_dim // 2 = {rope_dim // 2}"
        )
    if angles.dim() == 3 and angles.shape[0] not in (1, batch):
        raise ValueError(f"{name} has batch {angles.shape[0]} but the input has B={batch} (or 1)")
    check_finite_on_cpu(angles, name)


def check_position_tensor(positions, name: str, ndim: tuple[int, ...] | None = None) -> None:
    """Integer (not bool) or floating-point tensor with one of ``ndim`` dimensions."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype in (torch.bool, torch.float16, torch.bfloat16) or positions.is_complex():
        raise TypeError(
            f"{name} must be an integer, fp32 or fp64 tensor, got dtype {positions.dtype} "
            "(half precision holds integers exactly only up to 2048 (fp16) or 256 (bf16))"
        )
    if ndim is not None and positions.dim() not in ndim:
        raise ValueError(
            f"{name} must have {' or '.join(map(str, ndim))} dimensions, "
            f"got shape {tuple(positions.shape)}"
        )
    check_finite_on_cpu(positions, name)


def autocast_inputs(q, k, v):
    """q, k, v as SDPA takes them under autocast (on q's device type): floating-point tensors
    other than fp64 in autocast's dtype. The attention functions start with it, so that their
    kernels, which autocast does not reach, compute and return what SDPA would (and
    ``rope_attention``'s paths, one of which is SDPA, one dtype)."""
    if not isinstance(q, torch.Tensor) or not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    eligible = lambda x: (
        isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
    )
    return tuple(x.to(dtype) if eligible(x) else x for x in (q, k, v))


def check_finite_on_cpu(x: torch.Tensor, name: str) -> None:
    """A floating-point tensor on the CPU holds no NaN or infinity (their angles would be NaN,
    and so every output they reach). Read in eager mode on the CPU only: on a GPU the check
    would wait for the device at every call, and a tracer's tensors hold no values."""
    if x.is_floating_point() and x.device.type == "cpu" and x.numel() and runs_eagerly(x):
        bad = ~x.isfinite()
        if bool(bad.any()):
            raise ValueError(f"{name} must be finite, got {x[bad][0].item()}")


def check_attention_shapes(q, k, v) -> None:
    """``q [B, HQ, NQ, D]``, ``k`` and ``v`` ``[B, HKV, NK, D]`` of one shape, ``HQ`` a
    multiple of ``HKV >= 1`` (GQA; ``HQ = 0`` gives empty outputs); the tensors' own checks
    come first."""
    B, HQ, _, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or v.shape != k.shape:
        raise ValueError(
            f"k and v must be [B={B}, HKV, NK, D={D}] and equal, got k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    HKV = k.shape[1]
    if HKV == 0 or HQ % HKV:
        raise ValueError(f"q's {HQ} heads must be a multiple of k's {HKV} heads (GQA)")


def check_qkv(q, k, v) -> torch.device:
    """``q [B, HQ, NQ, D]``, ``k, v [B, HKV, NK, D]``: 4-d tensors of one of ``KERNEL_DTYPES``,
    one dtype, one device (returned), grouped heads (``check_attention_shapes``)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(x, name, ndim=4, dtypes=KERNEL_DTYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = check_same_device(q=q, k=k, v=v)
    check_attention_shapes(q, k, v)
    return device


def check_op_tensors(q, inv_freq, rope_dim: int, *, like_q=(), rows=(), **others) -> None:
    """What the attention kernels assume of the tensors their custom ops pass them, checked in
    the ops' bodies: a call through ``torch.ops`` (``torch.ops.fused_rope.rope_attention_fwd``,
    ``torch.ops.corope.attention``, ...) skips the public functions' checks, and the kernels
    index by these shapes, so a shorter ``inv_freq`` or ``o`` would be read past its end. The
    caller checks ``q [B, HQ, NQ, D]``, k and v first (``check_attention_shapes`` or Co-RoPE's
    own); here: q of ``KERNEL_DTYPES``, ``inv_freq`` ``[rope_dim / 2]`` fp32 or fp64,
    ``like_q`` (name, tensor) pairs of q's shape and dtype (o and its cotangent), ``rows``
    (name, tensor or None) pairs of fp32 ``[B, HQ, NQ]`` (the LSE and its cotangent), and all of
    them and ``others`` (k, v) on q's device."""
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"q must have dtype in {[str(d) for d in KERNEL_DTYPES]}, got {q.dtype}")
    check_inv_freq(inv_freq, check_rope_dim(rope_dim, q.shape[-1]))
    for name, x in like_q:
        check_float_tensor(x, name)
        if x.shape != q.shape or x.dtype != q.dtype:
            raise ValueError(
                f"{name} must have q's shape {tuple(q.shape)} and dtype {q.dtype}, got "
                f"{tuple(x.shape)} {x.dtype}"
            )
    rows = [(name, x) for name, x in rows if x is not None]
    for name, x in rows:
        check_float_tensor(x, name, dtypes=(torch.float32,))
        if x.shape != q.shape[:3]:
            raise ValueError(
                f"{name} must be [B, HQ, NQ] = {tuple(q.shape[:3])}, got {tuple(x.shape)}"
            )
    check_same_device(q=q, **others, inv_freq=inv_freq, **dict(like_q), **dict(rows))


def _check_position_rows(pos, name: str, batch: int, length: int, device) -> None:
    if pos is None:
        return
    check_position_tensor(pos, name, ndim=(1, 2))  # as rope_angles: no half precision
    if pos.shape[-1] != length or (pos.dim() == 2 and pos.shape[0] not in (1, batch)):
        expected = f"[{length}] or [1, {length}]" + (
            f" or [{batch}, {length}]" if batch > 1 else ""
        )
        raise ValueError(f"{name} must have shape {expected}, got {tuple(pos.shape)}")
    if pos.device != device:
        raise ValueError(f"{name} is on {pos.device} but q is on {device}")


def check_rotation_inputs(
    q, nk: int, rope_dim: int, *, inv_freq, positions, q_positions, angles, q_angles
) -> None:
    """Attention's rotation arguments for ``q [B, HQ, NQ, D]`` and ``nk`` keys: ``inv_freq``
    ``[R/2]``; ``positions`` ``[NK]`` or ``[1 | B, NK]`` and ``q_positions`` ``[NQ]`` or
    ``[1 | B, NQ]`` (``q_positions`` needed for NQ > NK with explicit positions); or
    ``angles`` and ``q_angles`` in their place (``check_angle_options``); all on q's device."""
    B, _, NQ, _ = q.shape
    if inv_freq is not None:  # theta is checked where its frequencies are made
        check_inv_freq(inv_freq, rope_dim)
        check_same_device(q=q, inv_freq=inv_freq)
    _check_position_rows(positions, "positions", B, nk, q.device)
    _check_position_rows(q_positions, "q_positions", B, NQ, q.device)
    check_angle_options(
        angles, q_angles, inv_freq=inv_freq, positions=positions, q_positions=q_positions,
        batch=B, nq=NQ, nk=nk, rope_dim=rope_dim,
    )  # fmt: skip
    check_same_device(q=q, angles=angles, q_angles=q_angles)
    if q_positions is None and positions is not None and NQ > nk:
        raise ValueError(
            f"NQ={NQ} > NK={nk}: queries cannot take the last NQ key positions; pass q_positions"
        )


def check_angle_options(
    angles, q_angles, *, inv_freq, positions, q_positions, batch: int, nq: int, nk: int,
    rope_dim: int,
) -> None:  # fmt: skip
    """Attention's ``angles`` (keys ``[NK, R/2]``, ``[1 | B, NK, R/2]``) and ``q_angles``
    (queries ``[NQ, R/2]``, ``[1 | B, NQ, R/2]``): given angles replace ``positions * inv_freq``,
    so they exclude ``inv_freq``, ``positions`` and ``q_positions``; queries default to the
    last NQ rows of ``angles``, which needs ``NQ <= NK``."""
    if angles is None:
        if q_angles is not None:
            raise ValueError(
                "q_angles needs angles (the keys' angles); for positions use q_positions"
            )
        return
    given = [name for name, x in (("inv_freq", inv_freq), ("positions", positions),
                                  ("q_positions", q_positions)) if x is not None]  # fmt: skip
    if given:
        raise ValueError(
            f"angles replace positions * inv_freq: pass angles or {', '.join(given)}, not both"
        )
    # fp32 or fp64, as inv_freq and positions: in half precision, angles of far positions
    # are off by whole radians
    for name, x, n in (("angles", angles, nk), ("q_angles", q_angles, nq)):
        if x is not None:
            check_float_tensor(x, name, dtypes=FREQ_DTYPES)
            check_angles(x, batch, n, rope_dim, name)
    if q_angles is None and nq > nk:
        raise ValueError(
            f"NQ={nq} > NK={nk}: queries cannot take the last NQ rows of angles; pass q_angles"
        )
