"""AdamW on FP32 master weights in one pass: BF16 gradient in, BF16 parameter out.

The two-pass master-weight step copies each BF16 gradient into an FP32 tensor, runs the wrapped
optimizer on the FP32 masters, then copies every master back into its BF16 parameter: 40 bytes
moved per parameter. On one H100 those two copies took 7.5 ms of an 84.6 ms Llama step
(BENCHMARKS.md 4f). This step reads the BF16 gradient and writes the BF16 parameter in the
update itself: 28 bytes per parameter, one Triton kernel per tensor on CUDA. Measured on the
H100: a compiled 7B-shaped step 1.08x (BF16) and 1.09x (FP8) faster, the same losses.

Only for a single rank (the master is the whole parameter), ``torch.optim.AdamW`` or ``Adam``
without coupled weight decay, and no amsgrad / maximize / capturable / differentiable. The
state (``step``, ``exp_avg``, ``exp_avg_sq``) is created as torch's AdamW creates it, so a
checkpoint loads into either path. On the CPU the update runs torch's own single-tensor
AdamW arithmetic, op for op.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional, Sequence

import torch

from fp8boost import _state
from fp8boost.fp8.kernels.tuning import interpreting

_BLOCK = 2048
# The _state cache of master -> (its state's step tensor, that step as a float): reading a
# step kept on the GPU (AdamW(fused=True) keeps it there) would sync once per tensor and step.
# A new step tensor (a checkpoint was loaded) is read again.
# Keyed by id (a tensor's == is elementwise, so tensors make poor dict keys), checked by weakref.
_STEPS = "zero.fused_step.steps"


def unsupported_reason(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer`` cannot take the fused step (None when it can)."""
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        return f"{kind.__name__} is not torch.optim.AdamW or Adam"
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag):
                return f"{flag}=True is not supported"
        if kind is torch.optim.Adam and group["weight_decay"] and \
                not group.get("decoupled_weight_decay", False):
            return "Adam's coupled weight decay is not supported (use AdamW)"
    return None


def _kernel():
    """The Triton kernel, built on first use (nothing imports Triton at module import)."""
    return _state.probe("zero.fused_step.adamw_kernel", _build_kernel)


def _build_kernel():
    # lazy: Triton is optional (CPU installs); the kernel is built on first use
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(g_ptr, p_ptr, m_ptr, v_ptr, out_ptr, n, grad_mul, decay, w1, beta2, w2,
                     step_size, bc2_sqrt, eps, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_mul
        p = tl.load(p_ptr + offs, mask=mask, other=0.0) * decay
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        m = m + w1 * (g - m)  # torch's lerp_(g, 1 - beta1) for a weight below 0.5
        v = v * beta2 + w2 * g * g
        p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)

    return adamw_kernel


def _use_kernel(master: torch.Tensor) -> bool:
    return master.is_cuda or interpreting()


def _adam_state(optimizer: torch.optim.Optimizer, group: dict, master: torch.Tensor) -> dict:
    """The parameter's AdamW state, created as torch creates it (checkpoints stay portable)."""
    state = optimizer.state[master]
    if not state:
        on_device = group.get("fused") or group.get("capturable")
        state["step"] = (torch.zeros((), dtype=torch.float32, device=master.device) if on_device
                         else torch.tensor(0.0, dtype=torch.float32))
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def _torch_update(g: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                  wd: float, step: float, grad_mul: float) -> None:
    """torch's single-tensor AdamW arithmetic, in its order (CPU reference and fallback)."""
    g = g.float()
    if grad_mul != 1.0:
        g = g * grad_mul
    if wd:
        master.mul_(1 - lr * wd)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


def fused_adamw_step(optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor],
                     grads: Sequence[Optional[torch.Tensor]], params: Sequence[torch.Tensor],
                     grad_mul: float = 1.0) -> None:
    """One AdamW step: ``masters[i]`` (FP32, flat) from ``grads[i]`` (flat, any float dtype),
    then ``params[i]`` (the working parameter, written in its dtype). ``grad_mul`` scales every
    gradient first (the clipping coefficient). The optimizer's param groups hold ``masters``.

    The update runs inside ``optimizer.step()``, as its closure, so everything torch hangs on
    that call happens as for a plain step: an lr scheduler built on ``optimizer`` sees that the
    optimizer stepped (else torch warns "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`"), the user's step pre/post hooks and global hooks fire once, and the
    profiler records ``Optimizer.step#AdamW.step``. AdamW's own update then finds no master with
    a ``.grad`` and does nothing (any ``.grad`` is set aside for the call, so nothing is stepped
    twice).
    """
    def update() -> None:
        _fused_update(optimizer, masters, grads, params, grad_mul)

    set_aside: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group in optimizer.param_groups:
        for master in group["params"]:
            if master.grad is not None:
                set_aside.append((master, master.grad))
                master.grad = None
    try:
        optimizer.step(update)
    finally:
        for master, grad in set_aside:
            master.grad = grad


@torch.no_grad()
def _fused_update(optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor],
                  grads: Sequence[Optional[torch.Tensor]], params: Sequence[torch.Tensor],
                  grad_mul: float) -> None:
    """The update itself (see :func:`fused_adamw_step`), outside any ``optimizer.step()``."""
    index = {id(m): i for i, m in enumerate(masters)}
    for group in optimizer.param_groups:
        lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        beta1, beta2 = (float(b) for b in group["betas"])
        for master in group["params"]:
            i = index[id(master)]
            g = grads[i]
            if g is None:
                continue
            state = _adam_state(optimizer, group, master)
            step = _next_step(master, state)
            p, n = params[i], params[i].numel()  # a master may be padded past n
            kernel = _use_kernel(master)
            if kernel and not (p.is_contiguous() and g.is_contiguous()):
                # The kernel indexes flat memory: a strided tensor takes torch ops (same result).
                _state.warn_once("fused-step-strided", "fp8boost: fused_master_step updates a "
                                 "non-contiguous parameter or gradient with torch ops (slower)")
                kernel = False
            if not kernel:
                _torch_update(g, master[:n], state["exp_avg"][:n], state["exp_avg_sq"][:n], lr,
                              beta1, beta2, eps, wd, step, grad_mul)
                p.copy_(master[:n].view_as(p))  # copy_ bumps the version counter
                continue
            grid = (-(-n // _BLOCK),)
            _kernel()[grid](g, master, state["exp_avg"], state["exp_avg_sq"], p, n,
                            float(grad_mul), 1 - lr * wd, 1 - beta1, beta2, 1 - beta2,
                            lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step), eps,
                            BLOCK=_BLOCK)
            # The kernel wrote the Parameter behind autograd's back: bump its version so the
            # FP8 weight cache (keyed on it) never serves the old weight.
            torch.autograd.graph.increment_version(p)


def _next_step(master: torch.Tensor, state: dict) -> float:
    """Advance ``state["step"]`` by one (in place, as torch does) and return the new count."""
    t = state["step"]
    steps = _state.cache(_STEPS)
    cached = steps.get(id(master))
    fresh = cached is not None and cached[0]() is master and cached[1]() is t
    prev = cached[2] if fresh else float(t)
    t += 1
    steps[id(master)] = (weakref.ref(master), weakref.ref(t), prev + 1)
    return prev + 1
