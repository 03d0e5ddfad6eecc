"""lm/checkpoint.py's pieces that the resume tests reach only indirectly."""

import torch

from lm.checkpoint import rng_state, set_rng_state


def test_rng_state_round_trips():
    """A resumed run draws what the uninterrupted one would have: the restored generator
    repeats the draws after the saved state (the training steps reseed each step, so the
    resume tests pass without this; anything that draws before the reseed would not)."""
    state = rng_state()
    drawn = torch.rand(4)
    torch.rand(7)  # the generator moves on
    set_rng_state(state)
    assert torch.equal(torch.rand(4), drawn)
