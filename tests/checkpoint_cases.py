"""Run as a script (one gloo rank in a fresh process): blocks whose forward checkpoints a submodule
functionally (``checkpoint(self.mlp, h)``), the whole block, or nothing; prints one JSON object per case with
what the doctor recorded. Used by test_checkpoint_detection.py."""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

import fsdp_doctor
from fsdp_doctor.workloads import free_port

DIM, HIDDEN, LAYERS, STEPS = 64, 256, 3, 5


class Block(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        # "children" | "block" | "none" | "compiled" (children, in blocks compiled with Dynamo) | "compiled_model"
        # (none, the whole model compiled in place after sharding) | "compiled_wrapper" (none, model =
        # torch.compile(model) after sharding) | "compiled_hidden" (none, the plain model given to watch(), its
        # compiled wrapper trained) | "compiled_step" (none, torch.compile(optimizer.step))
        self.mode = mode
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))

    def forward(self, x):
        h = x + self.attn(self.norm(x))
        if self.mode in ("children", "compiled"):
            return h + checkpoint(self.mlp, h, use_reentrant=False)
        return h + self.mlp(h)


class Model(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.layers = nn.ModuleList(Block(mode) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.mode == "block" else layer(x)
        return self.head(x)


def run(mode: str, watched: bool) -> dict:
    torch._dynamo.reset()  # (each run compiles as a process of its own would: the counters its own)
    torch.manual_seed(0)
    model = Model(mode)
    for layer in model.layers:
        if mode == "compiled":
            layer.compile(backend="eager")  # Dynamo without a C++ toolchain
        fully_shard(layer)
    fully_shard(model)
    if mode == "compiled_model":
        model.compile(backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == "compiled_wrapper":
        model = torch.compile(model, backend="eager")
    forward = torch.compile(model, backend="eager") if mode == "compiled_hidden" else model
    step_fn = torch.compile(opt.step, backend="eager") if mode == "compiled_step" else opt.step
    # the calls that enter compiled frames, as the user left them
    def calls():
        return [vars(m).get(a) for m in (model, *model.layers) for a in ("_compiled_call_impl", "forward")]

    compiled_calls = calls()
    out = tempfile.mkdtemp(dir=os.environ.get("CHECKPOINT_CASES_DIR"))  # the test gives its tmp dir
    ctx = fsdp_doctor.watch(model, opt, out_dir=out, profile=False, **json.loads(os.environ.get("CC_WOPTS", "{}"))) if watched else None
    doctor = ctx.__enter__() if ctx else None
    global_hooks = len(torch.nn.modules.module._global_forward_pre_hooks)  # none of the doctor's

    def watch_hooks():  # the doctor's checkpoint watch: a forward pre-hook on each watched submodule
        return sum(getattr(h, "__name__", "") == "_probe_child" for m in model.modules()
                   for h in m._forward_pre_hooks.values())

    from torch._dynamo.utils import counters

    counters.clear()
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 32, DIM, generator=g)
        loss = forward(x).pow(2).mean()
        if step == 0:  # the watch is on from the model's first training forward outside a compiled frame
            watching = watch_hooks()
        loss.backward()
        step_fn()
        opt.zero_grad()
        if doctor:
            doctor.step()
            if step == 0:  # the watch for functional checkpointing ends with the first step
                hooks_left = watch_hooks()
        losses.append(loss.item())
    res = {"losses": losses, "graph_breaks": sum(counters["graph_break"].values()),
           "unique_graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"]}
    if ctx:
        ctx.__exit__(None, None, None)
        # each block's compiled call as it was before watch(), the doctor's timing of it gone
        res["compiled_calls_restored"] = all(a is b for a, b in zip(calls(), compiled_calls))
        run_ = fsdp_doctor.load_run(out)
        res["checkpoint"] = {u.name: u.checkpoint for u in run_.config.units}
        res["compiled_in_place"] = [u.name for u in run_.config.units if u.compiled_in_place]
        res["compiled_call_timed"] = [u.name for u in run_.config.units if u.compiled_call_timed]
        steps = run_.ranks[0].steps[1:]  # the first step watched; the others are timed
        res["recompute_ms"] = {u.name: [next(x for x in s.units if x.name == u.name).recompute_ms for s in steps]
                               for u in run_.config.units}
        res["fwd_ms"] = {u.name: [next(x for x in s.units if x.name == u.name).fwd_ms for s in steps]
                         for u in run_.config.units}
        res["forward_ms"] = [s.forward_ms for s in steps]  # the model's forward, each step
        res["compiles"] = [s.compiles for s in run_.ranks[0].steps]  # torch.compile's graphs, each step
        res["compile_ms"] = [s.compile_ms for s in run_.ranks[0].steps]
        res["errors"] = [e.message for e in run_.ranks[0].errors]
        res["watch_hooks_after_first_step"] = hooks_left
        res["watch_hooks_first_step"] = watching
        res["out_dir"] = out
        res["global_hooks_at_entry"] = global_hooks
    return res


def main():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    out = {}
    for mode in sys.argv[1:] or ["children", "block", "none", "compiled", "compiled_model", "compiled_wrapper",
                                 "compiled_hidden", "compiled_step"]:
        out[mode] = run(mode, watched=True)
        plain = run(mode, watched=False)
        out[mode]["plain_losses"], out[mode]["plain_graph_breaks"] = plain["losses"], plain["graph_breaks"]
        out[mode]["plain_unique_graphs"], out[mode]["plain_frames"] = plain["unique_graphs"], plain["frames"]
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
