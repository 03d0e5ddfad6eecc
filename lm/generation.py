"""Text generation with a KV cache, for every attention of ``lm.attention``.

``generate`` runs the prompt once (prefill), then one token per step: each step's query
attends to the keys and values that ``KVCache`` kept from every earlier position (a layer
with a sliding window keeps only the last ones its queries see). RoPE
caches its keys rotated at their positions; Co-RoPE caches them as the layer projected them
and rotates them at each call, as it must: its rotation of key ``j`` for query ``i`` depends
on the mileage from ``j`` to ``i``, which the new query's gates set. So a cached call
computes what a forward over the sequence so far computes at its rows
(``tests/lm/test_generation.py`` checks it for every attention). One exception: dynamic
NTK and LongRoPE, whose frequencies follow the sequence length, so their cache holds the keys
unrotated too and rotates them at their positions at each call. The first layer's keys are
rotated with the frequencies of the current length, but a deeper layer's cached keys come
from hidden states computed at the lengths of their time, where a forward over the whole
sequence would recompute them: past the original length such a model decodes close to, not
exactly as, the forward (``use_cache=False`` decodes exactly, at the cost of a forward per
token).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from lm.data.base import check_int
from lm.evaluation import autocast
from lm.model import GPT


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device, ``cuda`` being the current CUDA device."""
    if a.type != b.type:
        return False
    current = torch.cuda.current_device() if a.type == "cuda" else None
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )


