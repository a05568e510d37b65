"""fsdp_doctor's memory categories and peak against PyTorch's FSDPMemTracker, and its activations against an
independent saved-tensor count, on the same steps of the same deterministic training.

    python benchmarks/memory_vs_memtracker.py [--models gpt,llama512,llama8192] [--steps 3] [--layers 4]
    python benchmarks/memory_vs_memtracker.py --device cuda     # 2 NCCL ranks sharing cuda:0 (NCCL_HOSTID)

Models (2 ranks: gloo on the CPU, NCCL on one GPU; fp32, each block its own FSDP unit, the rest in the root):

* ``gpt``: the reference GPT (``fsdp_doctor.workloads``, GELU) with ``wrap="blocks_only"`` (FSDPMemTracker
  breaks on grouped units, so the default ``[norm, lm_head]`` group is avoided);
* ``llama512`` / ``llama8192``: Hugging Face ``LlamaForCausalLM`` from a tiny ``LlamaConfig`` (SiLU/SwiGLU, GQA,
  untied head, vocabulary 512 / 8192; built from the config, nothing downloaded), the loss computed by the loop
  from the logits (cross-entropy), as the reference GPT's is.

Three runs of each, one after the other on a fresh model in the same two processes (attached together, the
tools would see each other's tensors and hooks):

1. ``fsdp_doctor.watch(memory={"full_every": 1})``;
2. ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (a TorchDispatchMode that classifies every
   storage as it is created; ``reset_mod_stats()`` each step);
3. no tool but an independent ``torch.autograd.graph.saved_tensors_hooks`` pair written here: it counts the
   unique storages autograd saves for backward (parameters, i.e. leaves that require grad, and their views
   skipped), removed when autograd drops them, and keeps the step's highest count. Its losses are those of a
   run without the doctor: run 1's must equal them bit for bit.

For the last step, rank 0 prints per category the highest value each tool saw at the same points of the
step (our mark (unit, forward_start) = the tracker's "After Pre-Forward" snapshot of that module, forward_end
= "Before Post-Forward", backward_start = "Before Pre-Backward", backward_end = "Before Post-Backward"), the
breakdown of both peaks, and the ratios: our peak / the tracker's op-level peak (its "Total" less the token
batch, "Inputs", which the doctor does not see), and our activations (the step's highest, counted at every
save: ``MemoryStep.activations_high``) / the independent count's highest.

Where the definitions differ:

* activations: ours are the tensors autograd saved for backward. The tracker's "Activation" is every storage
  created during the forward that is still alive, saved or not (block outputs held by the Python frames, the
  logits); ours counts those as temporaries.
* temporaries: what is alive outside the named categories (on CPU: the high-water counter of full steps); the
  tracker's "Temp" is every storage created during backward. Between marks the high-water row of ours names
  the categories of the neighbouring mark and puts what rose since into temporaries (the root's reduce-scatter
  buffer included, the tracker's "Reduce Scatter").
* comm_buffers: ours = the tracker's "All Gather" + "Reduce Scatter" at the marks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

OURS_TO_TRACKER = {
    "sharded_params": ("Sharded Param",),
    "unsharded_params": ("Unsharded Param",),
    "buffers": ("Buffer",),
    "sharded_grads": ("Sharded Grad",),
    "unsharded_grads": ("Unsharded Grad",),
    "optimizer_state": ("OptState",),
    "activations": ("Activation",),
    "comm_buffers": ("All Gather", "Reduce Scatter"),
    "temporaries": ("Temp",),
}
#: the categories both tools define alike: equal at every matched point
SAME = ("sharded_params", "unsharded_params", "buffers", "sharded_grads", "unsharded_grads", "optimizer_state",
        "comm_buffers")
PHASE_TO_STATE = {
    "forward_start": "After Pre-Forward",
    "forward_end": "Before Post-Forward",
    "backward_start": "Before Pre-Backward",
    "backward_end": "Before Post-Backward",
}
MODELS = ("gpt", "llama512", "llama8192")
SEQ, BATCH = 64, 4


# ------------------------------------------------------------------------------------------------ the training
def _llama(vocab: int, layers: int, device: str):
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=False, hidden_act="silu", attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batches(rank: int):
        step = 0
        while True:
            g = torch.Generator().manual_seed(1000 * step + rank)
            tok = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
            yield tok[:, :-1], tok[:, 1:]
            step += 1

    def loss_of(x, y):
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return model, opt, batches, loss_of


def build(name: str, layers: int, device: str = "cpu"):
    """(model, optimizer, batches(rank) iterator factory, loss_of(x, y)) of one benchmark model."""
    if name == "gpt":
        from fsdp_doctor.workloads import WorkloadConfig
        from fsdp_doctor.workloads.data import batches as gpt_batches
        from fsdp_doctor.workloads.train import build_training, next_token_loss

        cfg = WorkloadConfig(wrap="blocks_only", n_layers=layers, device=device)
        model, opt = build_training(cfg)
        return model, opt, (lambda rank: gpt_batches(cfg, rank)), (lambda x, y: next_token_loss(model(x), y))
    if name.startswith("llama"):
        return _llama(int(name[len("llama"):]), layers, device)
    raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")


class SavedCount:
    """Independent count of the bytes saved for backward: unique storages, parameters (leaves requiring grad)
    and their views skipped; a storage leaves the count when its last saved reference is dropped."""

    def __init__(self):
        self.refs: dict[int, list[int]] = {}  # storage data pointer -> [references, bytes]
        self.bytes = 0
        self.high = 0

    def pack(self, t):
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return t
        st = t.untyped_storage()
        key = st.data_ptr()
        e = self.refs.get(key)
        if e is None:
            self.refs[key] = [1, st.nbytes()]
            self.bytes += st.nbytes()
            self.high = max(self.high, self.bytes)
        else:
            e[0] += 1
        return _Held(t, key, self)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h


class _Held:
    def __init__(self, t, key, count):
        self.t, self.key, self.count = t, key, count

    def __del__(self):
        e = self.count.refs.get(self.key)
        if e is not None:
            e[0] -= 1
            if e[0] == 0:
                del self.count.refs[self.key]
                self.count.bytes -= e[1]


def _worker(rank: int, port: int, root: str, steps: int, layers: int, names: list, device: str = "cpu") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if device == "cuda":  # both ranks on cuda:0: NCCL accepts them as two hosts (../shared/notes/gpu-machine.md)
        os.environ["NCCL_HOSTID"] = f"mem-vs-tracker-rank-{rank}"
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=2)
    for name in names:
        for mode in ("ours", "tracker", "saved"):
            _run(rank, os.path.join(root, name), steps, layers, name, mode, device)
    dist.destroy_process_group()


def _run(rank: int, out: str, steps: int, layers: int, name: str, mode: str, device: str = "cpu") -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    import fsdp_doctor

    model, opt, batches, loss_of = build(name, layers, device)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    losses = []
    result: dict = {}

    def step(x, y):
        x, y = x.to(dev), y.to(dev)  # the batches are made on the host (a no-op on the CPU)
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    data = batches(rank)
    if mode == "ours":
        with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, memory={"full_every": 1}) as doc:
            for _ in range(steps):
                step(*next(data))
                doc.step()
    elif mode == "saved":
        highs = []
        for _ in range(steps):
            count = SavedCount()
            with torch.autograd.graph.saved_tensors_hooks(count.pack, count.unpack):
                step(*next(data))
            highs.append(count.high)
        result["saved_high"] = highs
    else:
        fmt = FSDPMemTracker(model, opt)
        points = {}
        with fmt:
            for i in range(steps):
                fmt.reset_mod_stats()
                if i == steps - 1:
                    fmt._peak_mem = {}  # the op-level peak of this step only
                step(*next(data))
            for mod_stat in fmt.memory_tracking.values():
                fqn = mod_stat.mod_fqn.split(".", 1)[1] if "." in mod_stat.mod_fqn else ""
                for state, snaps in mod_stat.snapshots.items():
                    snap = snaps[-1].get(dev) if snaps else None
                    if snap:
                        points[f"{fqn}|{state.value}"] = {k: int(v) for k, v in snap.items()}
            result["points"] = points
            result["op_peak"] = {k: int(v) for k, v in
                                 fmt.get_tracker_snapshot("peak").get(dev, {}).items()}
    result["losses"] = losses
    with open(os.path.join(out, f"{mode}{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


# ------------------------------------------------------------------------------------------------ the comparison
def compare(out: str, rank: int = 0) -> dict:
    """The figures of the last step of ``rank`` (bytes)."""
    from fsdp_doctor import load_run

    run = load_run(out)
    tr = json.loads(open(os.path.join(out, f"tracker{rank}.json")).read())
    sv = json.loads(open(os.path.join(out, f"saved{rank}.json")).read())
    ours_losses = [json.loads(open(os.path.join(out, f"ours{r}.json")).read())["losses"] for r in range(2)]
    plain_losses = [json.loads(open(os.path.join(out, f"saved{r}.json")).read())["losses"] for r in range(2)]
    mem = run.ranks[rank].steps[-1].memory
    tl = mem.timeline
    if tl is None:
        raise SystemExit("the last step has no timeline; run with more steps")
    cols = tl.columns
    rows = [dict(zip(cols, r)) for r in tl.rows]
    ours_max = {c: 0 for c in OURS_TO_TRACKER}
    theirs_max = {c: 0 for c in OURS_TO_TRACKER}
    matched = 0
    mismatched = []
    for d in rows:
        if d["unit"] is None or d["phase"] not in PHASE_TO_STATE:
            continue
        snap = tr["points"].get(f"{d['unit']}|{PHASE_TO_STATE[d['phase']]}")
        if snap is None:
            continue
        matched += 1
        for c, keys in OURS_TO_TRACKER.items():
            theirs = sum(snap.get(k, 0) for k in keys)
            ours_max[c] = max(ours_max[c], d[c])
            theirs_max[c] = max(theirs_max[c], theirs)
            if c in SAME and d[c] != theirs:
                mismatched.append((d["unit"], d["phase"], c, d[c], theirs))
    op_peak = tr["op_peak"]
    tracker_peak = op_peak.get("Total", 0) - op_peak.get("Inputs", 0)
    return {
        "matched": matched, "mismatched": mismatched, "ours_max": ours_max, "tracker_max": theirs_max,
        "peak": mem.peak.bytes, "peak_at": (mem.peak.unit, mem.peak.phase), "peak_breakdown": mem.peak.breakdown,
        "tracker_peak": tracker_peak, "tracker_breakdown": op_peak,
        "activations": mem.activations_high, "activations_sampled": max(d["activations"] for d in rows),
        "saved_high": sv["saved_high"][-1],
        "losses_identical": ours_losses == plain_losses, "probe_us": mem.probe_us, "transients": mem.transients,
    }


def measure(names, steps: int = 3, layers: int = 4, root: str | None = None, device: str = "cpu") -> dict:
    """The three runs of each model (two spawned ranks for all), and their comparisons (rank 0, last step)."""
    from fsdp_doctor.workloads import free_port

    root = root or tempfile.mkdtemp(prefix="mem_vs_tracker_")
    for name in names:
        os.makedirs(os.path.join(root, name), exist_ok=True)
    mp.spawn(_worker, args=(free_port(), root, steps, layers, list(names), device), nprocs=2)
    out = {}
    for name in names:
        out[name] = compare(os.path.join(root, name))
        out[name]["out"] = os.path.join(root, name)
    return out


def _pct(a: int, b: int) -> str:
    if a == b:
        return "0.0%"
    if b == 0:
        return "n/a"
    return f"{100.0 * (a - b) / b:+.1f}%"


def report(name: str, r: dict) -> None:
    mib = 1 << 20
    print(f"\n== {name}: last step, rank 0; {r['matched']} matched points; run {r['out']}")
    print(f"{'category':<18}{'max ours':>11}{'max tracker':>13}{'diff':>8}   {'@peak ours':>11}")
    for c in OURS_TO_TRACKER:
        mo, mt = r["ours_max"][c], r["tracker_max"][c]
        print(f"{c:<18}{mo / mib:>10.3f}M{mt / mib:>12.3f}M{_pct(mo, mt):>8}   "
              f"{r['peak_breakdown'].get(c, 0) / mib:>10.3f}M")
    tb = ", ".join(f"{k} {v / mib:.3f}M" for k, v in r["tracker_breakdown"].items() if v and k != "Total")
    print(f"tracker op-level peak: {tb}")
    unit, phase = r["peak_at"]
    print(f"peak: ours {r['peak'] / mib:.3f} MiB ({unit or '(root)' if unit is not None else 'model'} {phase}), "
          f"tracker {r['tracker_peak'] / mib:.3f} MiB without inputs: ratio {r['peak'] / r['tracker_peak']:.4f}")
    print(f"activations: ours {r['activations'] / mib:.3f} MiB (the step's highest, counted at every save; "
          f"{r['activations_sampled'] / mib:.3f} MiB at the marks and high-waters), independent saved-tensor count "
          f"{r['saved_high'] / mib:.3f} MiB: ratio {r['activations'] / r['saved_high']:.4f}")
    print(f"categories measured alike, at every matched point: {'equal' if not r['mismatched'] else r['mismatched']}")
    print(f"losses with the doctor bit-identical to those without: {r['losses_identical']}; "
          f"probe cost this step {r['probe_us'] / 1e3:.1f} ms (high-water: {r['transients']})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: 2 NCCL ranks sharing cuda:0 (each its own NCCL_HOSTID)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("memory_vs_memtracker: --device cuda, but torch sees no CUDA device")
    for name, res in measure(args.models.split(","), args.steps, args.layers, device=args.device).items():
        report(name, res)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
