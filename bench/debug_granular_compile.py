"""Debug (issue 26): which part of a compiled rowwise/blockwise Fp8Linear gives zero
gradients on CUDA. Prints, per recipe and (backend, compile backend): the max |grad| of x and
W and their relative error against eager on the same backend."""
import torch

from fp8boost.fp8 import Fp8Config, Fp8Linear


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run(name, fp8_backend, cbe, dtype):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = Fp8Linear(512, 384, config=Fp8Config.from_recipe(name, backend=fp8_backend))
    layer = layer.cuda().to(dtype)
    x = torch.randn(256, 512, device="cuda", dtype=dtype, requires_grad=True)
    fn = lambda x: layer(x).float().square().mean()  # noqa: E731
    f = fn if cbe == "eager" else torch.compile(fn, backend=cbe)
    loss = f(x)
    loss.backward()
    return loss.item(), x.grad.clone(), layer.weight.grad.clone()


for name in ("rowwise", "blockwise"):
    for fp8_backend in ("triton", "emulated"):
        for dtype in (torch.float32, torch.bfloat16):
            ref = run(name, fp8_backend, "eager", dtype)
            for cbe in ("aot_eager", "inductor"):
                try:
                    got = run(name, fp8_backend, cbe, dtype)
                    print(f"{name:9} {fp8_backend:8} {str(dtype)[6:]:8} {cbe:9} loss {got[0]:.4e}/"
                          f"{ref[0]:.4e} |dx| {got[1].abs().max():.2e}/{ref[1].abs().max():.2e} "
                          f"rel {rel(got[1], ref[1]):.2e} |dW| {got[2].abs().max():.2e}/"
                          f"{ref[2].abs().max():.2e} rel {rel(got[2], ref[2]):.2e}", flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(name, fp8_backend, dtype, cbe, "ERROR", str(exc)[:300], flush=True)
