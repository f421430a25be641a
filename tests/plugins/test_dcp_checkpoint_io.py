"""DTensorCheckpointIO on gloo, without any plugin: a tiny FP32 Llama sharded by FSDP2
(``fully_shard`` per decoder block + root on a 1-D "dp" mesh), AdamW, and a stand-in plugin.

One 2-rank spawn saves (HF export, resumable DCP state, optimizer alone) and checks round
trips, the per-rank read share, a meta-device load, ``save_pretrained`` folders, tied weights,
atomicity and errors; 4-rank and 1-rank spawns load what 2 ranks saved. The 4-rank spawn also
loads/exports through hand-made 2-D ("dp", "tp") layouts: Shard(0)/Shard(1)/Replicate and the
strided shard of FSDP over TP. Non-distributed cases (plain module, every dtype, error texts)
run in this process.

Tolerances:
* every save -> load is bit-exact: FP32 values are copied, never recomputed;
* resuming at the world size that saved (2): the next losses are bit-identical to the
  uninterrupted run;
* resuming at another world size (1 or 4): parameters and Adam state load bit-exactly, and the
  next 2 losses agree with uninterrupted training (the 2-rank run that saved, and a 1- or
  4-rank run from scratch) to rel 1e-5: the only differences are how the global batch is split
  into per-rank means and the order of the FP32 gradient reduction (measured on torch 2.13
  CPU: identical at 1 rank, 1e-7 relative at 4 ranks).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist_utils import run_distributed

SAVE_AT, MORE = 3, 2


# --------------------------------------------------------------------------- stand-ins
class _Plugin:
    """What DTensorCheckpointIO needs from a plugin."""

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model

    @property
    def checkpoint_group(self):
        return dist.group.WORLD if dist.is_initialized() else None


class _Wrapped:
    """A plugin's optimizer wrapper: the torch optimizer as ``.optim``, its model as ``.model``."""

    def __init__(self, optim: torch.optim.Optimizer, model: nn.Module) -> None:
        self.optim, self.model = optim, model


def _io():
    from fp8boost.checkpoint_io.dcp import DTensorCheckpointIO
    return DTensorCheckpointIO(_Plugin())


