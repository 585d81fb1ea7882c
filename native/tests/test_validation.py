"""Bad calls raise TypeError/ValueError naming the argument; nothing reaches C."""

from __future__ import annotations

import pytest
import torch

from capstan.native import kernels

HP = dict(step=1, lr=1e-3)


def adam_args(n=16):
    return [torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)]


@pytest.mark.parametrize("pos,name", [(0, "param"), (1, "grad"), (2, "exp_avg"), (3, "exp_avg_sq")])
def test_adam_wrong_type_size_layout(pos, name):
    args = adam_args()
    args[pos] = [0.0] * 16
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor"):
        kernels.adam_update(*args, **HP)
    args = adam_args()
    args[pos] = torch.zeros(15)
    with pytest.raises(ValueError, match=f"^{name} has 15 elements" if pos else "grad has 16"):
        kernels.adam_update(*args, **HP)
    args = adam_args()
    args[pos] = torch.zeros(32)[::2]
    with pytest.raises(ValueError, match=f"^{name} must be contiguous"):
        kernels.adam_update(*args, **HP)
    args = adam_args()
    args[pos] = torch.zeros(16, device="meta")
    with pytest.raises(ValueError, match=f"^{name} must be on the cpu"):
        kernels.adam_update(*args, **HP)


@pytest.mark.parametrize("pos,dtype,match", [
    (0, torch.float16, "^param has dtype float16; expected float32, bfloat16"),
    (2, torch.float16, "^exp_avg has dtype float16; expected float32, bfloat16"),
    (2, torch.bfloat16, "^exp_avg_sq has dtype float32; expected bfloat16"),  # the moments share one dtype
    (3, torch.bfloat16, "^exp_avg_sq has dtype bfloat16; expected float32")])
def test_adam_state_dtypes(pos, dtype, match):
    """The master is fp32 or bf16; the moments are both fp32 or both bf16 (stored with stochastic rounding)."""
    args = adam_args()
    args[pos] = torch.zeros(16, dtype=dtype)
    with pytest.raises(TypeError, match=match):
        kernels.adam_update(*args, **HP)


def test_a_bf16_master_takes_no_out_copy():
    """A bf16 master is its own 16-bit copy: an `out` beside it is refused, by the fused and 8-bit calls."""
    args = adam_args()
    args[0] = torch.zeros(16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^a bf16 param is its own 16-bit copy"):
        kernels.adam_update_and_cast(*args, torch.zeros(16, dtype=torch.bfloat16), **HP)
    codes = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.zeros(1) for _ in range(2)]
    with pytest.raises(ValueError, match="^a bf16 param is its own 16-bit copy"):
        kernels.adam_update_q8(args[0], args[1], *codes, *scales, block=16, out=torch.zeros(16), **HP)


def test_adam_grad_dtype_and_scalars():
    args = adam_args()
    args[1] = torch.zeros(16, dtype=torch.float64)
    with pytest.raises(TypeError, match="^grad has dtype float64"):
        kernels.adam_update(*args, **HP)
    for kw, match in [({"step": 0}, "step"), ({"lr": -1.0}, "lr"), ({"beta1": 1.0}, "beta1"),
                      ({"beta2": float("nan")}, "beta2"), ({"eps": -1e-8}, "eps"),
                      ({"weight_decay": -0.1}, "weight_decay"), ({"grad_scale": 0.0}, "grad_scale"),
                      ({"lr": "0.1"}, "lr")]:
        with pytest.raises((TypeError, ValueError), match=f"^{match}"):
            kernels.adam_update(*adam_args(), **{**HP, **kw})


def test_fused_out_checked():
    with pytest.raises(TypeError, match="^out"):
        kernels.adam_update_and_cast(*adam_args(), None, **HP)
    with pytest.raises(ValueError, match="^out has 8 elements"):
        kernels.adam_update_and_cast(*adam_args(), torch.zeros(8, dtype=torch.bfloat16), **HP)
    with pytest.raises(TypeError, match="^out has dtype int32"):
        kernels.adam_update_and_cast(*adam_args(), torch.zeros(16, dtype=torch.int32), **HP)


def test_cast_copy_sum_reductions():
    with pytest.raises(ValueError, match="^dst has 3 elements, src has 4"):
        kernels.cast_(torch.zeros(4), torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="^src has dtype int64"):
        kernels.cast_(torch.zeros(4, dtype=torch.int64), torch.zeros(4))
    with pytest.raises(TypeError, match="^src has dtype float64"):
        kernels.copy_(torch.zeros(4), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="srcs must be"):
        kernels.sum_([], torch.zeros(4))
    with pytest.raises(TypeError, match=r"^srcs\[1\] has dtype float16"):
        kernels.sum_([torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float16)],
                     torch.zeros(4))
    with pytest.raises(ValueError, match="^out has 5 elements"):
        kernels.sum_([torch.zeros(4)], torch.zeros(5))
    with pytest.raises(ValueError, match="^x must be contiguous"):
        kernels.sumsq(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="^x must be a torch.Tensor"):
        kernels.has_nonfinite(None)


def test_isa_and_threads_arguments():
    # Checked before the library is looked up: the same error with or without it.
    with pytest.raises(ValueError, match="^name must be one of"):
        kernels.set_isa("sse9")
    with pytest.raises(ValueError, match="^n must be"):
        kernels.set_num_threads(0)


def test_the_c_abi_refuses_a_param_dtype_it_does_not_step():
    """Below the Python checks: capstan_adam_step takes an fp32 or a bf16 param, and a bf16 one without an
    out copy; anything else is CAPSTAN_EDTYPE with no buffer touched."""
    import ctypes

    from capstan.native import _lib

    lib = _lib.get()
    if lib is None:
        pytest.skip(f"requires_native: libcapstan not loaded ({_lib.load_error()})")
    n = 16
    p16, out = torch.ones(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    g, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
    codes = _lib.DTYPE_CODES

    def step(param: torch.Tensor, code: int, out_tensor: torch.Tensor | None) -> int:
        overflow = ctypes.c_int(0)
        return lib.capstan_adam_step(
            param.data_ptr(), code, g.data_ptr(), codes["float32"], m.data_ptr(), v.data_ptr(), codes["float32"],
            1, 0, n, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1.0, 0,
            out_tensor.data_ptr() if out_tensor is not None else None,
            codes["bfloat16"] if out_tensor is not None else _lib.NONE, ctypes.byref(overflow))

    EDTYPE = 2
    assert step(p16, codes["float16"], None) == EDTYPE
    assert step(p16, 7, None) == EDTYPE
    assert step(p16, codes["bfloat16"], out) == EDTYPE
    assert torch.equal(p16, torch.ones(n, dtype=torch.bfloat16)) and not m.any()  # nothing written
    assert step(p16, codes["bfloat16"], None) == 0 and not torch.equal(p16, torch.ones(n, dtype=torch.bfloat16))
