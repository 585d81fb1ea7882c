"""CPU kernels on torch tensors: Adam/AdamW step, casts, copies, reductions.

Every function validates its arguments (type, device, dtype, contiguity,
size) and raises TypeError/ValueError naming the argument before any pointer
reaches C; then it runs libcapstan's kernel, or the pure-torch fallback
(`fallback.py`) when the library is unavailable.

`adam_update`, `adam_update_and_cast`, `cast_`, `sumsq` and `has_nonfinite`
also take tensors that all live on one CUDA device: the same contract runs
through torch's own kernels there (`device_ops.py`: fused AdamW), so an
optimizer holding its state on the GPU calls the same functions.

"Update" (`adam_update`) and "cast + copy" (`cast_`) are separate primitives;
`adam_update_and_cast` fuses them in one pass over memory and is tested to be
bit-identical to the two in sequence (tests/test_adam.py).

Example::

    p, g = torch.randn(1000), torch.randn(1000)
    m, v = torch.zeros(1000), torch.zeros(1000)
    adam_update(p, g, m, v, step=1, lr=1e-3)
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from . import _lib, device_ops, fallback

__all__ = ["adam_update", "adam_update_and_cast", "adam_update_q8", "q8_blocks", "cast_", "copy_", "sum_", "sumsq",
           "has_nonfinite", "set_isa", "get_isa", "set_num_threads", "get_num_threads"]

FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16)
HALF_TYPES = (torch.bfloat16, torch.float16)
# Adam's moments: fp32, or bf16 stored with stochastic rounding (`adam_update`'s `seed`).
MOMENT_TYPES = (torch.float32, torch.bfloat16)


def _code(dtype: torch.dtype) -> int:
    return _lib.DTYPE_CODES[str(dtype).removeprefix("torch.")]


def check_tensor(name: str, t: object, dtypes: Sequence[torch.dtype] = FLOAT_TYPES,
                 numel: int | None = None, like: str = "",
                 device: torch.device | None = None) -> torch.Tensor:
    """Validate one tensor argument; the error names it. `device`: where it must be (the cpu if None)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if device is None and t.device.type != "cpu":
        raise ValueError(f"{name} must be on the cpu, got device {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, where {like or 'the first tensor'} is, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; "
                        f"expected {allowed}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, {like or 'expected'} has {numel}")
    return t