class KVCache:
    """The keys and values of every layer for the tokens a model has seen so far.

    ``GPT.forward(idx, cache)`` appends each layer's keys and values of ``idx``'s tokens
    (``append``) and then advances ``length`` by their number, which commits them: a forward
    that fails before it (out of memory, interrupted) leaves the cache as it was, and a
    second ``append`` to a layer before ``advance`` replaces the first. The buffers are
    allocated at the first append, ``[B, HKV, rows, D]`` in the keys' dtype and device (bf16
    under autocast). Inference only: the appended tensors must not require grad.

    A layer with a sliding window (its queries see their last ``window`` keys, transformers'
    ``sliding_window``) keeps only the last ``window - 1`` tokens between calls, the keys the
    next token sees besides its own: its buffer has ``min(capacity, 2 * window)`` rows, and
    when a call's tokens do not fit after the held ones, those move to the front (one copy of
    ``window - 1`` rows every ``window + 1`` decoding steps at least). Its memory and each
    step's attention then grow with the window, not with the sequence, as Mistral's rolling
    buffer cache does (the keys dropped are those no later query sees, so a cached call
    computes what it computed with every key held; Co-RoPE's mileage to a key it sees sums
    the gates of the keys between them, all held too).

    Args:
        n_layer: the model's number of layers.
        capacity: the most tokens the cache will see (prompt + generated).
        windows: each layer's sliding window (an int >= 1) or None (every key held); default
            None for every layer. ``KVCache.for_model`` takes them from a model.
    """

    def __init__(
        self, n_layer: int, capacity: int, windows: Sequence[int | None] | None = None
    ) -> None:
        self.n_layer = check_int("n_layer", n_layer, 1)
        self.capacity = check_int("capacity", capacity, 1)
        if windows is None:
            windows = [None] * n_layer
        if not isinstance(windows, Sequence) or isinstance(windows, str):
            raise TypeError(f"windows must be a sequence of ints or None, got {windows!r}")
        if len(windows) != n_layer:
            raise ValueError(f"windows must hold one entry a layer ({n_layer}), got {len(windows)}")
        self.windows = [
            None if w is None else check_int(f"windows[{i}]", w, 1) for i, w in enumerate(windows)
        ]
        self.length = 0  # tokens seen
        # each layer's buffer rows: 2 * window give a window's keys room for window + 1 more
        self._rows = [capacity if w is None else min(capacity, 2 * w) for w in self.windows]
        self._start = [0] * n_layer  # the held tokens are rows start:end of the buffer
        self._end = [0] * n_layer
        # what advance() commits, per layer that appended: (N, start, end, tail), tail the
        # keys and values to write to the front first (a chunk longer than the buffer)
        self._staged: list[tuple | None] = [None] * n_layer
        self._k: list[torch.Tensor | None] = [None] * n_layer
        self._v: list[torch.Tensor | None] = [None] * n_layer

    @classmethod
    def for_model(cls, model: GPT, capacity: int) -> KVCache:
        """A cache for ``model``'s layers, each with its attention's sliding window."""
        return cls(len(model.blocks), capacity, [block.attn.window for block in model.blocks])

    def nbytes(self) -> int:
        """Bytes of the buffers allocated so far (keys and values of every layer)."""
        return sum(b.nbytes for b in self._k + self._v if b is not None)

    def _check_layer(self, layer: int) -> int:
        return check_int("layer", layer, 0, self.n_layer - 1)

    def held(self, layer: int) -> int:
        """The tokens slot ``layer`` holds: ``length``, or at most ``window - 1`` once
        ``length`` has passed them."""
        layer = self._check_layer(layer)
        return self._end[layer] - self._start[layer]

    def check_window(self, layer: int, window: int | None) -> None:
        """ValueError unless slot ``layer`` keeps the keys that a layer of sliding window
        ``window`` (None: every key) needs: every token, or the last ``w - 1`` for a window
        ``w >= window``."""
        kept = self.windows[self._check_layer(layer)]
        if kept is not None and (window is None or kept < window):
            raise ValueError(
                f"layer {layer}'s cache keeps its last {kept - 1} tokens (window {kept}), but "
                f"the layer's window is {window} (None: every key): build the cache with "
                "KVCache.for_model(model, capacity)"
            )

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores ``k`` and ``v`` ``[B, HKV, N, D]`` of the ``N`` tokens after the ``length``
        seen ones in slot ``layer`` (held from ``advance`` on); returns the keys and values of
        the tokens it holds (every one, or a windowed layer's last ``window - 1`` or fewer)
        followed by the new ones, ``[B, HKV, held + N, D]`` each (views of the buffers, or,
        for a chunk longer than a windowed layer's buffer, new tensors)."""
        layer = self._check_layer(layer)
        if k.shape != v.shape or k.ndim != 4:
            raise ValueError(
                f"k and v must be [B, HKV, N, D] of one shape, got {tuple(k.shape)} and "
                f"{tuple(v.shape)}"
            )
        if not k.is_floating_point() or v.dtype != k.dtype or v.device != k.device:
            raise ValueError(
                f"k and v must be floating point of one dtype and device, got {k.dtype} on "
                f"{k.device} and {v.dtype} on {v.device}"
            )
        if k.requires_grad or v.requires_grad:
            raise ValueError("KVCache is for inference: run the model under torch.no_grad()")
        N = k.shape[2]
        if self.length + N > self.capacity:
            raise ValueError(
                f"the cache holds {self.length} of its capacity {self.capacity} tokens and "
                f"cannot take {N} more"
            )
        # Buffers of the first call's shape, made while nothing is committed (every layer has
        # appended by the first advance): a retry of a first call that failed, say out of
        # memory, may bring another batch, dtype or device
        if self.length == 0:
            B, HKV, _, D = k.shape
            self._k[layer] = k.new_empty(B, HKV, self._rows[layer], D)
            self._v[layer] = v.new_empty(B, HKV, self._rows[layer], D)
        buf_k, buf_v = self._k[layer], self._v[layer]
        held = (buf_k.shape[:2], buf_k.shape[3], buf_k.dtype, buf_k.device)
        if (k.shape[:2], k.shape[3], k.dtype, k.device) != held:
            raise ValueError(
                f"layer {layer}'s cache holds [B, HKV, *, D] = {tuple(buf_k.shape)} in "
                f"{buf_k.dtype} on {buf_k.device}, got keys {tuple(k.shape)} in {k.dtype} on "
                f"{k.device}"
            )
        window, start, end = self.windows[layer], self._start[layer], self._end[layer]
        # Only a windowed layer's tokens can overflow its buffer (the others' has capacity
        # rows, and end == length there)
        if end + N > buf_k.shape[2]:
            n_held = end - start
            if n_held + N > buf_k.shape[2]:  # a chunk longer than the buffer (a long prompt)
                keys = torch.cat([buf_k[:, :, start:end], k], 2)
                values = torch.cat([buf_v[:, :, start:end], v], 2)
                first = max(0, keys.shape[2] - (window - 1))  # the first token kept
                # copies: views would keep the whole chunk's keys alive until advance
                tail = (keys[:, :, first:].clone(), values[:, :, first:].clone())
                self._staged[layer] = (N, 0, keys.shape[2] - first, tail)
                return keys, values
            # The held tokens move to the front, committed at once (the same tokens, held
            # elsewhere); clone: the rows overlap where start < n_held
            buf_k[:, :, :n_held] = buf_k[:, :, start:end].clone()
            buf_v[:, :, :n_held] = buf_v[:, :, start:end].clone()
            start, end = self._start[layer], self._end[layer] = 0, n_held
        buf_k[:, :, end : end + N] = k  # past the held rows: a failed call leaves them as they are
        buf_v[:, :, end : end + N] = v
        # the next call's queries see none before its last window - 1
        new_start = start if window is None else max(start, end + N - (window - 1))
        self._staged[layer] = (N, new_start, end + N, None)
        return buf_k[:, :, start : end + N], buf_v[:, :, start : end + N]

    def advance(self, n: int) -> None:
        """Counts ``n`` more tokens seen, once every layer has appended theirs, and commits
        what each layer appended (the ``n`` tokens' keys and values)."""
        check_int("n", n, 0)
        if self.length + n > self.capacity:
            raise ValueError(
                f"the cache holds {self.length} of its capacity {self.capacity} tokens and "
                f"cannot count {n} more"
            )
        appended = [0 if st is None else st[0] for st in self._staged]
        wrong = {i: N for i, N in enumerate(appended) if N != n}
        if wrong:
            raise ValueError(
                f"advance({n}) needs every layer to have appended {n} tokens, got "
                f"{{layer: N}} {wrong}"
            )
        for layer, staged in enumerate(self._staged):
            if staged is None:
                continue
            _, self._start[layer], self._end[layer], tail = staged
            if tail is not None:
                self._k[layer][:, :, : tail[0].shape[2]] = tail[0]
                self._v[layer][:, :, : tail[1].shape[2]] = tail[1]
            self._staged[layer] = None
        self.length += n


def check_sampling(temperature: float, top_k: int | None) -> None:
    """ValueError/TypeError naming ``temperature`` (a finite float >= 0) or ``top_k`` (None or
    an int >= 1)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not 0 <= temperature < math.inf:  # NaN fails too
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if top_k is not None:
        check_int("top_k", top_k, 1)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Token ids ``(B,)`` int64 drawn from ``logits (B, V)``: the argmax at temperature 0,
    else a sample of ``softmax(logits / temperature)`` restricted to the ``top_k`` most
    likely ids (exactly ``top_k``, ties at the last place broken by ``topk``; None: all)."""
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a floating-point tensor (B, V), got {shape}")
    check_sampling(temperature, top_k)
    if temperature == 0:
        return logits.argmax(-1)
    # float64: a finite temperature past fp32's range (1e39) stays finite, so -inf / T is -inf
    logits = logits.double()
    # The top k of the logits as given: divided by a large temperature they could all round
    # to 0 (ties that topk breaks by index, not by likelihood).
    if top_k is not None and top_k < logits.shape[-1]:
        top = logits.topk(top_k, dim=-1)  # (B, top_k) values and ids
        logits = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
    # Shifted first: logits / 1e-40 would overflow to inf and the softmax to NaN.
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop_token: int | None = None,
) -> torch.Tensor:
    """Continues ``prompt`` by up to ``max_new_tokens`` tokens, one at a time.

    Args:
        model: a ``GPT``; run in eval mode (dropout off), its mode restored after; under
            bf16 autocast on CUDA, as in training.
        prompt: int64 token ids ``(B, P)``, ``P >= 1``, on the model's device.
        max_new_tokens: tokens to add; ``P + max_new_tokens <= model.max_len``.
        temperature: 0 takes the most likely token (greedy); otherwise the logits are divided
            by it before sampling.
        top_k: sample among the ``top_k`` most likely tokens only (None: all).
        generator: the random source of the sampling, on the model's device (None: torch's
            global one).
        use_cache: reuse the keys and values of earlier positions (``KVCache``); False runs
            the whole sequence at every step (the reference the cache is tested against).
        stop_token: a sequence is done once it generates this id (a dataset's ``eos_id``):
            its later positions repeat it, and decoding ends when every sequence is done.
            None: always ``max_new_tokens`` steps.

    Returns:
        ``(B, P + n)`` int64: the prompt followed by the new tokens, ``n = max_new_tokens``
        unless every sequence generated ``stop_token`` first (then ``n`` is the step at
        which the last one did).
    """
    # torch.compile(model) wraps the module; the loop below runs eagerly either way (a
    # compiled model, model.compile()'s too, would compile again for every cache length)
    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, GPT):
        raise TypeError(f"model must be an lm.model.GPT, got {type(model).__name__}")
    if not isinstance(prompt, torch.Tensor):
        raise TypeError(f"prompt must be a torch.Tensor, got {type(prompt).__name__}")
    if prompt.dtype != torch.int64 or prompt.ndim != 2 or 0 in prompt.shape:
        raise ValueError(
            f"prompt must be int64 token ids (B, P) with B, P >= 1, got {prompt.dtype} "
            f"{tuple(prompt.shape)}"
        )
    device = model.lm_head.weight.device
    if prompt.device != device:
        raise ValueError(f"prompt is on {prompt.device}, the model on {device}")
    vocab_size = model.tok_emb.num_embeddings
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab_size:
        raise ValueError(
            f"prompt ids must be in [0, {vocab_size}), got [{int(prompt.min())}, "
            f"{int(prompt.max())}]"
        )
    check_int("max_new_tokens", max_new_tokens, 0)
    total = prompt.shape[1] + max_new_tokens
    if total > model.max_len:
        raise ValueError(
            f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds the model's max_len {model.max_len}"
        )
    check_sampling(temperature, top_k)
    if stop_token is not None:
        check_int("stop_token", stop_token, 0, vocab_size - 1)
    if not isinstance(use_cache, bool):
        raise TypeError(f"use_cache must be a bool, got {type(use_cache).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator is not None and not _same_device(generator.device, device):
        raise ValueError(f"generator is on {generator.device}, the model on {device}")

    was_training = model.training
    model.eval()
    tokens = prompt
    cache = KVCache.for_model(model, total) if use_cache else None
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    try:
        with autocast(device), torch.compiler.set_stance("force_eager"):
            step_input = prompt
            for _ in range(max_new_tokens):
                # the last row's logits only: a long prompt's (B, P, V) need not exist
                logits = model(step_input if use_cache else tokens, cache, logits_to_keep=1)
                next_id = sample_next(logits[:, -1], temperature, top_k, generator)
                if stop_token is not None:
                    next_id = next_id.masked_fill(done, stop_token)
                    done |= next_id == stop_token
                tokens = torch.cat([tokens, next_id[:, None]], dim=1)
                step_input = next_id[:, None]
                if stop_token is not None and bool(done.all()):  # one sync a step
                    break
    finally:
        model.train(was_training)
    return tokens
