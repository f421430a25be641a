"""Probe: can a compiled graph launch the FP8 Triton GEMM itself (TMA descriptors included)?

``fp8boost::scaled_mm_direct`` (fp8boost/fp8/kernels/gemm_direct.py) puts ``aten._scaled_mm``
in compiled graphs where cuBLAS won the shape, but keeps the Python op where the Triton kernel
won: torch 2.11's ``triton_op`` tracing rejects the kernel's host-side TMA descriptors. This
probe tries the other route, on the GPU: dynamo tracing the kernel launch itself
(``_gemm_tma_kernel[grid](TensorDescriptor.from_tensor(...), ...)``) with the config fixed by a
``torch._dynamo.assume_constant_result`` function, plain and inside an autograd.Function, and
times the host cost per GEMM in a graph of 32 against ``torch._scaled_mm`` and the op.

    python bench/probes/gemm_dynamo_launch.py --output probe.json

Prints one line per check; the JSON holds them (ok / error text, us per GEMM).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
E4M3 = torch.float8_e4m3fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", default=None)
    p.add_argument("--size", type=int, default=128)
    args = p.parse_args(argv)
    from fp8boost.fp8.kernels import gemm

    cfg = gemm.FAST_CONFIGS[0]
    sms = gemm.num_sms(torch.device("cuda"))

    @torch._dynamo.assume_constant_result
    def decided() -> tuple:
        return tuple(cfg)  # stands for the trace-time tuner's decision

    def launch(a, b, sa, sb):
        c = gemm.GemmConfig(*decided())
        m, n = a.shape[0], b.shape[0]
        out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
        meta = gemm.kernel_meta(c, sms, False, torch.bfloat16, True, True)
        bn_c = c.block_n // 2 if c.subtile else c.block_n
        desc = gemm.TensorDescriptor.from_tensor
        grid = (min(sms, -(-m // c.block_m) * -(-n // c.block_n)),)
        gemm._gemm_tma_kernel[grid](desc(a, [c.block_m, c.block_k]),
                                    desc(b, [c.block_n, c.block_k]),
                                    desc(out, [c.block_m, bn_c]), sa, sb, sa, m, n,
                                    a.shape[1], **meta)
        return out

    class Mm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, a, b, sa, sb):
            return launch(a, b, sa, sb) + x

        @staticmethod
        def backward(ctx, g):
            return g, None, None, None, None

    results = {}
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 512, generator=g).to("cuda", E4M3)
    b = torch.randn(768, 512, generator=g).to("cuda", E4M3)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
    ref = gemm.launcher(a, b, sa, sb, None, torch.bfloat16, True, True)(cfg)

    def check(name, fn):
        try:
            r = fn()
            results[name] = {"ok": True, **(r or {})}
        except Exception as exc:  # noqa: BLE001 (a probe reports every failure)
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                             "trace": traceback.format_exc()[-3000:]}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "trace"})[:600],
              flush=True)

    def plain():
        torch._dynamo.reset()
        out = torch.compile(launch, fullgraph=True)(a, b, sa, sb)
        return {"bit_exact": bool(torch.equal(out, ref))}

    def in_autograd():
        torch._dynamo.reset()
        x = torch.zeros(1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = torch.compile(lambda x: Mm.apply(x, a, b, sa, sb), fullgraph=True)(x)
        out.float().sum().backward()
        return {"bit_exact": bool(torch.equal(out, ref)), "grad": x.grad is not None}

    def host_cost():
        n = args.size
        aa = torch.randn(n, n, generator=g).to("cuda", E4M3)
        bs = [torch.randn(n, n, generator=g).to("cuda", E4M3) for _ in range(32)]
        one = torch.ones((), device="cuda")
        paths = {"triton_launch": lambda b: launch(aa, b, one, one),
                 "scaled_mm": lambda b: torch._scaled_mm(aa, b.t(), scale_a=one, scale_b=one,
                                                         out_dtype=torch.bfloat16,
                                                         use_fast_accum=True),
                 "op": lambda b: torch.ops.fp8boost.scaled_mm(aa, b, one, one, None,
                                                              torch.bfloat16, True, False)}
        us = {}
        with torch.no_grad():
            for name, f in paths.items():
                torch._dynamo.reset()
                graph = torch.compile(lambda bs, f=f: [f(b) for b in bs], fullgraph=True)
                for _ in range(20):
                    graph(bs)
                torch.cuda.synchronize()
                best = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(50):
                        graph(bs)
                    torch.cuda.synchronize()
                    best.append((time.perf_counter() - t0) / (50 * 32) * 1e6)
                us[name] = round(sorted(best)[2], 2)
        return {"us_per_gemm": us}

    import fp8boost.fp8.kernels.ops  # noqa: F401 (registers fp8boost::scaled_mm)
    check("plain", plain)
    check("in_autograd_function", in_autograd)
    check("host_cost", host_cost)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
