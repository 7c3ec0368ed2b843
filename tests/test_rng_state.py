"""The leaf RNG capture: every generator comes back, extra ones included, and capturing does not
consume randomness."""

from __future__ import annotations

import doctest
import random

import numpy as np
import torch

from stalwart import rng_state
from stalwart.reliability.rerun.rng import RngStateTracker


def test_docstring_example_runs() -> None:
    assert doctest.testmod(rng_state).failed == 0


def test_every_generator_and_the_extra_ones_come_back() -> None:
    extra = torch.Generator().manual_seed(3)
    tracker = RngStateTracker()
    tracker.register_generator("tp", extra.get_state, extra.set_state)
    state = rng_state.capture_rng_state(tracker)
    first = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=extra))
    rng_state.restore_rng_state(state, tracker)
    again = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=extra))
    assert first[:2] == again[:2]
    assert torch.equal(first[2], again[2]) and torch.equal(first[3], again[3])
