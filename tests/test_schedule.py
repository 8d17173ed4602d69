import math

import pytest

from megatron.schedule import learning_rate

BASE = dict(lr=1e-3, min_lr=1e-4, warmup_iters=10, decay_iters=110)


@pytest.mark.parametrize("it,expected", [(1, 1e-4), (5, 5e-4), (10, 1e-3), (60, 5.5e-4), (110, 1e-4), (500, 1e-4)])
def test_cosine_golden(it, expected):
    assert math.isclose(learning_rate(it, style="cosine", **BASE), expected, rel_tol=1e-12)


@pytest.mark.parametrize("it,expected", [(35, 7.75e-4), (60, 5.5e-4), (110, 1e-4), (111, 1e-4)])
def test_linear_golden(it, expected):
    assert math.isclose(learning_rate(it, style="linear", **BASE), expected, rel_tol=1e-12)


def test_constant_after_warmup():
    assert learning_rate(3, style="constant", **BASE) == pytest.approx(3e-4)
    assert learning_rate(1000, style="constant", **BASE) == 1e-3


def test_no_warmup_starts_at_peak():
    assert learning_rate(1, lr=1e-3, min_lr=0.0, warmup_iters=0, decay_iters=100, style="cosine") == pytest.approx(
        1e-3 * 0.5 * (1 + math.cos(math.pi / 100)))


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="lr_decay_style"):
        learning_rate(20, style="exponentialish", **BASE)
