"""Debug 2 (issue 26): isolate the compiled rowwise zero-gradient / wrong-loss bug on CUDA."""
import torch

from fp8boost.fp8 import Fp8Config, Fp8Linear
from fp8boost.fp8.granular import granular_linear


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def fn_apply(cfg):
    def f(x, w):
        return granular_linear(x, w, None, cfg, "emulated").float().square().mean()
    return f


for dev in ("cpu", "cuda"):
    for dtype in (torch.float32, torch.bfloat16):
        cfg = Fp8Config.from_recipe("rowwise", backend="emulated")
        torch.manual_seed(0)
        x0 = torch.randn(256, 512, device=dev, dtype=dtype)
        w0 = torch.randn(384, 512, device=dev, dtype=dtype) / 20
        out = {}
        for cbe in ("none", "eager", "aot_eager"):
            torch._dynamo.reset()
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            f = fn_apply(cfg)
            f = f if cbe == "none" else torch.compile(f, backend=cbe)
            loss = f(x, w)
            loss.backward()
            out[cbe] = (loss.item(), x.grad, w.grad)
        for cbe in ("eager", "aot_eager"):
            print(f"apply {dev:4} {str(dtype)[6:]:8} {cbe:9} loss {out[cbe][0]:.5e}/{out['none'][0]:.5e}"
                  f" dx rel {rel(out[cbe][1], out['none'][1]):.2e} dW rel "
                  f"{rel(out[cbe][2], out['none'][2]):.2e}", flush=True)

# A tiny Llama under the booster (BF16 params, FP32 masters), each block compiled, as bench.
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from fp8boost.booster import Booster  # noqa: E402
from fp8boost.booster.mixed_precision import MixedPrecision  # noqa: E402
from fp8boost.compile import compile_blocks  # noqa: E402

for name in ("tensorwise", "rowwise", "blockwise"):
    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=512,
                                             intermediate_size=1024, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=4,
                                             use_cache=False)).cuda()
        if compiled:
            compile_blocks(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        booster = Booster(mixed_precision=MixedPrecision(
            "fp8", fp8_config=Fp8Config.from_recipe(name, min_numel=0)), device="cuda")
        model, opt, *_ = booster.boost(model, opt)
        ids = torch.randint(0, 1024, (4, 256), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(1))
        ls = []
        for _ in range(4):
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            ls.append(round(loss.item(), 4))
        losses[compiled] = ls
    print(f"llama {name:10} eager {losses[False]} compiled {losses[True]}", flush=True)
