"""The shared tolerance helper fails what it must (tests/helpers.py)."""

import pytest
import torch

from tests.helpers import assert_close_to_baseline, rounding_noise


def _case(dtype):
    ref = torch.randn(4096, dtype=torch.float64)
    return ref, ref.to(dtype)  # the baseline: exact math, rounded once


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rounded_result_passes(dtype):
    ref, baseline = _case(dtype)
    assert_close_to_baseline("x", baseline.clone(), ref, baseline)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_element_off_by_eight_roundings_fails(dtype):
    ref, baseline = _case(dtype)
    out = baseline.clone()
    out[123] += 8 * rounding_noise(ref, dtype)
    with pytest.raises(AssertionError, match="max-abs over"):
        assert_close_to_baseline("x", out, ref, baseline)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_element_one_step_off_fails_on_rmse(dtype):
    # Within the max-abs bound everywhere, but a systematic error.
    ref, baseline = _case(dtype)
    out = torch.nextafter(baseline, 2 * baseline)
    with pytest.raises(AssertionError, match="rel-RMSE over"):
        assert_close_to_baseline("x", out, ref, baseline)


def test_fp32_systematic_error_of_a_few_millionths_fails_on_rmse():
    """2e-6 relative everywhere: inside the max-abs margin (1e-5), but 17 roundings, which the
    rel-RMSE bound's floor (8 roundings for fp32) does not allow."""
    ref, baseline = _case(torch.float32)
    with pytest.raises(AssertionError, match="rel-RMSE over"):
        assert_close_to_baseline("x", baseline * (1 + 2e-6), ref, baseline)


def test_fp32_margin_is_the_floor():
    ref, baseline = _case(torch.float32)
    out = baseline.clone()
    out[7] += 2e-5
    with pytest.raises(AssertionError):
        assert_close_to_baseline("x", out, ref, baseline)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_reference_that_computes_something_else_fails(dtype):
    """A kernel and its baseline that agree with each other but not with the reference (a
    wrong default in the reference, say) fail, though their error ratio is 1."""
    ref, _ = _case(dtype)
    wrong = (1.1 * ref).to(dtype)
    with pytest.raises(AssertionError, match="compute different things"):
        assert_close_to_baseline("x", wrong.clone(), ref, wrong)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_baseline_limit_sits_between_rounding_and_a_small_systematic_error(dtype):
    """A baseline 1% off (fp32), 3% (fp16) or 10% (bf16) counts as another computation,
    though the kernel beside it is no worse; one rounding off is within the limit."""
    ref, baseline = _case(dtype)
    assert_close_to_baseline("x", baseline.clone(), ref, baseline)
    off = {torch.float32: 1e-2, torch.float16: 3e-2, torch.bfloat16: 1e-1}[dtype]
    wrong = (ref * (1 + off)).to(dtype)
    with pytest.raises(AssertionError, match="compute different things"):
        assert_close_to_baseline("x", wrong.clone(), ref, wrong)