# -------------------------------------------------------------------------- model, data
def _tiny(seed: int, tie: bool = False, device: str = "cpu") -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                      tie_word_embeddings=tie)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def _build(seed: int, world: int, tie: bool = False, meta: bool = False):
    """FSDP2-sharded tiny Llama (FP32 masters, Shard(0) on "dp") and AdamW on its shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _tiny(seed, tie, "meta" if meta else "cpu")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        model.to_empty(device="cpu")  # garbage values: the load must fill every tensor
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model, opt, rank: int, world: int, start: int, steps: int) -> list[float]:
    """Global batch of 8 sequences per step, 8/world per rank; returns the global mean losses."""
    losses = []
    for step in range(start, start + steps):
        ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(step))
        mine = ids[rank * 8 // world:(rank + 1) * 8 // world]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _params(model) -> dict[str, torch.Tensor]:
    return {k: _full(v) for k, v in model.state_dict().items()}


def _optim(model, opt) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}/{k}": _full(v) for p, s in opt.state.items() for k, v in s.items()}


def _same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {bad[:5]}"


# -------------------------------------------------------------------- counting reads
class _Counting:
    """A ``safe_open`` handle (or one of its slices) adding the bytes of every tensor it returns
    to ``box[0]``; headers (keys, shapes) cost nothing."""

    def __init__(self, inner, box: list) -> None:
        self.inner, self.box = inner, box

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self.box[0] += t.numel() * t.element_size()
        return t

    def get_slice(self, key):
        return _Counting(self.inner.get_slice(key), self.box)

    def get_tensor(self, key):
        return self._count(self.inner.get_tensor(key))

    def __getitem__(self, index):
        return self._count(self.inner[index])


@contextlib.contextmanager
def _count_reads():
    """Bytes of tensor data this rank gets from safetensors inside the block."""
    import safetensors
    real, box = safetensors.safe_open, [0]
    safetensors.safe_open = lambda path, fw, **kw: _Counting(real(path, fw, **kw), box)
    try:
        yield box
    finally:
        safetensors.safe_open = real


def _local_bytes(model) -> int:
    return sum(t.to_local().numel() * t.element_size() for t in model.state_dict().values())


# ------------------------------------------------------------------------ 2-rank spawn
def _two_ranks(rank: int, world: int, root: str) -> list[float]:
    from transformers import LlamaForCausalLM

    io, p = _io(), lambda name: os.path.join(root, name)
    model, opt = _build(0, world)
    _train(model, opt, rank, world, 0, SAVE_AT)
    io.save_model(model, p("hf"), size_per_shard_mb=0.05)
    io.save_model(model, p("hf1"), shard=False)
    io.save_checkpoint(p("state"), model, _Wrapped(opt, model), extra={"step": SAVE_AT})
    io.save_optimizer(_Wrapped(opt, model), p("optim_fqn"))
    io.save_optimizer(opt, p("optim_pos"))  # a raw torch optimizer: keyed by position
    ref = {"params": _params(model), "optim": _optim(model, opt)}
    ref["cont"] = _train(model, opt, rank, world, SAVE_AT, MORE)  # uninterrupted
    if rank == 0:
        torch.save(ref, p("ref.pt"))
        index = json.load(open(p("hf/model.safetensors.index.json")))
        assert len(set(index["weight_map"].values())) >= 3
        assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in ref["params"].values())
        assert os.listdir(p("hf1")).count("model.safetensors") == 1
        for d in ("hf", "hf1"):
            _same(LlamaForCausalLM.from_pretrained(p(d)).state_dict(), ref["params"], d)
    dist.barrier()

    # Resume at the same world size: exact state, bit-identical losses.
    m, o = _build(7, world)
    assert io.load_checkpoint(p("state"), m, _Wrapped(o, m)) == {"step": SAVE_AT}
    _same(_params(m), ref["params"], "resumed params")
    _same(_optim(m, o), ref["optim"], "resumed optimizer")
    assert _train(m, o, rank, world, SAVE_AT, MORE) == ref["cont"]

    # Meta-device model + HF load: each rank reads only its own slices (1/world here: every
    # tensor is sharded evenly); then the optimizer alone (FQN keys).
    m, o = _build(8, world, meta=True)
    with _count_reads() as read:
        io.load_model(m, p("hf"))
    total = sum(t.numel() * 4 for t in ref["params"].values())
    assert read[0] == _local_bytes(m) == total // world, (read, total)
    _same(_params(m), ref["params"], "meta + sharded load")
    io.load_optimizer(_Wrapped(o, m), p("optim_fqn"))
    _same(_optim(m, o), ref["optim"], "optimizer alone")

    _hf_folders_and_tied(rank, world, root)
    _atomic_and_errors(rank, world, root, model, opt, ref)
    return ref["cont"]


def _hf_folders_and_tied(rank: int, world: int, root: str) -> None:
    """A ``save_pretrained`` folder loads; tied weights are written once and stay tied."""
    from transformers import LlamaForCausalLM

    io, p = _io(), lambda name: os.path.join(root, name)
    if rank == 0:
        _tiny(3).save_pretrained(p("pretrained"))
    dist.barrier()
    m, _ = _build(9, world)
    io.load_model(m, p("pretrained"))
    _same(_params(m), _tiny(3).state_dict(), "save_pretrained folder")

    tied, _ = _build(4, world, tie=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    want = _params(tied)
    io.save_model(tied, p("tied"), size_per_shard_mb=0.05)
    if rank == 0:
        index = json.load(open(p("tied/model.safetensors.index.json")))
        assert "lm_head.weight" not in index["weight_map"]
        hf = LlamaForCausalLM.from_pretrained(p("tied"))
        _same(hf.state_dict(), want, "tied export")
    m, _ = _build(5, world, tie=True)
    io.load_model(m, p("tied"))
    _same(_params(m), want, "tied load")
    assert m.lm_head.weight is m.model.embed_tokens.weight


def _atomic_and_errors(rank, world, root, model, opt, ref) -> None:
    """A save that fails midway keeps the previous checkpoint; bad paths give clear errors."""
    from torch.distributed.checkpoint import FileSystemWriter

    from fp8boost.checkpoint_io import hf_sharded

    io, p = _io(), lambda name: os.path.join(root, name)
    write = hf_sharded._StreamedFile.write
    calls = []

    def dying_write(self, key, t):  # rank 0 dies after a few tensors (disk full, killed)
        calls.append(key)
        if len(calls) > 5:
            raise OSError("No space left on device (simulated)")
        write(self, key, t)

    hf_sharded._StreamedFile.write = dying_write if rank == 0 else write
    try:
        with pytest.raises((OSError, RuntimeError)):
            io.save_model(model, p("hf"), size_per_shard_mb=0.05)  # model moved on since
    finally:
        hf_sharded._StreamedFile.write = write
    real_write_data = FileSystemWriter.write_data
    if rank == 1:
        FileSystemWriter.write_data = lambda self, plan, planner: (_ for _ in ()).throw(
            OSError("No space left on device (simulated)"))
    try:
        with pytest.raises(RuntimeError, match="No space left on device"):
            io.save_checkpoint(p("state"), model, _Wrapped(opt, model), extra={"step": 99})
    finally:
        FileSystemWriter.write_data = real_write_data
    assert not glob.glob(p(".hf.tmp-*")) and not glob.glob(p(".state.tmp-*"))
    m, o = _build(10, world)
    io.load_model(m, p("hf"))
    _same(_params(m), ref["params"], "export after a failed save")
    assert io.load_checkpoint(p("state"), m, _Wrapped(o, m)) == {"step": SAVE_AT}
    _same(_optim(m, o), ref["optim"], "state after a failed save")

    with pytest.raises(FileNotFoundError, match=f"{p('optim_pos')}.*model.safetensors"):
        io.load_model(m, p("optim_pos"))
    with pytest.raises(FileNotFoundError, match=f"{p('hf')}.*fp8boost_checkpoint.json"):
        io.load_checkpoint(p("hf"), m, o)
    with pytest.raises(FileNotFoundError, match=f"{p('hf')}.*fp8boost_dcp_optimizer.json"):
        io.load_optimizer(o, p("hf"))
    with pytest.raises(TypeError, match="keyed by parameter names"):
        io.load_optimizer(o, p("optim_fqn"))  # raw optimizer: it cannot name its parameters
    if rank == 0:
        shutil.copytree(p("hf"), p("bad"))
        index = json.load(open(p("bad/model.safetensors.index.json")))
        victim = p("bad/" + sorted(set(index["weight_map"].values()))[1])
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) - 10)
    dist.barrier()
    with pytest.raises(OSError, match="model-00002-of-.*truncated or corrupt"):
        io.load_model(m, p("bad"))


# ------------------------------------------------------------- loads at other world sizes
def _other_world(rank: int, world: int, root: str) -> tuple[list[float], list[float]]:
    io, p = _io(), lambda name: os.path.join(root, name)
    ref = torch.load(p("ref.pt"), weights_only=True)
    m, o = _build(11, world)
    assert io.load_checkpoint(p("state"), m, _Wrapped(o, m)) == {"step": SAVE_AT}
    _same(_params(m), ref["params"], f"params resharded to {world}")
    _same(_optim(m, o), ref["optim"], f"optimizer resharded to {world}")
    resumed = _train(m, o, rank, world, SAVE_AT, MORE)

    m, o = _build(12, world)
    io.load_model(m, p("hf"))
    io.load_optimizer(o, p("optim_pos"))
    _same(_params(m), ref["params"], "export")
    _same(_optim(m, o), ref["optim"], f"positional optimizer resharded to {world}")

    m, o = _build(0, world)
    straight = _train(m, o, rank, world, 0, SAVE_AT + MORE)[SAVE_AT:]
    if world == 4:
        _two_d_layouts(rank, root, ref["params"])
    return resumed, straight


def _distribute(model: nn.Module, mesh) -> None:
    """Replace every parameter by a DTensor on the 2-D mesh, cycling through layouts a
    tensor-parallel plugin produces (the last one is FSDP2's strided shard over TP)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    layouts = [(Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Replicate()),
               (Shard(0), Shard(0)), (_StridedShard(0, split_factor=2), Shard(0))]
    for i, (name, prm) in enumerate(list(model.named_parameters())):
        owner, _, leaf = name.rpartition(".")
        placements = layouts[i % len(layouts)] if prm.ndim == 2 else (Shard(0), Replicate())
        dt = distribute_tensor(prm.detach(), mesh, placements)
        model.get_submodule(owner).register_parameter(leaf, nn.Parameter(dt))


