"""Thin Python wrappers over the fused ops (torch.ops.pyengine.*), with fake kernels for torch.compile.

The ops average the gradients of G workers and apply AdamW in one pass over memory, in place:

- :func:`mean_grad_adamw_` — one flat tensor (the host store's layout); :func:`mean_grad_adamw_clipped_` the same
  with global-norm clipping.
- :func:`mean_grad_adamw_multi_` — many tensors in one launch / one parallel region.
- :func:`mean_grad_norm` / :func:`mean_grad_norm_multi` — L2 norm of the mean gradient, for global-norm clipping.

Semantics follow torch.optim.AdamW (and Adam with ``adamw=False``): ``step`` is the step count after increment.
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

import torch

from . import _C  # noqa: F401  (runs the op registrations)

__all__ = ["GradNorm", "mean_grad_adamw_", "mean_grad_adamw_clipped_", "mean_grad_adamw_multi_", "mean_grad_norm",
           "mean_grad_norm_multi"]


class GradNorm(NamedTuple):
    """L2 norm of the mean gradient (0-d float32) and a 0-d float32 flag: 1.0 if it is not finite.

    ``nonfinite`` can be passed as ``found_inf`` to the update to skip the step without a host sync.
    """

    norm: torch.Tensor
    nonfinite: torch.Tensor


def _tensor_list(value, name: str, nonempty: str | None = None) -> list[torch.Tensor]:
    """``value`` as a list of tensors; ``nonempty``: what the error says when it is empty (None: may be empty)."""
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        # the flat forms' grads: one tensor per worker; the multi form's lists: one tensor per param
        each = {"grads": ", one per worker", "params": ""}.get(name, ", one per param")
        raise TypeError(f"{name} must be a list of tensors{each}; got {type(value).__name__}")
    value = list(value)
    # torch.sgn's gradient, say, is a ZeroTensor: the dispatcher made it a strided zero, refused as "non-contiguous"
    # (dynamo cannot trace the question; a compiled caller gets the op's own refusal)
    eager = not torch.compiler.is_compiling()
    inference = eager and torch.is_inference_mode_enabled()  # Note [Negative views and the update ops]
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor; got {type(t).__name__}")
        if eager and t._is_zerotensor():
            raise ValueError(f"{name}[{i}] is a ZeroTensor (torch._efficientzerotensor: no memory behind it); pass "
                             f"torch.zeros(...)")
        if inference:
            _refuse_negative(t, f"{name}[{i}]")
    if nonempty is not None and not value:
        raise ValueError(f"{name} must hold {nonempty}; got an empty list")
    return value


def _refuse_negative(t: torch.Tensor, name: str) -> None:
    """Note [Negative views and the update ops] (csrc/ops.cpp): the ops' kernel that refuses a negative view runs
    at a key that torch.inference_mode skips, and there torch's fallback for a negative view failed its internal
    assert and then aborted the process when the tensors were freed (SIGABRT: no except catches it). So under
    inference mode the wrappers refuse it first, with the kernel's words (outside it the kernel does: these
    checks cost ~0.3 us a tensor, paid only there)."""
    if t.is_neg():
        raise ValueError(f"{name} is a negative view (torch._neg_view, .conj().imag); resolve it first "
                         "(.resolve_neg())")


def bool_or_complex(value) -> bool:
    """Whether ``value`` is a bool or a complex number of any kind (Python's, numpy's, a bool or complex tensor):
    ``float()`` takes them all (np.True_ as 1.0, a complex dropping its imaginary part), so they are refused."""
    if isinstance(value, (bool, complex)):
        return True
    if isinstance(value, (int, float)):  # first: what torch.compile traces stops here (a SymFloat has no dtype)
        return False
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool or value.is_complex()
    return getattr(getattr(value, "dtype", None), "kind", None) in ("b", "c")  # numpy's scalars and arrays


def _number(value, name: str) -> float:
    if bool_or_complex(value) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"{name} must be a number; got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError) as error:  # an array of several numbers; an int past float's range
        text = repr(value)
        raise TypeError(f"{name} must be a number; got {text if len(text) <= 60 else text[:57] + '...'} "
                        f"({error})") from None


def _step(step) -> int:
    if bool_or_complex(step):
        raise TypeError(f"step must be an int (the step count after increment); got {step!r}")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int (the step count after increment); got {step!r}") from None
    if not 1 <= step < 2**63:
        raise ValueError(f"step must be >= 1 and < 2**63 (the step count after increment); got {step}")
    return step


def _flags(adamw, maximize, amsgrad) -> dict:
    """The update's switches, each True or False: a string such as "False" would otherwise count as True.
    (max_exp_avg_sq given with amsgrad=False is refused by the op itself, check_update_args.)"""
    flags = dict(adamw=adamw, maximize=maximize, amsgrad=amsgrad)
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False; got {value!r}")
    return flags


def _hyper(lr, beta1, beta2, eps, weight_decay) -> dict:
    return dict(lr=_number(lr, "lr"), beta1=_number(beta1, "beta1"), beta2=_number(beta2, "beta2"),
                eps=_number(eps, "eps"), weight_decay=_number(weight_decay, "weight_decay"))


def _worker_major(grads, num_tensors: int) -> list[torch.Tensor]:
    """[[worker 0's P tensors], [worker 1's], ...] -> one flat worker-major list."""
    if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence):
        raise TypeError(f"grads must be a list of G lists of tensors, one per worker; got {type(grads).__name__}")
    workers = list(grads)
    if not workers:
        raise ValueError("grads must hold G >= 1 lists of gradients, one per worker; got an empty list")
    flat = []
    for g, worker in enumerate(workers):
        worker = _tensor_list(worker, f"grads[{g}]")
        if len(worker) != num_tensors:
            raise ValueError(f"grads[{g}] must hold one gradient per param ({num_tensors}); got {len(worker)}")
        flat.extend(worker)
    return flat


def _weights(weights) -> list[float] | None:
    if weights is None:
        return None
    if (isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, torch.Tensor))
            or isinstance(weights, torch.Tensor) and weights.dim() != 1):
        raise TypeError(f"weights must be a list of G numbers; got {type(weights).__name__}"
                        + (f" of shape {tuple(weights.shape)}" if isinstance(weights, torch.Tensor) else ""))
    return [_number(w, f"weights[{i}]") for i, w in enumerate(weights)]


def _clip_norm(max_grad_norm) -> float:
    if max_grad_norm is None:
        return 0.0
    max_grad_norm = _number(max_grad_norm, "max_grad_norm")
    if not max_grad_norm > 0.0:
        raise ValueError(f"max_grad_norm must be > 0 (or None for no clipping); got {max_grad_norm}")
    return max_grad_norm


def mean_grad_adamw_(param, exp_avg, exp_avg_sq, grads, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.0, step, adamw=True, maximize=False, amsgrad=False, max_exp_avg_sq=None,
                     grad_scale=None, found_inf=None, weights=None, param_out=None) -> None:
    """Average ``grads`` (G tensors) and apply one AdamW step to ``param``, ``exp_avg``, ``exp_avg_sq`` in place.

    Args:
        param, exp_avg, exp_avg_sq: contiguous 1-D float32 tensors of N elements, updated in place.
        grads: list of G >= 1 contiguous 1-D N-element tensors (float32, bfloat16 or float16, mixed allowed) on
            param's device. Their mean (or ``weights``-weighted mean) is the gradient; summed in list order, so
            results are bit-reproducible.
        lr, beta1, beta2, eps, weight_decay: as torch.optim.AdamW.
        step: the step count after increment (1 on the first step).
        adamw: False gives Adam with L2 weight decay (torch.optim.Adam).
        maximize, amsgrad: as torch.optim.AdamW; amsgrad needs ``max_exp_avg_sq`` (float32, N elements).
        grad_scale: 1-element float32 tensor that divides the gradients (AMP loss scale); a value that is not a
            positive finite number (or so small that its inverse overflows float32) skips the step, as
            ``found_inf`` does (read on the device too).
        found_inf: 1-element float32 tensor; if nonzero nothing is changed (read on the device: no host sync).
        weights: G floats summing to 1, for uneven shards.
        param_out: optional N-element float32/bfloat16/float16 tensor that receives the updated weights.

    Clipping by the global norm of the mean gradient: :func:`mean_grad_adamw_clipped_` (this signature is fixed).
    """
    _update_flat(param, exp_avg, exp_avg_sq, grads, max_grad_norm=None, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                 weight_decay=weight_decay, step=step, adamw=adamw, maximize=maximize, amsgrad=amsgrad,
                 max_exp_avg_sq=max_exp_avg_sq, grad_scale=grad_scale, found_inf=found_inf, weights=weights,
                 param_out=param_out)


def mean_grad_adamw_clipped_(param, exp_avg, exp_avg_sq, grads, *, max_grad_norm, **options) -> torch.Tensor:
    """:func:`mean_grad_adamw_` with the mean gradient clipped to the global L2 norm ``max_grad_norm`` (> 0): a
    norm pass (:func:`mean_grad_norm`), then the update pass scaling the gradient by min(1, max_grad_norm / norm).
    A norm that is not finite skips the step. ``options``: :func:`mean_grad_adamw_`'s keyword arguments.

    Returns the norm of the mean gradient (0-d float32 tensor, before unscaling by ``grad_scale``).
    """
    if max_grad_norm is None:
        raise ValueError("mean_grad_adamw_clipped_: max_grad_norm must be a number > 0; for no clipping call "
                         "mean_grad_adamw_")
    return _update_flat(param, exp_avg, exp_avg_sq, grads, max_grad_norm=max_grad_norm, **options)


def _tensors(required: dict, optional: dict) -> None:
    """TypeError naming the first argument that is not a tensor (``optional``: nor None); the dispatcher's own
    error ("Expected a value of type 'Optional[Tensor]'") named no argument of ours."""
    inference = not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()
    for name, value in (*required.items(), *optional.items()):
        if not isinstance(value, torch.Tensor) and (name in required or value is not None):
            shown = repr(value)
            raise TypeError(f"{name} must be a tensor{'' if name in required else ' or None'}; got "
                            f"{type(value).__name__} {shown if len(shown) <= 60 else shown[:57] + '...'}")
        if inference and value is not None:  # Note [Negative views and the update ops]
            _refuse_negative(value, name)


def _update_flat(param, exp_avg, exp_avg_sq, grads, *, max_grad_norm, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.0, step, adamw=True, maximize=False, amsgrad=False, max_exp_avg_sq=None,
                 grad_scale=None, found_inf=None, weights=None, param_out=None) -> torch.Tensor | None:
    """The flat update; clips when ``max_grad_norm`` is not None and returns the norm then."""
    _tensors(dict(param=param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq),
             dict(max_exp_avg_sq=max_exp_avg_sq, grad_scale=grad_scale, found_inf=found_inf, param_out=param_out))
    grads = _tensor_list(grads, "grads")
    hyper, step = _hyper(lr, beta1, beta2, eps, weight_decay), _step(step)
    clip = _clip_norm(max_grad_norm)
    norm = mean_grad_norm(grads, weights).norm if clip > 0 and grads else None
    torch.ops.pyengine.mean_grad_adamw_.default(
        param, exp_avg, exp_avg_sq, grads, **hyper, step=step, **_flags(adamw, maximize, amsgrad),
        max_exp_avg_sq=max_exp_avg_sq, grad_scale=grad_scale, found_inf=found_inf,
        weights=_weights(weights), param_out=param_out, grad_norm=norm, max_grad_norm=clip)
    return norm


def mean_grad_adamw_multi_(params, exp_avgs, exp_avg_sqs, grads, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.0, step, adamw=True, maximize=False, amsgrad=False, max_exp_avg_sqs=None,
                           grad_scale=None, found_inf=None, weights=None, param_outs=None, max_grad_norm=None):
    """:func:`mean_grad_adamw_` over many tensors in one launch (CUDA) or one parallel region (CPU).

    ``params``, ``exp_avgs``, ``exp_avg_sqs`` (and ``max_exp_avg_sqs``, ``param_outs`` when given) are lists of P
    contiguous tensors of any shape; ``grads`` is a list of G lists, worker g's P gradients. With
    ``max_grad_norm`` the norm is the global norm over all P tensors. Returns that norm when clipping, else None.
    """
    params = _tensor_list(params, "params", "at least one tensor")
    _tensors({}, dict(grad_scale=grad_scale, found_inf=found_inf))
    if max_exp_avg_sqs is not None:
        _tensor_list(max_exp_avg_sqs, "max_exp_avg_sqs")
    if param_outs is not None:
        _tensor_list(param_outs, "param_outs")
    flat = _worker_major(grads, len(params))
    hyper, step = _hyper(lr, beta1, beta2, eps, weight_decay), _step(step)
    clip = _clip_norm(max_grad_norm)
    norm = mean_grad_norm_multi(grads, weights).norm if clip > 0 and flat else None
    torch.ops.pyengine.mean_grad_adamw_multi_.default(
        params, _tensor_list(exp_avgs, "exp_avgs"), _tensor_list(exp_avg_sqs, "exp_avg_sqs"), flat, **hyper,
        step=step, **_flags(adamw, maximize, amsgrad),
        max_exp_avg_sqs=[] if max_exp_avg_sqs is None else list(max_exp_avg_sqs), grad_scale=grad_scale,
        found_inf=found_inf, weights=_weights(weights), param_outs=[] if param_outs is None else list(param_outs),
        grad_norm=norm, max_grad_norm=clip)
    return norm


def mean_grad_norm(grads, weights=None) -> GradNorm:
    """L2 norm of the (weighted) mean of G gradient tensors, accumulated in fp32 per chunk and in a fixed order.

    Returns a :class:`GradNorm`; its ``nonfinite`` flag is 1.0 when any gradient entry is inf/NaN (or the sum of
    squares overflows), so non-finite values are reported, never silently propagated.
    """
    grads = _tensor_list(grads, "grads", "G >= 1 gradients, one per worker")
    return GradNorm(*torch.ops.pyengine.mean_grad_norm.default(grads, _weights(weights)))


def mean_grad_norm_multi(grads, weights=None) -> GradNorm:
    """Global L2 norm of the mean gradient over many tensors; ``grads`` is a list of G lists of P tensors."""
    if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence) or not grads:
        raise ValueError(f"grads must hold G >= 1 lists of gradients, one per worker; got {grads!r:.80}")
    num_tensors = len(_tensor_list(grads[0], "grads[0]", "at least one gradient"))
    flat = _worker_major(grads, num_tensors)
    return GradNorm(*torch.ops.pyengine.mean_grad_norm_multi.default(flat, num_tensors, _weights(weights)))


def _one_device(op: str, args, kwargs) -> None:
    """The fake kernels run for meta tensors too, and for a call that mixes meta with real tensors (the Meta key
    wins the dispatch): such a call must fail as the real kernels fail on a device mismatch, not return garbage."""
    names = [a.name for a in getattr(torch.ops.pyengine, op).default._schema.arguments]
    seen = {}
    for name, value in [*zip(names, args), *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            seen.setdefault(value.device, name)
        elif isinstance(value, (list, tuple)):
            for i, t in enumerate(value):
                if isinstance(t, torch.Tensor):
                    seen.setdefault(t.device, f"{name}[{i}]")
    if len(seen) > 1:
        found = ", ".join(f"{name} on {device}" for device, name in seen.items())
        raise ValueError(f"pyengine.{op}: every tensor must be on one device; got {found}")


def _fake_update(op):
    def fake(*args, **kwargs):
        _one_device(op, args, kwargs)
    return fake


def _fake_norm(op):
    def fake(grads, *args):
        _one_device(op, (grads, *args), {})
        like = grads[0]
        return like.new_empty((), dtype=torch.float32), like.new_empty((), dtype=torch.float32)
    return fake


torch.library.register_fake("pyengine::mean_grad_adamw_")(_fake_update("mean_grad_adamw_"))
torch.library.register_fake("pyengine::mean_grad_adamw_multi_")(_fake_update("mean_grad_adamw_multi_"))
torch.library.register_fake("pyengine::mean_grad_norm")(_fake_norm("mean_grad_norm"))
torch.library.register_fake("pyengine::mean_grad_norm_multi")(_fake_norm("mean_grad_norm_multi"))
