"""mambalab.validate: the value check behind "NaN in delta / dt" errors."""
import pytest
import torch

from mambalab import validate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_finite_names_the_argument_for_nan_and_either_infinity(dtype, bad):
    x = torch.zeros(3, 5, dtype=dtype)
    x[1, 2] = bad
    pending = validate.Finite("delta", x)          # queued: nothing raised until check()
    with pytest.raises(ValueError, match="delta contains NaN or infinite values"):
        pending.check()
    with pytest.raises(ValueError, match="delta"):
        validate.finite("delta", x)


def test_finite_accepts_finite_and_empty_tensors():
    validate.finite("x", torch.tensor([-3.0e38, 0.0, 3.0e38]))   # large but finite
    validate.finite("x", torch.empty(0, 4))
    validate.Finite("x", torch.randn(4, 4, dtype=torch.bfloat16)).check()
