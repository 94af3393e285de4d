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


@pytest.mark.parametrize("ids, error, message", [
    (torch.tensor([[1.0, 2.0]]), TypeError, r"ids must hold integer token ids .*float32"),
    (torch.tensor([[1, 50]]), ValueError, r"ids must lie in \[0, 50\) .*from 1 to 50"),
    (torch.tensor([[-1, 3]]), ValueError, r"from -1 to 3"),
    (torch.tensor([1, 2]), ValueError, r"shape \(b, l\)"),
])
def test_language_model_names_bad_token_ids(ids, error, message):
    from mambalab.modules.lm import LMConfig, MambaLM

    model = MambaLM(LMConfig(vocab_size=50, d_model=16, n_layer=1, d_state=8, headdim=8, chunk_size=4,
                             scan="reference"))
    with pytest.raises(error, match=message):
        model(ids)
    assert model(torch.tensor([[0, 49]])).shape == (1, 2, 50)   # the ends of the range are ids
