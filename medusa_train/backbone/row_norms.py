"""RMS norms on the row kernel: a backbone's Llama-style norms, each row alone, in one call.

transformers' Llama-style RMS norm (Llama, Qwen2/3, Mistral and the many copied from it) is eight small torch ops a
call (a cast to float32, ``pow``, ``mean``, an add, ``rsqrt``, a multiply, a cast back, the weight's multiply): ~25-50
us on a 2-core CPU for one row of 576, and a decoding step runs two a layer and one at the end, 61 for SmolLM2-135M,
~2.5 ms of a ~30 ms bf16 step (the AMX CPU, 2026-11-30). ``rows.cpp``'s ``rms_norm`` computes the same norm in one
call: each row's sum of squares in float32 (its lanes along the row in order, then one fixed tree), ``1 / sqrt(mean +
eps)``, the row scaled, rounded to the element type, times the weight, rounded again (bf16), as transformers rounds.
A row's output is the same whatever rows share the call, as the row kernel's linears are; it is not bitwise torch's
(torch sums the squares in another order: ~1 output in a few hundred differs by one bf16 step), so a cached greedy
reply names it (``norms_for``).

``switch_norms(model)`` (called by ``row_layers.use_row_kernel``) switches every RMS norm module whose class computes this
norm, checked on a probe of its own weights at switch time (a norm of another formula, Gemma's ``1 + weight`` say,
disagrees and stays as it is), to a subclass whose forward takes the kernel where it applies (no autograd, CPU
tensors of a dtype ``row_dtypes`` has, the weight the input's dtype) and the class's own forward everywhere else.
"""

from __future__ import annotations

import functools

import torch

from medusa_train.backbone.rows import row_dtypes, row_kernel


def step_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim through the row kernel, or None where it does not apply
    (autograd, another device, a dtype the kernel does not take, a weight of another dtype or shape)."""
    if not (x.dim() and x.shape[-1] and x.dtype == weight.dtype and x.dtype in row_dtypes()
            and x.device.type == "cpu" and weight.device.type == "cpu" and weight.shape == (x.shape[-1],)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    kernel = row_kernel()
    run = kernel.rms_norm if x.dtype == torch.float32 else kernel.rms_norm_bf16
    run(x.data_ptr(), weight.detach().contiguous().data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
        float(eps))
    return y


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    y = step_rms_norm(x, self.weight, self.variance_epsilon)
    return self._row_norm_of.forward(self, x) if y is None else y


@functools.cache
def _row_class(cls: type) -> type:
    """The subclass of an RMS norm class whose forward takes the kernel (one per class, made once)."""
    return type(f"Row{cls.__name__}", (cls,), {"forward": _forward, "_row_norm_of": cls, "__module__": __name__})


def is_row_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an RMS norm switched to the kernel."""
    return "_row_norm_of" in type(module).__dict__


def _computes_as_the_kernel(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own forward gives the kernel's norm on a probe of 3 rows (its own weight and epsilon): within
    one rounding step of its dtype (the two sum the squares in other orders), not another formula."""
    weight = module.weight
    x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.no_grad():
        theirs = type(module).forward(module, x)
        ours = step_rms_norm(x, weight, module.variance_epsilon)
    if ours is None or not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
        return False
    step = 2.0 ** -7 if weight.dtype == torch.bfloat16 else 2.0 ** -20
    return bool(((theirs.float() - ours.float()).abs() <= step * theirs.float().abs() + 1e-6).all())


def switch_norms(model: torch.nn.Module) -> int:
    """Switch ``model``'s RMS norm modules (a class named ``...RMSNorm`` with a 1-D ``weight`` of a dtype the kernel
    takes and a float ``variance_epsilon``) that compute the kernel's norm to their kernel subclass; how many."""
    switched = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (is_row_norm(module) or not type(module).__name__.endswith("RMSNorm")
                or not isinstance(getattr(module, "variance_epsilon", None), float)
                or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.dtype not in row_dtypes()
                or weight.device.type != "cpu" or not _computes_as_the_kernel(module)):
            continue
        module.__class__ = _row_class(type(module))
        switched += 1
    return switched


def switch_back(module: torch.nn.Module) -> None:
    """A switched norm its own class again."""
    module.__class__ = type(module)._row_norm_of


def norms_for(device: torch.device | str, dtype: torch.dtype) -> str:
    """What a decoding step's RMS norms run on for a backbone on ``device`` in ``dtype`` once ``use_row_kernel`` has run:
    ``row kernel`` or ``torch`` (they round otherwise: a cached greedy reply names it)."""
    return "row kernel" if torch.device(device).type == "cpu" and dtype in row_dtypes() else "torch"