def _two_d_layouts(rank: int, root: str, want: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    io, p = _io(), lambda name: os.path.join(root, name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tiny(13)
    _distribute(model, mesh)
    with _count_reads() as read:
        io.load_model(model, p("hf"))
    _same(_params(model), want, "2-D layouts")
    # Boxes are read as slices; the strided shard has no box: read whole, cut locally.
    box = (Shard, Replicate)
    expected = sum((t.to_local().numel() if all(type(q) in box for q in t.placements)
                    else t.numel()) * 4 for t in model.state_dict().values())
    assert read[0] == expected < sum(t.numel() * 4 for t in want.values())
    io.save_model(model, p("hf_2d"), size_per_shard_mb=0.05)
    if rank == 0:
        from safetensors.torch import load_file
        got = {}
        for f in glob.glob(p("hf_2d/*.safetensors")):
            got.update(load_file(f))
        _same(got, want, "2-D export")
    # The 1-D FSDP resumable state reshards onto the 2-D layouts (model only).
    other = _tiny(14)
    _distribute(other, mesh)
    io.load_checkpoint(p("state"), other)
    _same(_params(other), want, "DCP state onto 2-D layouts")


# ---------------------------------------------------------------------------- the tests
@pytest.mark.slow
def test_dtensor_checkpoints_save_reshard_resume(tmp_path):
    root = str(tmp_path)
    cont = run_distributed(_two_ranks, 2, root)[0]
    for world in (4, 1):
        resumed, straight = run_distributed(_other_world, world, root)[0]
        assert resumed == pytest.approx(cont, rel=1e-5), (world, resumed, cont)
        assert resumed == pytest.approx(straight, rel=1e-5), (world, resumed, straight)


def _bits(sd: dict) -> dict:
    """FP8 tensors as bytes (torch.equal has no FP8 kernel)."""
    return {k: v.view(torch.uint8) if v.dtype.itemsize == 1 and v.is_floating_point() else v
            for k, v in sd.items()}


def test_plain_module_every_dtype_and_errors(tmp_path):
    """No process group: plain tensors (tied ones too), every dtype through the streamed
    safetensors writer, the optimizer through DCP, and the error messages."""
    from safetensors.torch import load_file

    io = _io()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(16, 32))
    module[2].weight = module[0].weight  # tied: written once, loaded through the tie
    buffers = {"bf16": torch.randn(5, 3).bfloat16(), "f16": torch.randn(3).half(),
               "i64": torch.arange(7), "flag": torch.tensor([True, False]),
               "e4m3": torch.randn(4, 4).to(torch.float8_e4m3fn),
               "e5m2": torch.randn(4, 4).to(torch.float8_e5m2),
               "scalar": torch.tensor(2.5).double()}
    for name, t in buffers.items():
        module.register_buffer(name, t)
    want = module.state_dict()
    path = str(tmp_path / "plain")
    io.save_model(module, path, size_per_shard_mb=0.0005)
    got = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        got.update(load_file(f))
    assert "2.weight" not in got and len(glob.glob(os.path.join(path, "*.safetensors"))) >= 3
    _same(_bits(got), _bits({k: v for k, v in want.items() if k != "2.weight"}), "every dtype")
    other = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(16, 32))
    other[2].weight = other[0].weight
    for name, t in buffers.items():
        other.register_buffer(name, torch.zeros_like(t))
    io.load_model(other, path)
    _same(_bits(other.state_dict()), _bits(want), "plain round trip")

    opt = torch.optim.AdamW(module.parameters(), lr=0.1)
    module[1](module[0](torch.randn(4, 16))).sum().backward()
    opt.step()
    io.save_optimizer(opt, str(tmp_path / "optim"))
    opt2 = torch.optim.AdamW(other.parameters(), lr=0.1)
    io.load_optimizer(opt2, str(tmp_path / "optim"))
    _same(_optim(other, opt2), _optim(module, opt), "optimizer without a process group")
    with pytest.raises(RuntimeError, match="does not fit .*optim.state.p0.exp_avg"):
        io.load_optimizer(torch.optim.SGD(nn.Linear(16, 32).parameters(), lr=0.1, momentum=0.9),
                          str(tmp_path / "optim"))

    state = str(tmp_path / "state")
    io.save_checkpoint(state, module, extra={"note": "model only"})
    with pytest.raises(ValueError, match="saved without an optimizer"):
        io.load_checkpoint(state, other, opt2)
    with pytest.raises(RuntimeError, match=r"does not fit.*model\.1\.weight"):
        io.load_checkpoint(state, nn.Sequential(nn.Linear(16, 32)))  # DCP alone would skip them
    assert io.load_checkpoint(state, other) == {"note": "model only"}

    _error_messages(io, other, path, tmp_path)