def _check_scalar(name: str, value: object, low: float | None = None,
                  high: float | None = None, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    x = float(value)
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {x}")
    if low is not None and (x <= low if low_open else x < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {x}")
    if high is not None and x >= high:
        raise ValueError(f"{name} must be < {high}, got {x}")
    return x


def _where(name: str, t: object) -> torch.device | None:
    """The device every tensor of a call must share: None for the cpu (the native kernels), else the
    accelerator `t` is on (a GPU, or the CPU suite's stand-in: torch's kernels, device_ops.py); a tensor
    without memory (meta) is refused, naming `name`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "cpu":
        return None
    if t.device.type == "meta":
        raise ValueError(f"{name} must be on the cpu or an accelerator, got device {t.device}")
    return t.device


PARAM_TYPES = (torch.float32, torch.bfloat16)  # fp32, or a bf16 master (stochastic rounding)


def _check_master_out(param: torch.Tensor, out: object) -> None:
    if param.dtype == torch.bfloat16 and out is not None:
        raise ValueError("a bf16 param is its own 16-bit copy: pass no out (out is for an fp32 master's copy)")


def _adam(param, grad, exp_avg, exp_avg_sq, out, *, step, lr, beta1, beta2, eps,
          weight_decay, adamw, grad_scale, check_overflow, seed=0, index_base=0) -> bool:
    dev = _where("param", param)
    check_tensor("param", param, PARAM_TYPES, device=dev)
    _check_master_out(param, out)
    n = param.numel()
    check_tensor("grad", grad, FLOAT_TYPES, n, "param", dev)
    check_tensor("exp_avg", exp_avg, MOMENT_TYPES, n, "param", dev)
    check_tensor("exp_avg_sq", exp_avg_sq, (exp_avg.dtype,), n, "exp_avg", dev)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    if isinstance(index_base, bool) or not isinstance(index_base, int) or index_base < 0:
        raise ValueError(f"index_base must be an int >= 0, got {index_base!r}")
    if out is not None:
        check_tensor("out", out, HALF_TYPES + (torch.float32,), n, "param", dev)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    lr = _check_scalar("lr", lr, 0.0)
    beta1 = _check_scalar("beta1", beta1, 0.0, 1.0)
    beta2 = _check_scalar("beta2", beta2, 0.0, 1.0)
    eps = _check_scalar("eps", eps, 0.0)
    weight_decay = _check_scalar("weight_decay", weight_decay, 0.0)
    grad_scale = _check_scalar("grad_scale", grad_scale, 0.0, low_open=True)
    if dev is not None:
        return device_ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                                    beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
                                    grad_scale=grad_scale, check_overflow=check_overflow, out=out, seed=seed,
                                    index_base=index_base)
    lib = _lib.get()
    if lib is None:
        return fallback.adam_step(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr,
                                  beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                  adamw=adamw, grad_scale=grad_scale,
                                  check_overflow=check_overflow, out=out, seed=seed, index_base=index_base)
    overflow = ctypes.c_int(0)
    code = lib.capstan_adam_step(
        param.data_ptr(), _code(param.dtype), grad.data_ptr(), _code(grad.dtype), exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(), _code(exp_avg.dtype), seed, index_base, n, step, lr, beta1, beta2, eps,
        weight_decay, int(bool(adamw)),
        grad_scale, int(bool(check_overflow)), out.data_ptr() if out is not None else None,
        _code(out.dtype) if out is not None else _lib.NONE, ctypes.byref(overflow))
    _lib.check(lib, code, "capstan_adam_step")
    return bool(overflow.value)


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float = 1e-3, beta1: float = 0.9,
                beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                adamw: bool = True, grad_scale: float = 1.0,
                check_overflow: bool = False, seed: int = 0, index_base: int = 0) -> bool:
    """One Adam (adamw=False) or AdamW step, in place, on param and moments.

    param: fp32 [n], or a bf16 master: then it is updated in fp32 and stored with stochastic rounding
    from a hash stream of its own of (`seed`, `index_base` + element index), so that updates below half
    a bf16 ulp still move it in expectation (nearest rounding would drop them: the bf16 master of
    Zamirai et al. 2020, torchao's bf16_stochastic_round). grad: fp32/bf16/fp16 [n], multiplied by grad_scale
    (1/loss_scale) first. exp_avg, exp_avg_sq: fp32 [n], or both bf16: then they
    are updated in fp32 (the parameter from those fp32 values) and stored with
    stochastic rounding, whose random bits are a hash of (`seed`, `index_base` +
    element index) -- the same on every ISA, thread count and fallback; pass a
    new seed each step, or the same elements round the same way every step. A
    buffer stepped in slices (ZeRO shards, chunks) gets the bits it would get
    whole when each slice passes its offset in the buffer as `index_base`.
    Nearest rounding would lose the second moment's decay: v * 0.999 rounds
    back to v in bf16's 8 significant bits. `step` counts from 1. With
    check_overflow, returns True and changes nothing when a scaled grad is
    inf/NaN; otherwise returns False.
    """
    return _adam(param, grad, exp_avg, exp_avg_sq, None, step=step, lr=lr, beta1=beta1,
                 beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
                 grad_scale=grad_scale, check_overflow=check_overflow, seed=seed, index_base=index_base)


def adam_update_and_cast(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                         exp_avg_sq: torch.Tensor, out: torch.Tensor, *, step: int,
                         lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                         eps: float = 1e-8, weight_decay: float = 0.0, adamw: bool = True,
                         grad_scale: float = 1.0, check_overflow: bool = False, seed: int = 0,
                         index_base: int = 0) -> bool:
    """`adam_update` fused with `cast_(param, out)`: out [n] (bf16/fp16/fp32) gets the new param."""
    if out is None:
        raise TypeError("out must be a torch.Tensor, got NoneType")
    return _adam(param, grad, exp_avg, exp_avg_sq, out, step=step, lr=lr, beta1=beta1,
                 beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
                 grad_scale=grad_scale, check_overflow=check_overflow, seed=seed, index_base=index_base)


Q8_BLOCKS = tuple(1 << k for k in range(4, 13))  # the block sizes capstan_adam_step_q8 takes: 16..4096


def q8_blocks(numels: Sequence[int], block: int) -> int:
    """How many blocks (and scales per moment) segments of these sizes take at `block` elements."""
    return sum(-(-int(n) // block) for n in numels)


def _segments(segments: object, n: int) -> list[tuple[int, int, int]]:
    """Validate `segments` ((offset, numel, index) triples, in order, not overlapping, within n)."""
    if segments is None:
        return [(0, n, 0)]
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        raise TypeError(f"segments must be a sequence of (offset, numel, index), got {type(segments).__name__}")
    out, end = [], 0
    for k, seg in enumerate(segments):
        if not isinstance(seg, Sequence) or len(seg) != 3 or any(
                isinstance(x, bool) or not isinstance(x, int) for x in seg):
            raise TypeError(f"segments[{k}] must be three ints (offset, numel, index), got {seg!r}")
        off, num, index = seg
        if off < end or num < 0 or index < 0 or off + num > n:
            raise ValueError(f"segments[{k}] = {tuple(seg)}: segments must be in order, not overlap, have "
                             f"numel >= 0 and index >= 0, and end within the {n} elements of param")
        out.append((off, num, index))
        end = off + num
    return out


def adam_update_q8(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   scale_m: torch.Tensor, scale_v: torch.Tensor, *, step: int, block: int = 256,
                   segments: Sequence[tuple[int, int, int]] | None = None, lr: float = 1e-3,
                   beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                   adamw: bool = True, grad_scale: float = 1.0, check_overflow: bool = False, seed: int = 0,
                   out: torch.Tensor | None = None) -> bool:
    """One Adam/AdamW step with 8-bit moments, in place (block-wise quantization, Dettmers et al. 2022).

    param: fp32 [n], or a bf16 master (as in `adam_update`; its bits hash each element's canonical
    index, as the moments' do); grad: fp32/bf16/fp16 [n]; exp_avg, exp_avg_sq: uint8 codes [n] (exp_avg's signed,
    with an exponent; exp_avg_sq's hold sqrt(exp_avg_sq), fallback.Q8_EXP_AVG_SQ); scale_m, scale_v: fp32,
    one per block. `segments` ((offset, numel, index) per parameter, default the whole buffer as one)
    cut the buffer into parameters, each into blocks of `block` elements (a power of two in 16..4096),
    so every layout that keeps a parameter whole quantizes it alike; `index` is the parameter's first
    element's canonical number, from which (with `seed`) the stochastic rounding draws its bits. The
    scales are the segments' blocks in order: q8_blocks([numel, ...], block) of them. Elements outside
    the segments are not touched. A fresh state is all zeros (codes and scales). The parameter is
    updated from the decoded-then-updated fp32 moments as `adam_update` would from those, with
    sqrt(1 - beta2^step) folded into the step size and eps (one division, not two: the last bits of
    the update differ); the moments are then stored against each block's new absmax. check_overflow,
    grad_scale and out as in `adam_update_and_cast`; returns True (nothing changed) on overflow."""
    dev = _where("param", param)
    check_tensor("param", param, PARAM_TYPES, device=dev)
    _check_master_out(param, out)
    n = param.numel()
    check_tensor("grad", grad, FLOAT_TYPES, n, "param", dev)
    check_tensor("exp_avg", exp_avg, (torch.uint8,), n, "param", dev)
    check_tensor("exp_avg_sq", exp_avg_sq, (torch.uint8,), n, "param", dev)
    if isinstance(block, bool) or block not in Q8_BLOCKS:
        raise ValueError(f"block must be a power of two in 16..4096, got {block!r}")
    segs = _segments(segments, n)
    nb = q8_blocks([s[1] for s in segs], block)
    check_tensor("scale_m", scale_m, (torch.float32,), nb, f"{len(segs)} segment(s) of blocks of {block}", dev)
    check_tensor("scale_v", scale_v, (torch.float32,), nb, "scale_m", dev)
    if out is not None:
        check_tensor("out", out, HALF_TYPES + (torch.float32,), n, "param", dev)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    args = dict(step=step, lr=_check_scalar("lr", lr, 0.0), beta1=_check_scalar("beta1", beta1, 0.0, 1.0),
                beta2=_check_scalar("beta2", beta2, 0.0, 1.0), eps=_check_scalar("eps", eps, 0.0),
                weight_decay=_check_scalar("weight_decay", weight_decay, 0.0), adamw=bool(adamw),
                grad_scale=_check_scalar("grad_scale", grad_scale, 0.0, low_open=True),
                check_overflow=bool(check_overflow))
    lib = _lib.get()
    if lib is None or dev is not None:
        return fallback.adam_step_q8(param, grad, exp_avg, exp_avg_sq, scale_m, scale_v, block=block,
                                     segments=segs, out=out, seed=seed, **args)
    table = torch.tensor(segs, dtype=torch.int64).reshape(-1, 3).t().contiguous()
    overflow = ctypes.c_int(0)
    code = lib.capstan_adam_step_q8(
        param.data_ptr(), _code(param.dtype), grad.data_ptr(), _code(grad.dtype), exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(), scale_m.data_ptr(), scale_v.data_ptr(), block, len(segs), table[0].data_ptr(),
        table[1].data_ptr(), table[2].data_ptr(), seed, step, args["lr"], args["beta1"], args["beta2"], args["eps"],
        args["weight_decay"], int(args["adamw"]), args["grad_scale"], int(args["check_overflow"]),
        out.data_ptr() if out is not None else None, _code(out.dtype) if out is not None else _lib.NONE,
        ctypes.byref(overflow))
    _lib.check(lib, code, "capstan_adam_step_q8")
    return bool(overflow.value)


def cast_(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst[:] = src converted to dst.dtype (round to nearest even, bit-identical to torch)."""
    dev = _where("src", src)
    check_tensor("src", src, device=dev)
    check_tensor("dst", dst, FLOAT_TYPES, src.numel(), "src", dev)
    lib = _lib.get()
    if lib is None or dev is not None:
        fallback.cast_(src, dst)
    else:
        _lib.check(lib, lib.capstan_cast(src.data_ptr(), _code(src.dtype), dst.data_ptr(),
                                         _code(dst.dtype), src.numel()), "capstan_cast")
    return dst


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Multi-threaded dst[:] = src for contiguous cpu tensors of equal dtype and size."""
    check_tensor("dst", dst, _ANY)
    check_tensor("src", src, (dst.dtype,), dst.numel(), "dst")
    lib = _lib.get()
    if lib is None:
        fallback.copy_(dst, src)
    else:
        nbytes = dst.numel() * dst.element_size()
        _lib.check(lib, lib.capstan_copy(dst.data_ptr(), src.data_ptr(), nbytes), "capstan_copy")
    return dst


def sum_(srcs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """out[:] = srcs[0] + srcs[1] + ... accumulated in fp32, in that order."""
    if isinstance(srcs, torch.Tensor) or not isinstance(srcs, Sequence) or len(srcs) == 0:
        raise TypeError("srcs must be a non-empty sequence of tensors")
    first = check_tensor("srcs[0]", srcs[0])
    for i, s in enumerate(srcs[1:], 1):
        check_tensor(f"srcs[{i}]", s, (first.dtype,), first.numel(), "srcs[0]")
    check_tensor("out", out, FLOAT_TYPES, first.numel(), "srcs[0]")
    lib = _lib.get()
    if lib is None:
        fallback.sum_(list(srcs), out)
        return out
    ptrs = (ctypes.c_void_p * len(srcs))(*[s.data_ptr() for s in srcs])
    _lib.check(lib, lib.capstan_sum(out.data_ptr(), _code(out.dtype), ptrs, len(srcs),
                                    _code(first.dtype), first.numel()), "capstan_sum")
    return out


def sumsq(x: torch.Tensor) -> float:
    """Squared L2 norm of x (fp32/bf16/fp16), accumulated in fp32 blocks and double overall."""
    dev = _where("x", x)
    check_tensor("x", x, device=dev)
    if dev is not None:
        return device_ops.sumsq(x)
    lib = _lib.get()
    if lib is None:
        return fallback.sumsq(x)
    out = ctypes.c_double(0.0)
    _lib.check(lib, lib.capstan_sumsq(x.data_ptr(), _code(x.dtype), x.numel(), ctypes.byref(out)),
               "capstan_sumsq")
    return out.value


def has_nonfinite(x: torch.Tensor) -> bool:
    """True if any element of x is inf or NaN (on an accelerator also a finite value past 1.8e19:
    `device_ops.nonfinite_tensor`, which makes no temporary the size of x)."""
    dev = _where("x", x)
    check_tensor("x", x, device=dev)
    lib = _lib.get()
    if dev is not None:
        return bool(device_ops.nonfinite_tensor(x))
    if lib is None:
        return fallback.has_nonfinite(x)
    out = ctypes.c_int(0)
    _lib.check(lib, lib.capstan_nonfinite(x.data_ptr(), _code(x.dtype), x.numel(),
                                          ctypes.byref(out)), "capstan_nonfinite")
    return bool(out.value)


_ANY = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
        torch.int16, torch.int32, torch.int64, torch.bool)


def _need_lib(what: str):
    lib = _lib.get()
    if lib is None:
        raise RuntimeError(f"{what} needs the native library: {_lib.load_error()}")
    return lib


def set_isa(name: str) -> None:
    """Force the kernels of one ISA (one of capstan.native._lib.ISA_NAMES); ValueError if unusable here."""
    if name not in _lib.ISA_NAMES:
        raise ValueError(f"name must be one of {', '.join(_lib.ISA_NAMES)}, got {name!r}")
    lib = _need_lib("set_isa")
    if lib.capstan_set_isa(_lib.ISA_NAMES.index(name)) != 0:
        raise ValueError(f"name={name!r}: not compiled in or not supported by this CPU")


def get_isa() -> str:
    return _lib.ISA_NAMES[_need_lib("get_isa").capstan_get_isa()]


def set_num_threads(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
        raise ValueError(f"n must be an int in 1..1024, got {n!r}")
    lib = _need_lib("set_num_threads")
    _lib.check(lib, lib.capstan_set_num_threads(n), "capstan_set_num_threads")


def get_num_threads() -> int:
    return _need_lib("get_num_threads").capstan_get_num_threads()
