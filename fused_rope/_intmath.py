"""Integer arithmetic for the launchers, in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction`` objects (Triton 3.6
and later): called from Python each takes about 4 us on this project's CPU, where the
arithmetic itself takes 0.05, and a decoding step's launchers called them about ten times a
layer. Kernels keep ``tl.cdiv``.
"""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers and ``b > 0``, as ``triton.cdiv``."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The least power of two ``>= n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()