def _error_messages(io, module, path, tmp_path) -> None:
    from fp8boost.checkpoint_io import formats as cio

    with pytest.raises(FileNotFoundError, match="no model checkpoint at .*model.safetensors"):
        io.load_model(module, str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match=r"does not match the model: shape mismatches \[.0.w"):
        io.load_model(nn.Sequential(nn.Linear(16, 8)), path)
    io.load_model(nn.Sequential(nn.Linear(16, 32)), path, strict=False)  # subset: allowed
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    victim = sorted(glob.glob(str(bad / "model-*.safetensors")))[0]
    with open(victim, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(OSError, match=os.path.basename(victim) + ".*corrupt"):
        io.load_model(module, str(bad))
    os.remove(victim)
    with pytest.raises(OSError, match=os.path.basename(victim)):
        io.load_model(module, str(bad))
    (bad / cio.MODEL_INDEX).write_text("{ truncated")
    with pytest.raises(OSError, match=cio.MODEL_INDEX):
        io.load_model(module, str(bad))
    general = tmp_path / "general"
    general.mkdir()
    (general / cio.OPTIM_INDEX).write_text("{}")
    with pytest.raises(ValueError, match="has optimizer format None"):
        io.load_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), str(general))
    with pytest.raises(ValueError, match="not a checkpoint of this kind"):
        io.save_model(module, str(general))  # never overwrite a foreign directory
    with pytest.raises(FileNotFoundError, match="missing fp8boost_checkpoint.json"):
        io.load_checkpoint(path, module)
