"""Models we did not write, trained the way their users do, with and without the doctor (one rank per
process; tests/test_clients.py starts the ranks). Prints one ``RESULT {json}`` line per rank.

Clients:
  transformer  torch's test Transformer (torch.testing._internal, tied embedding/output weights, functional
               ``torch.utils.checkpoint.checkpoint(layer, h)``), 2 ranks, gradient accumulation with
               ``set_requires_gradient_sync(False)``, ``clip_grad_norm_``, the user's own profiler (scheduled,
               overlapping the doctor's window; then unscheduled).
  compiled     the same Transformer with each block ``torch.compile``d as a wrapper (older torchtitan: compile, then
               fully_shard); backend "aot_eager": what the doctor meets (an OptimizedModule per block, hooks
               outside the graph) is the same as with inductor, without inductor's C++ build of each block.
  llama        a torchtitan-style llama3 (RMSNorm, GQA attention, SwiGLU) sharded the torchtitan way on a
               2x2 HSDP mesh (4 ranks), bf16 params / fp32 reduce, frozen bf16 weights beside trainable fp32
               ones, and a trainable parameter passed as ``ignored_params``.

  scenarios    the scenario matrix's rows one after the other (tests/scenario_matrix.py): a model tree (the
               reference GPT, an HF Llama from a tiny ``LlamaConfig``, a torchtitan-shaped llama, a
               torchvision-style ResNet, torch's Transformer) and the user's code with one planted problem (the
               workload knobs), trained with the doctor; with a fix, the fix pasted where its
               ``Recommendation.where`` says.

The scenarios run on the CPU (gloo) unless FSDP_DOCTOR_SCENARIO_DEVICE=cuda (tests/test_clients.py ``_launch``
sets it with each rank's environment from fsdp_doctor.workloads' rank plan): NCCL, the rank's device
(FSDP_DOCTOR_CUDA_DEVICE; ranks sharing one GPU each have their own NCCL_HOSTID), the mesh, model and inputs there.

Usage: python tests/clients.py CLIENT RANK WORLD PORT OUT_DIR
       python tests/clients.py snippets 0 1 PORT SPEC.json   (runs fix snippets: [[client, code, snippet, where,
                                                              inputs], ...]: a Recommendation's code, place, inputs)
       python tests/clients.py scenarios RANK WORLD PORT SPEC.json   ([{name, tree, knobs, watch, out_dir, fix}...])
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_doctor
from fsdp_doctor.diagnose.snippets import BEFORE_SHARDING, PLUGIN_INPUTS, SHARDING_GOES_HERE
from fsdp_doctor.record.config_snapshot import alloc_conf

STEPS = 10
SEQ = 32
BATCH = 2
DEVICE_ENV = "FSDP_DOCTOR_SCENARIO_DEVICE"


def scenario_device() -> torch.device:
    """The scenarios' device: the CPU, or with FSDP_DOCTOR_SCENARIO_DEVICE=cuda this rank's GPU (the index its
    launcher's rank plan gave it: fsdp_doctor.workloads.launch._rank_env)."""
    if os.environ.get(DEVICE_ENV, "cpu") != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("FSDP_DOCTOR_CUDA_DEVICE", "0")))


# ------------------------------------------------------------------------------------------------ models
def transformer(checkpoint: bool = True):
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    return Transformer(ModelArgs(n_layers=3, vocab_size=512, max_seq_len=SEQ, dim=64, n_heads=4, dropout_p=0.0,
                                 checkpoint_activations=checkpoint))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Grouped-query attention (llama3): n_kv_heads < n_heads, keys and values repeated per group."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU; w3 is a frozen bf16 weight (a frozen base beside trainable fp32 weights, as in adapters)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False).to(torch.bfloat16).requires_grad_(False)

    def forward(self, x):  # the cast is a no-op under a bf16 MixedPrecisionPolicy
        return self.w2(F.silu(self.w1(x)) * self.w3(x.to(self.w3.weight.dtype)).to(x.dtype))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=128, out_scale=True):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads, n_kv_heads, hidden) for i in range(n_layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        # trainable, passed as ignored_params (a 0-d parameter fully_shard cannot shard)
        self.out_scale = nn.Parameter(torch.ones(())) if out_scale else None

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        out = self.output(self.norm(h))
        return out if self.out_scale is None else out * self.out_scale


def llama(out_scale: bool = True):
    torch.manual_seed(0)
    return Llama(out_scale=out_scale)


# ------------------------------------------------------------------------------------------------ sharding
def shard_blocks(model, mesh=None):
    """fully_shard per block and on the root: the embedding and the tied output head stay in the root."""
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def compile_blocks(model):
    """torchtitan's apply_compile: each block compiled and put back in place, before fully_shard."""
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend="aot_eager")
    return model


def apply_fsdp_titan(model, mesh):
    """torchtitan's apply_fsdp: bf16 params / fp32 reduce, embeddings a unit, each block a unit, [norm, output]
    grouped and kept gathered after forward, then the root (here with a trainable parameter ignored)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = {"mesh": mesh, "mp_policy": mp}
    fully_shard(model.tok_embeddings, **cfg, reshard_after_forward=True)
    for block in model.layers.values():
        fully_shard(block, **cfg, reshard_after_forward=True)
    fully_shard([model.norm, model.output], **cfg, reshard_after_forward=False)
    fully_shard(model, **cfg, ignored_params={model.out_scale})
    return model


def hsdp_mesh():
    return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp_replicate", "dp_shard"))


# ------------------------------------------------------------------------------------------------ training
def batch(step: int, vocab: int, rank: int, micro: int = 0, size: tuple[int, int] = (BATCH, SEQ)):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    tok = torch.randint(0, vocab, (size[0], size[1] + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def train(model, vocab, *, out_dir=None, watch_kw=None, micro_steps=1, clip=False, user_profiler=None,
          steps=STEPS, foreach=None):
    """The user's loop. Returns (losses, doctor or None). ``user_profiler``: a torch.profiler.profile, stepped
    by the loop when it has a schedule."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=foreach)
    rank = dist.get_rank()
    losses = []
    ctx = fsdp_doctor.watch(model, opt, out_dir=str(out_dir), **(watch_kw or {})) if out_dir else None
    doctor = ctx.__enter__() if ctx else None
    try:
        for step in range(steps):
            total = 0.0
            for micro in range(micro_steps):
                last = micro == micro_steps - 1
                model.set_requires_gradient_sync(last)  # gradient accumulation: reduce on the last micro-step
                tok, tgt = batch(step, vocab, rank, micro)
                loss = F.cross_entropy(model(tok).float().flatten(0, 1), tgt.flatten()) / micro_steps
                loss.backward()
                total += loss.item()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, foreach=True)
            opt.step()
            opt.zero_grad()
            if doctor is not None:
                doctor.step()
            if user_profiler is not None and user_profiler.schedule is not None:
                user_profiler.step()
            losses.append(total)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return losses, doctor


class EventCount:
    """on_trace_ready for the user's profiler: counts the events of each trace it delivers."""

    def __init__(self):
        self.events = []

    def __call__(self, prof):
        self.events.append(len(prof.events()))


def user_profiler(scheduled: bool) -> tuple[torch.profiler.profile, EventCount]:
    seen = EventCount()
    kw = {"activities": [torch.profiler.ProfilerActivity.CPU], "on_trace_ready": seen}
    if scheduled:  # warm-up at step 5, records 6-7: the doctor's default window exactly (it opens first)
        kw["schedule"] = torch.profiler.schedule(wait=5, warmup=1, active=2, repeat=1)
    return torch.profiler.profile(**kw), seen


# ------------------------------------------------------------------------------------------------ clients
def run_transformer(out: Path) -> dict:
    res = {}
    vocab = 512
    common = dict(micro_steps=2, clip=True)
    # 1. scheduled user profiler overlapping the doctor's window: without, then with the doctor. A first pass is
    # left out: on torch 2.11 a process's first profiled training holds a few hundred more events than the next
    # ones (PythonDispatchMode, aten::addcdiv, ...), doctor or not, and "plain" would be that first one
    for tag, out_dir in (("first", None), ("plain", None), ("doctor", out / "transformer")):
        prof, seen = user_profiler(scheduled=True)
        with prof:
            losses, _ = train(shard_blocks(transformer()), vocab, out_dir=out_dir, user_profiler=prof,
                              watch_kw={"capacity_bytes": 1 << 30}, **common)
        if tag != "first":
            res[f"losses_{tag}"] = losses
            res[f"user_events_{tag}"] = seen.events
    # 2. unscheduled user profiler around the whole loop, without and with the doctor
    for tag, out_dir in (("plain", None), ("doctor", out / "transformer_unscheduled")):
        prof, seen = user_profiler(scheduled=False)
        with prof:
            losses, _ = train(shard_blocks(transformer()), vocab, out_dir=out_dir, steps=8, **common)
        res[f"unscheduled_losses_{tag}"] = losses
        res[f"unscheduled_events_{tag}"] = seen.events
    # 3. checkpoint_wrapper instead of the functional checkpoint: ac.unneeded must fire for both
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    m = transformer(checkpoint=False)
    apply_activation_checkpointing(m, check_fn=lambda mod: mod in set(m.layers))
    train(shard_blocks(m), vocab, out_dir=out / "transformer_wrapper", steps=5, watch_kw={"capacity_bytes": 1 << 30,
                                                                                        "profile": False})
    return res


def run_compiled(out: Path) -> dict:
    res = {}
    for tag, out_dir in (("plain", None), ("doctor", out / "compiled")):
        torch._dynamo.reset()
        model = shard_blocks(compile_blocks(transformer(checkpoint=False)))
        res[f"losses_{tag}"], _ = train(model, 512, out_dir=out_dir, steps=8, clip=True,
                                        watch_kw={"profile": False})
    return res


def run_llama(out: Path) -> dict:
    res = {}
    for tag, out_dir in (("plain", None), ("doctor", out / "llama")):
        model = apply_fsdp_titan(llama(), hsdp_mesh())
        res[f"losses_{tag}"], _ = train(model, 256, out_dir=out_dir, steps=6, foreach=False,
                                        watch_kw={"profile": False, "memory": {"full_every": 1}})
        # the ignored trainable parameter: how far apart the ranks' copies are after training
        vals = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather(vals, model.out_scale.detach().clone())
        res[f"ignored_spread_{tag}"] = float(max(vals) - min(vals))
    res["param_count"] = sum(p.numel() for p in llama().parameters())
    res["grad_norms"] = grad_norms_fix_against_full_tensor(model, 256)
    return res


def grad_norms_fix_against_full_tensor(model, vocab: int) -> dict:
    """optim.step_comm's per-parameter norm fix as printed (its imports completed), run after one more backward
    on this model (the 2x2 HSDP mesh: each shard on two replicas), against the user's ``full_tensor().norm()``:
    {"compared": sharded gradients compared, "max_rel": their largest relative difference}."""
    from torch.distributed.tensor import DTensor

    from fsdp_doctor.diagnose.snippets import GRAD_NORMS_CODE, complete

    tok, tgt = batch(100, vocab, dist.get_rank())
    F.cross_entropy(model(tok).float().flatten(0, 1), tgt.flatten()).backward()
    ns = {"model": model, "step": 0}
    exec(compile(complete(GRAD_NORMS_CODE), "<optim.step_comm fix>", "exec"), ns)
    sharded = {n for n, p in model.named_parameters() if isinstance(p.grad, DTensor)}
    want = {n: v for n, v in grad_norms_per_parameter(model).items() if n in sharded}
    return {"compared": len(want),
            "max_rel": max(abs(ns["grad_norms"][n] - v) / max(v, 1e-12) for n, v in want.items())}


CLIENTS = {"transformer": run_transformer, "compiled": run_compiled, "llama": run_llama,
           "ac_prediction": lambda out: run_ac_prediction(out)}
def gpt(n_layers: int = 4):
    """The reference GPT (module names tok_emb, pos_emb, layers.N, norm, lm_head: those of the constructed
    diagnosis contexts in tests/test_diagnose_rules.py; 48 layers for the known-answer traces of 48 units)."""
    from fsdp_doctor.workloads import WorkloadConfig
    from fsdp_doctor.workloads.gpt import build_model

    torch.manual_seed(0)
    return build_model(WorkloadConfig(n_layers=n_layers, d_model=64 if n_layers <= 4 else 16, seq_len=SEQ, vocab=512))


def sequential():
    """The README's quick-start model: nn.Sequential(Embedding, 4 x TransformerEncoderLayer, Linear), its blocks the
    root's own children 1..4 (snippets over them: tests/test_diagnose_rules.py's sequential root)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(512, 64), *(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
                                                  for _ in range(4)), nn.Linear(64, 512))


def shard_gpt(model, mesh):
    from fsdp_doctor.workloads import WorkloadConfig
    from fsdp_doctor.workloads.sharding import apply_fsdp

    return apply_fsdp(model, WorkloadConfig(n_layers=4, d_model=64, seq_len=SEQ, vocab=512), mesh)


# an HF Llama large enough that a GPU, not the host, sets its step (the GPU rows of the scenario matrix)
HF_GPU = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
              max_position_embeddings=512)


def hf_llama(checkpointing: bool = False, attn: str = "sdpa", **size):
    """A Hugging Face LlamaForCausalLM from a tiny config (no download): model.model.embed_tokens,
    model.model.layers.N, model.model.norm, lm_head (untied). ``size``: LlamaConfig fields replacing the tiny
    ones; ``attn``: the attention implementation ("eager": matmul, softmax, matmul)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {**dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    max_position_embeddings=64, tie_word_embeddings=False), **size}
    cfg = LlamaConfig(num_key_value_heads=2, attn_implementation=attn, **shape)
    model = LlamaForCausalLM(cfg)
    if checkpointing:  # HF's own: each decoder layer checkpointed whole
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


#: the large-vocabulary HF Llama's (memory.temporaries' row)
BIG_VOCAB = 8192


#: compile.recompile_limit's GPU row: twice Dynamo's default recompile limit (8, torch 2.6 to 2.15) in decoder layers,
#: half of them left eager: a gain the rerun's step shows through the process-to-process spread (±7-15% on the GPU)
RECOMPILE_LAYERS = 16


def hf_llama_layers_compiled(layers: int = RECOMPILE_LAYERS):
    """An HF Llama of ``layers`` decoder layers, each compiled in place (``layer.compile()``) before the user's
    fully_shard calls, as compile.recompile_limit's new-user trial did: each layer compiles a variant of the forward
    they share (Dynamo guards on each one's KV-cache slot), and past Dynamo's recompile limit the later ones run
    eager. On a GPU GPU-sized, with torch.compile's default backend (inductor); on the CPU tiny, with aot_eager
    (inductor's C++ build of each variant takes minutes there, and changes no guard). Dynamo's caches are cleared
    first: the scenarios of a launch share a process, where its user's script starts one of its own."""
    cuda = scenario_device().type == "cuda"
    model = hf_llama(**{**(HF_GPU if cuda else {}), "num_hidden_layers": layers})
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(**({} if cuda else {"backend": "aot_eager"}))
    return model


def hf_gemma2(**size):
    """A Hugging Face Gemma2ForCausalLM from a tiny config (no download): model.model.layers.N, an embedding tied to
    lm_head, and eager attention, its default: its attention soft-caps the scores, and transformers gives it no SDPA
    (set_attn_implementation('sdpa') raises), only flex_attention and flash_attention_2. ``size``: Gemma2Config
    fields replacing the tiny ones (head_dim follows hidden_size / num_attention_heads)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    shape = {**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    max_position_embeddings=64), **size}
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=512, num_key_value_heads=2,
                                          head_dim=shape["hidden_size"] // shape["num_attention_heads"], **shape))


def hf_granite_swa(**size):
    """A Hugging Face GraniteSWAForCausalLM from a tiny config (no download): model.model.layers.N (sliding-window
    attention, every fourth layer full), a learnable attention sink per head, and eager attention, its default:
    transformers gives it no SDPA (the sinks) in every version seen (5.17, 5.24; Gemma2 gained SDPA in between),
    only flex_attention (on CUDA alone: "Attention sinks cannot be run on CPU with flex attention") and
    flash_attention_2. ``size``: GraniteSWAConfig fields replacing the tiny ones."""
    from transformers import GraniteSWAConfig, GraniteSWAForCausalLM

    torch.manual_seed(0)
    shape = {**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    max_position_embeddings=64), **size}
    return GraniteSWAForCausalLM(GraniteSWAConfig(vocab_size=512, num_key_value_heads=2, bos_token_id=None,
                                                  eos_token_id=None, pad_token_id=None, **shape))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.down(x))


class ResNet(nn.Module):
    """torchvision's layout, small: stem, layer1..layer3 (two BasicBlocks each), norm, fc."""

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        chans = [width, width, 2 * width, 4 * width]
        for i in range(1, 4):
            setattr(self, f"layer{i}", nn.Sequential(BasicBlock(chans[i - 1], chans[i], 1 if i == 1 else 2),
                                                     BasicBlock(chans[i], chans[i])))
        self.norm = nn.BatchNorm2d(chans[3])
        self.fc = nn.Linear(chans[3], classes)

    def forward(self, x):
        h = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(self.norm(h), 1).flatten(1))


def resnet():
    torch.manual_seed(0)
    return ResNet()


def resnet_checkpointed(what):
    """The ResNet with activation checkpointing applied as users do, before fully_shard (non-reentrant
    checkpoint_wrapper): on each BasicBlock's conv1, bn1, conv2, bn2 (``children``), on the blocks (``blocks``), or
    on the modules named (a list of fqns: a fix's)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing, checkpoint_wrapper)

    model = resnet()
    blocks = [m for m in model.modules() if isinstance(m, BasicBlock)]
    targets = (set(blocks) if what == "blocks" else
               {getattr(b, n) for b in blocks for n in ("conv1", "bn1", "conv2", "bn2")} if what == "children" else
               {model.get_submodule(n) for n in what})
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: m in targets)
    return model


def batch_norms_updated_twice(model) -> list[str]:
    """The batch norms whose running statistics one training step of ``model`` (a batch of two 16x16 images) updates
    twice (num_batches_tracked 2: a checkpoint's recompute runs them in training mode again), their fqns without the
    wrappers' ``_checkpoint_wrapped_module``, in module order. One process, no FSDP."""
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    return [n.replace("._checkpoint_wrapped_module", "") for n, m in model.named_modules()
            if isinstance(m, nn.BatchNorm2d) and int(m.num_batches_tracked) == 2]


# ------------------------------------------------------------------------------------------------ architectures
# (wt-arch) Hugging Face trees we had never tried, from tiny configs (no download), sharded as their users do:
# T5 (encoder-decoder: encoder.block.N and decoder.block.N, one ``shared`` embedding tied to both stacks'
# embed_tokens and to lm_head), Mixtral (mixture of experts: model.layers.N.mlp.experts, fused 3-D expert weights,
# top-2 of 4 experts per token), ViT (vit.embeddings with the patch convolution, vit.layers.N, classifier).
def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0))


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                            tie_word_embeddings=False))


def neox():
    """An HF GPT-NeoX (parallel attention and MLP residual, untied embed_in and lm_head; its layer's last child, a
    dropout, saves nothing: a non-reentrant recompute stops before it)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                            num_attention_heads=4, max_position_embeddings=64,
                                            tie_word_embeddings=False))


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=64, num_hidden_layers=3,
                                               num_attention_heads=4, intermediate_size=128, num_labels=10,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


# (wt-gpt2) GPT-2 (transformer.h.N blocks of Conv1D layers, weight (in, out); learned position embeddings wpe;
# lm_head tied to transformer.wte; ln_f) and BERT for masked language modelling (bert.encoder.layer.N, embeddings
# with their LayerNorm, the MLM head's decoder tied to the word embeddings and its bias to cls.predictions.bias;
# bidirectional attention; its config carries use_cache, which an encoder never reads)
def gpt2(vocab_size: int = 512, n_positions: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=64, n_layer=3, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def gpt2_wide():
    """GPT-2 of a new-user trial's proportions: a 2048-token vocabulary and 256 positions, so that the root (the tied
    wte/lm_head, wpe of 64 KiB, ln_f) holds half the parameters, wpe and ln_f 5.5% of them."""
    return gpt2(vocab_size=2048, n_positions=256)


def bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


MASK_ID = 1  # BERT's [MASK] in the tiny vocabulary (ids 2.. are words)


# (wt-flux) a diffusion transformer, diffusers' Flux (FluxTransformer2DModel): two block lists one after the other,
# transformer_blocks.N (double-stream: image and text tokens each their own weights, one joint attention) and
# single_transformer_blocks.N, then norm_out (adaptive, from the time and pooled-text embedding) and proj_out; its
# leading modules x_embedder, context_embedder and time_text_embed; trained with flow matching on image latents
FLUX_LATENT, FLUX_TEXT = (8, 8), 16  # latent patches (height x width) and text tokens per sample


def flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4,
                                  attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))


def flux_loss(model, g: torch.Generator, batch_size: int, device):
    """Flow matching (rectified flow), as diffusers' Flux training scripts: latents moved towards noise by a
    random time t per sample, the model predicting the velocity noise - latents."""
    (h, w), n = FLUX_LATENT, batch_size
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(h).float(), torch.arange(w).float(),
                                         indexing="ij"), -1).reshape(-1, 3)
    latents, noise = torch.randn(2, n, h * w, 16, generator=g)
    t = torch.rand(n, generator=g)
    noisy = (1 - t[:, None, None]) * latents + t[:, None, None] * noise
    text, pooled = torch.randn(n, FLUX_TEXT, 32, generator=g), torch.randn(n, 32, generator=g)
    pred = model(hidden_states=noisy.to(device), encoder_hidden_states=text.to(device),
                 pooled_projections=pooled.to(device), timestep=t.to(device), img_ids=img_ids.to(device),
                 txt_ids=torch.zeros(FLUX_TEXT, 3, device=device), return_dict=False)[0]
    return F.mse_loss(pred.float(), (noise - latents).to(device))


def shard_flux_double_only(model, mesh):
    """A Flux user's fully_shard over its double-stream blocks alone (the single-stream ones, after them, left in the
    root with the embedders and the output layers), then the root."""
    for block in model.transformer_blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# (wt-vl) a vision-language model, transformers' Qwen2.5-VL: a vision tower (model.visual: patch_embed, blocks.N, then
# merger, an nn.Sequential MLP whose children mlp.0 and mlp.2 are no blocks) before a language model
# (model.language_model: embed_tokens, layers.N, norm) and lm_head; each sample an image of 8 x 8 patches, merged 2 x 2
# into VL_IMAGE_TOKENS tokens among the text's
VL_PATCHES, VL_IMAGE_TOKENS, VL_SEQ = 64, 16, 48
VL_IMAGE, VL_START, VL_END = 1000, 1002, 1003  # token ids: the image's placeholder, its start and end


def qwen_vl(bf16: bool = False):
    """The Qwen2.5-VL tree (``bf16``: its parameters in bfloat16, as a checkpoint loaded with dtype=torch.bfloat16)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                           fullatt_block_indexes=[1, 3]),
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}),
        image_token_id=VL_IMAGE, video_token_id=1001, vision_start_token_id=VL_START, vision_end_token_id=VL_END)
    cfg._attn_implementation = "sdpa"
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    return model.to(torch.bfloat16) if bf16 else model


def qwen_vl_item(g: torch.Generator) -> dict:
    """One sample: an image (random pixels, 8 x 8 patches) and random text, its tokens the labels."""
    text = torch.randint(0, VL_IMAGE, (VL_SEQ - VL_IMAGE_TOKENS - 2,), generator=g)
    ids = torch.cat([torch.tensor([VL_START]), torch.full((VL_IMAGE_TOKENS,), VL_IMAGE), torch.tensor([VL_END]), text])
    return {"input_ids": ids, "labels": ids, "pixel_values": torch.randn(VL_PATCHES, 3 * 2 * 4 * 4, generator=g),
            "image_grid_thw": torch.tensor([[1, 8, 8]])}


def qwen_vl_collate(items: list[dict]) -> dict:
    """A batch as Qwen2.5-VL takes it: the token rows stacked, every image's patches and grid one after another."""
    return {k: (torch.cat if k in ("pixel_values", "image_grid_thw") else torch.stack)([x[k] for x in items])
            for k in items[0]}


def qwen_vl_loss(model, g: torch.Generator, batch_size: int, device):
    """The language-model loss on an image and text per sample, as a VLM's fine-tune."""
    batch = qwen_vl_collate([qwen_vl_item(g) for _ in range(batch_size)])
    return model(**{k: v.to(device) for k, v in batch.items()}).loss


def shard_qwen_vl(model, mesh, plan: str = "expert"):
    """A Qwen2.5-VL user's fully_shard calls: "expert", the language model's embedding, each vision block, the vision
    merger, each language layer, [norm, lm_head] kept gathered, the root (its patch embedding, 24 KiB, stays there);
    "lm_only", the language layers and the root (a text model's plan kept for a VLM); "tower", the vision tower whole,
    each language layer, the root."""
    vis, lm = model.model.visual, model.model.language_model
    if plan == "expert":
        fully_shard(lm.embed_tokens, mesh=mesh)
    if plan == "tower":
        fully_shard(vis, mesh=mesh)
    for block in (list(vis.blocks) if plan == "expert" else []) + list(lm.layers):
        fully_shard(block, mesh=mesh)
    if plan == "expert":
        fully_shard(vis.merger, mesh=mesh)
        fully_shard([lm.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    return fully_shard(model, mesh=mesh)


# (wt-clip) a dual encoder trained contrastively, transformers' CLIPModel: its text tower (text_model: embeddings,
# encoder.layers.N, final_layer_norm) first in module order, its vision tower (vision_model: embeddings, pre_layrnorm,
# encoder.layers.N, post_layernorm) first in its forward; the two projections and logit_scale in the root. A new-user
# trial's LiT (the vision tower frozen): the first text unit's default backward prefetch gathered the last vision
# layer in every backward, and prefetch.frozen_gathered, reading module order, said no frozen unit came before it
def clip(lit: bool = False):
    """The CLIP tree (``lit``: its vision tower and projection frozen, as locked-image tuning trains the text tower)."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, max_position_embeddings=SEQ),
                     vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, image_size=32, patch_size=8),
                     projection_dim=32)
    cfg._attn_implementation = "sdpa"
    model = CLIPModel(cfg)
    # fully_shard refuses a scalar parameter ("Change logit_scale to a 1D tensor with numel equal to 1"): as users do
    model.logit_scale = nn.Parameter(model.logit_scale.detach().reshape(1))
    if lit:
        model.vision_model.requires_grad_(False)
        model.visual_projection.requires_grad_(False)
    return model


def clip_loss(model, g: torch.Generator, batch_size: int, seq: int, device):
    """CLIP's own contrastive loss: each image of the batch against each text."""
    ids = torch.randint(0, 512, (batch_size, seq), generator=g)
    pixels = torch.randn(batch_size, 3, 32, 32, generator=g)
    return model(input_ids=ids.to(device), pixel_values=pixels.to(device), return_loss=True).loss


# (wt-albert) ALBERT for masked language modelling: one shared layer group (albert.encoder.albert_layer_groups.0)
# that its forward applies once per layer, 6 calls a pass; its MLM decoder tied to the word embeddings. A new-user
# trial: its calls read as an output head run per loss chunk, and keeping it gathered counted its backward waits alone
def albert():
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    cfg = AlbertConfig(vocab_size=512, embedding_size=32, hidden_size=64, num_hidden_layers=6, num_hidden_groups=1,
                       num_attention_heads=4, intermediate_size=128, max_position_embeddings=SEQ,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "sdpa"
    return AlbertForMaskedLM(cfg)


def _arch(model) -> str:
    return {"T5ForConditionalGeneration": "t5", "MixtralForCausalLM": "mixtral",
            "ViTForImageClassification": "vit", "GPT2LMHeadModel": "gpt2",
            "BertForMaskedLM": "bert", "GPTNeoXForCausalLM": "neox",
            "FluxTransformer2DModel": "flux", "Qwen2_5_VLForConditionalGeneration": "qwen_vl",
            "CLIPModel": "clip", "AlbertForMaskedLM": "albert"}.get(
        type(model).__name__, "")


def arch_blocks(model) -> list:
    """Every repeated block of an architecture tree, both stacks of an encoder-decoder ([] for other trees)."""
    kind = _arch(model)
    if kind == "t5":
        return list(model.encoder.block) + list(model.decoder.block)
    if kind == "vit":
        return list(model.vit.layers)
    if kind == "gpt2":
        return list(model.transformer.h)
    if kind == "bert":
        return list(model.bert.encoder.layer)
    if kind == "neox":
        return list(model.gpt_neox.layers)
    if kind == "flux":
        return list(model.transformer_blocks) + list(model.single_transformer_blocks)
    if kind == "qwen_vl":  # the vision tower's blocks, then the language model's layers
        return list(model.model.visual.blocks) + list(model.model.language_model.layers)
    if kind == "albert":  # its one layer group, which the forward applies once per layer
        return [model.albert.encoder.albert_layer_groups[0]]
    if kind == "clip":  # (in module order, the text tower's first)
        return list(model.text_model.encoder.layers) + list(model.vision_model.encoder.layers)
    return list(model.model.layers) if kind == "mixtral" else []


def arch_ends(model):
    """(leading, trailing) modules of an architecture tree as its users group them; None for other trees. T5's
    shared embedding and head are one tied parameter: they stay in the root."""
    kind = _arch(model)
    if kind == "t5":
        return [model.shared], [model.lm_head]
    if kind == "vit":
        return [model.vit.embeddings], [model.vit.layernorm, model.classifier]
    if kind == "gpt2":
        return [model.transformer.wte, model.transformer.wpe], [model.transformer.ln_f, model.lm_head]
    if kind == "bert":  # the word embeddings tied to the MLM decoder (and its bias to cls.predictions.bias) stay
        emb = model.bert.embeddings
        return [emb.position_embeddings, emb.token_type_embeddings, emb.LayerNorm], [model.cls.predictions.transform]
    if kind == "neox":
        return [model.gpt_neox.embed_in], [model.gpt_neox.final_layer_norm, model.lm_head]
    if kind == "flux":
        return [model.x_embedder, model.context_embedder, model.time_text_embed], [model.norm_out, model.proj_out]
    if kind == "qwen_vl":  # (the vision merger, between the stacks, neither)
        vis, lm = model.model.visual, model.model.language_model
        return [vis.patch_embed, lm.embed_tokens], [lm.norm, model.lm_head]
    if kind == "albert":  # (the word embeddings tied to the MLM decoder: both stay in the root)
        return [model.albert.embeddings], [model.predictions]
    if kind == "clip":  # the text embeddings (the token table); the rest of the root's own is a few KiB
        return [model.text_model.embeddings], []
    return ([model.model.embed_tokens], [model.model.norm, model.lm_head]) if kind == "mixtral" else None


def shard_moe_experts(model, mesh, inner: str = "experts"):
    """A Mixtral user's plan with each layer's ``mlp.<inner>`` a unit of its own (its experts; or its router, ``gate``,
    a 1 KiB Linear, as a new-user trial's), then the layer, the embedding, [norm, lm_head] kept gathered, the root."""
    fully_shard(model.model.embed_tokens, mesh=mesh)
    for layer in model.model.layers:
        fully_shard(getattr(layer.mlp, inner), mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    return fully_shard(model, mesh=mesh)


def shard_moe_experts_blocks_only(model, mesh):
    """The experts and the layers as units, the embedding and the head left in the root."""
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def arch_loss(model, client: str, step: int, rank: int, micro: int, size: tuple[int, int], device):
    """The user's loss on an architecture tree (None for other trees): T5 from source and target tokens (the
    decoder's inputs are the targets shifted right), ViT from images, Flux by flow matching (flux_loss), Qwen2.5-VL
    from an image and text per sample (qwen_vl_loss), CLIP contrastively over twice the batch's images and texts
    (clip_loss)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    if client.startswith("flux"):
        return flux_loss(model, g, size[0], device)
    if client.startswith("qwen_vl"):
        return qwen_vl_loss(model, g, size[0], device)
    if client.startswith("clip"):
        return clip_loss(model, g, 2 * size[0], size[1], device)
    if client.startswith("vit"):
        x, y = torch.randn(2 * size[0], 3, 16, 16, generator=g), torch.randint(0, 10, (2 * size[0],), generator=g)
        return F.cross_entropy(model(pixel_values=x.to(device)).logits, y.to(device))
    if client.startswith(("bert", "albert")):  # masked language modelling: 15% of the tokens masked, the loss on those
        tok = torch.randint(2, 512, (size[0], size[1]), generator=g)
        masked = torch.rand(size, generator=g) < 0.15
        masked[:, 0] = True  # at least one per sequence
        labels = torch.where(masked, tok, torch.full_like(tok, -100))
        logits = model(input_ids=torch.where(masked, MASK_ID, tok).to(device)).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.to(device).flatten(), ignore_index=-100)
    if client.startswith("t5"):
        src, tgt = torch.randint(1, 512, (2, size[0], size[1]), generator=g)
        logits = model(input_ids=src.to(device), labels=tgt.to(device)).logits
        return F.cross_entropy(logits.float().flatten(0, 1), tgt.to(device).flatten())
    return None


ARCH_BUILD = {"t5": t5, "mixtral": mixtral, "vit": vit, "gpt2": gpt2, "gpt2_wide": gpt2_wide, "bert": bert,
              "neox": neox, "flux": flux, "qwen_vl": qwen_vl, "clip": clip, "albert": albert}
ARCH_SHARD = {"moe_experts": shard_moe_experts, "moe_experts_blocks_only": shard_moe_experts_blocks_only,
              "moe_routers": lambda model, mesh: shard_moe_experts(model, mesh, inner="gate"),
              "flux_double_only": shard_flux_double_only, "qwen_vl_expert": shard_qwen_vl,
              "qwen_vl_lm_only": lambda model, mesh: shard_qwen_vl(model, mesh, "lm_only"),
              "qwen_vl_tower": lambda model, mesh: shard_qwen_vl(model, mesh, "tower")}
# ------------------------------------------------------------------------------------------------ (end architectures)


# ------------------------------------------------------------------------------------------------ fine-tuning trees
# (fine-tuning block: a frozen base with trainable adapters or a trainable tail, the optimizer over the trainable
# parameters only; its rows are the scenario matrix's fine-tuning block)
class LoRALinear(nn.Module):
    """A minimal LoRA adapter around a frozen Linear (peft's layout: base_layer, lora_A, lora_B; B zero-initialised,
    so the adapted model starts as the base): y = base(x) + scale * B(A(x))."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: int = 8):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=base.weight.device)
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.scale * self.lora_B(self.lora_A(x))


def hf_llama_lora(r: int = 4):
    """The HF Llama with its base frozen and LoRA adapters on every layer's q_proj and v_proj (trainable)."""
    model = hf_llama().requires_grad_(False)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj, attn.v_proj = LoRALinear(attn.q_proj, r), LoRALinear(attn.v_proj, r)
    return model


def qwen2_tail():
    """An HF Qwen2ForCausalLM from a tiny config (q/k/v biases, untied head), all but the last decoder layer and the
    head frozen."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).requires_grad_(False)
    model.model.layers[-1].requires_grad_(True)
    model.lm_head.requires_grad_(True)
    return model


FINETUNE = {"hf_llama_lora": hf_llama_lora, "qwen2_tail": qwen2_tail, "clip_lit": lambda: clip(lit=True)}
# ------------------------------------------------------------------------------------------------ (end fine-tuning)


# each client's model as built, and the user's own sharding of it (for snippets that act on the sharded model)
BUILD = {"transformer": lambda: transformer(), "compiled": lambda: compile_blocks(transformer(checkpoint=False)),
         "llama": llama, "gpt": gpt, "gpt8": lambda: gpt(8), "gpt48": lambda: gpt(48), "hf_llama": hf_llama,
         "sequential": sequential,
         "hf_llama_ckpt": lambda: hf_llama(True),
         # eager attention, GPU-sized on a GPU (tiny on the CPU, where the GPU rows only check their plumbing)
         "hf_llama_eager": lambda: hf_llama(attn="eager", **(HF_GPU if scenario_device().type == "cuda" else {})),
         "hf_gemma2": lambda: hf_gemma2(**(HF_GPU if scenario_device().type == "cuda" else {})),
         "hf_granite_swa": lambda: hf_granite_swa(**(HF_GPU if scenario_device().type == "cuda" else {})),
         "hf_llama_layers_compiled": hf_llama_layers_compiled,
         # a vocabulary 16 times the tiny one's (as a 128k one beside a 4k-wide model): the loss's logits set the peak
         # (on a GPU 4 times larger beside HF_GPU's width, 2 layers: there the logits must outweigh the blocks)
         "hf_llama_vocab": lambda: hf_llama(**({**HF_GPU, "num_hidden_layers": 2, "vocab_size": 4 * BIG_VOCAB}
                                               if scenario_device().type == "cuda" else {"vocab_size": BIG_VOCAB})),
         # the large vocabulary's embedding tied to the head: most of the parameters, in one unit with the final norm
         "hf_llama_tied_vocab": lambda: hf_llama(vocab_size=BIG_VOCAB, tie_word_embeddings=True),
         # eager attention over long sequences: its score matrices set the peak
         "hf_llama_eager_long": lambda: hf_llama(attn="eager", max_position_embeddings=512),
         "titan": lambda: llama(out_scale=False),
         "resnet": resnet, "resnet_ckpt_children": lambda: resnet_checkpointed("children"),
         "resnet_ckpt_blocks": lambda: resnet_checkpointed("blocks"), **ARCH_BUILD, **FINETUNE}


def _blocks(model):
    """Every repeated block of the model, as its user wraps them."""
    if blocks := arch_blocks(model):
        return blocks
    if isinstance(model, ResNet):
        return [b for i in range(1, 4) for b in getattr(model, f"layer{i}")]
    layers = model.model.layers if hasattr(model, "model") else model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def shard_blocks_only(model, mesh):
    """The blocks and the root: embeddings, final norm and head stay in the root."""
    for b in _blocks(model):
        fully_shard(b, mesh=mesh)
    return fully_shard(model, mesh=mesh)


SHARD = {"transformer": shard_blocks, "compiled": shard_blocks, "llama": lambda m, mesh: apply_fsdp_titan(m, mesh),
         "gpt": shard_gpt, "gpt8": shard_blocks_only, "gpt48": shard_blocks_only, "hf_llama": shard_blocks_only,
         "hf_llama_ckpt": shard_blocks_only, "hf_llama_vocab": shard_blocks_only,
         "hf_llama_eager_long": shard_blocks_only, "sequential": lambda m, mesh: fully_shard(m, mesh=mesh),  # (whole)
         "resnet": shard_blocks_only, "resnet_ckpt_children": shard_blocks_only, "resnet_ckpt_blocks": shard_blocks_only,
         **{name: shard_blocks_only for name in FINETUNE}}
VOCAB = {"transformer": 512, "compiled": 512, "llama": 256, "gpt": 512, "gpt8": 512, "gpt48": 512, "hf_llama": 512,
         "sequential": 512,
         "hf_llama_ckpt": 512, "hf_llama_eager": 512, "hf_gemma2": 512, "hf_granite_swa": 512, "titan": 256, "mixtral": 512, "gpt2": 512, "gpt2_wide": 2048, "neox": 512,
         "hf_llama_layers_compiled": 512, "hf_llama_vocab": BIG_VOCAB, "hf_llama_eager_long": 512,
         "hf_llama_tied_vocab": BIG_VOCAB,
         **{name: 512 for name in FINETUNE}}


def loss_of(model, client: str, step: int, rank: int, micro: int = 0, size: tuple[int, int] = (BATCH, SEQ),
            device=None, keep: dict | None = None, labels: bool = False):
    """The user's loss on a deterministic batch (``size``: sequences, tokens) of this step, rank and micro-batch,
    drawn on the CPU and moved to ``device`` (None: left there); ``keep``: the loop keeps what the model returned
    there, as ``keep["outputs"]``; ``labels``: a Hugging Face model computes the loss in its own forward
    (``model(input_ids=..., labels=...).loss``, as the HF examples and the Trainer do)."""
    if (loss := arch_loss(model, client, step, rank, micro, size, device)) is not None:
        return loss
    if client.startswith("resnet"):
        g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
        x, y = torch.randn(2 * size[0], 3, 16, 16, generator=g), torch.randint(0, 10, (2 * size[0],), generator=g)
        return F.cross_entropy(model(x.to(device)), y.to(device))
    tok, tgt = batch(step, VOCAB[client], rank, micro, size)
    if labels:  # (HF shifts the labels itself: the inputs are the labels)
        return model(input_ids=tok.to(device), labels=tok.to(device)).loss
    out = model(tok.to(device))
    logits = out.logits if hasattr(out, "logits") else out
    if keep is not None:
        keep["outputs"] = out
    return F.cross_entropy(logits.float().flatten(0, 1), tgt.to(device).flatten())


def shard_head_in_root(model, mesh):
    """The leading modules one unit, each block, the root: the final norm and head stay in the root."""
    lead, _ = _ends(model)
    fully_shard(lead if len(lead) > 1 else lead[0], mesh=mesh)
    for b in _blocks(model):
        fully_shard(b, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def shard_tied_ends(model, mesh):
    """Each block, then its ends in one unit (the tied embedding and head must share one) kept gathered after
    forward (it computes last in forward and first in backward), then the root: accelerate's FSDP2 plugin's grouping
    of a tied Qwen2 (model.norm, model.embed_tokens, lm_head)."""
    lead, trail = _ends(model)
    for b in _blocks(model):
        fully_shard(b, mesh=mesh)
    fully_shard(trail + lead, mesh=mesh, reshard_after_forward=False)
    return fully_shard(model, mesh=mesh)


def shard_no_root(model, mesh):
    """The blocks only: fully_shard never applied to the root."""
    for b in _blocks(model):
        fully_shard(b, mesh=mesh)
    return model


def shard_expert(model, mesh):
    """The expert plan of the scenario matrix's rows (``shard_tree`` with the workload's defaults): the leading
    modules one unit, each block, the trailing ones one unit kept gathered after forward, the root."""
    from fsdp_doctor.workloads import WorkloadConfig

    return shard_tree(model, WorkloadConfig(), mesh)


# the sharding a finding is emitted for, where it is not the client's usual one (prefetch.frozen_gathered's known
# answers are the expert plan's units: the head's own unit among them)
SHARD_FOR = {"wrap.root_not_sharded": shard_no_root, "prefetch.frozen_gathered": shard_expert}


# ------------------------------------------------------------------------------------------------ scenarios
def _ends(model) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules before the blocks (embeddings, stem) and after them (final norm, head), as a user groups them."""
    if (ends := arch_ends(model)) is not None:
        return ends
    if isinstance(model, ResNet):
        return [model.stem], [model.norm, model.fc]
    if hasattr(model, "lm_head") and hasattr(model, "model"):  # Hugging Face
        return [model.model.embed_tokens], [model.model.norm, model.lm_head]
    if isinstance(model, Llama):  # torchtitan's llama
        return [model.tok_embeddings], [model.norm, model.output]
    if hasattr(model, "tok_emb"):  # the reference GPT
        return [model.tok_emb, model.pos_emb], [model.norm, model.lm_head]
    return [model.tok_embeddings, model.pos_embeddings], [model.norm, model.output]  # torch's Transformer


def _tied(a: list[nn.Module], b: list[nn.Module]) -> bool:
    """Whether a module of ``a`` shares a parameter with one of ``b``."""
    ids = {id(p) for m in a for p in m.parameters()}
    return any(id(p) in ids for m in b for p in m.parameters())


def checkpoint_blocks(model, how: str):
    """The user's activation checkpointing: "block" (each block, checkpoint_wrapper; HF's own
    gradient_checkpointing_enable() on an HF model) or "children" (each child of a block that holds parameters)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if how == "block" and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    if how == "block" and hasattr(model, "enable_gradient_checkpointing"):  # diffusers' (each block, non-reentrant)
        model.enable_gradient_checkpointing()
        return model
    blocks = {id(b) for b in _blocks(model)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (id(child) in blocks if how == "block" else
                    id(parent) in blocks and any(True for _ in child.parameters())):
                setattr(parent, name, checkpoint_wrapper(child))
    return model


def shard_tree(model, cfg, mesh):
    """The user's fully_shard calls on any tree, per the workload knobs (``cfg``: wrap, reshard_after_forward,
    param/reduce dtype, explicit prefetch depths): "block" is the tuned plan (the leading modules one unit, each
    block, the trailing ones one unit kept gathered after forward, the root), "blocks_only", "no_root", "whole"."""
    from fsdp_doctor.workloads.sharding import mixed_precision_policy

    kw = {"mesh": mesh}
    if (mp := mixed_precision_policy(cfg)) is not None:
        kw["mp_policy"] = mp
    raf = {} if cfg.reshard_after_forward is None else {"reshard_after_forward": cfg.reshard_after_forward}
    if cfg.wrap == "whole":
        return fully_shard(model, **kw)
    if cfg.wrap == "leaf":  # every module holding parameters of its own (Linear, Conv1D, norm, embedding) a unit
        own = {m: [id(p) for p in m.parameters(recurse=False)] for m in model.modules() if m is not model}
        held = Counter(i for ids in own.values() for i in ids)
        for m, ids in own.items():
            if ids and all(held[i] == 1 for i in ids):  # tied ones stay together in the root
                fully_shard(m, **kw, **raf)
        return fully_shard(model, **kw)
    lead, trail = _ends(model) if cfg.wrap == "block" else ([], [])
    tied = [m for m in lead + trail if _tied([m], [x for x in lead + trail if x is not m])]
    lead, trail = [m for m in lead if m not in tied], [m for m in trail if m not in tied]  # tied: stay in the root
    if lead:
        fully_shard(lead if len(lead) > 1 else lead[0], **kw, **raf)
    for b in _blocks(model):
        fully_shard(b, **kw, **raf)
    if trail:  # kept gathered after forward unless the knob says
        fully_shard(trail, **kw, reshard_after_forward=bool(cfg.reshard_after_forward))
    blocks = _blocks(model)
    for i, b in enumerate(blocks):  # explicit prefetch over the blocks, torchtitan's way
        if cfg.forward_prefetch:
            b.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + cfg.forward_prefetch])
        if cfg.backward_prefetch:
            b.set_modules_to_backward_prefetch(blocks[max(0, i - cfg.backward_prefetch):i][::-1])
    return model if cfg.wrap == "no_root" else fully_shard(model, **kw)


def _shard(model, tree: str, cfg, mesh, fix: dict):
    """The user's sharding of ``model``, or the fix that replaces it; then the user's settings after it."""
    from fsdp_doctor.workloads.sharding import apply_activation_checkpointing, apply_fsdp

    if fix.get("where") in ("unsharded", "before_shard"):  # pasted after the user's own checkpointing, before any
        # fully_shard
        if tree == "gpt":
            apply_activation_checkpointing(model, cfg)
        elif cfg.ac != "none":
            checkpoint_blocks(model, cfg.ac)
        model = _exec(fix, model, None)[0]
        if "fully_shard(" in fix["code"]:  # in place of the user's fully_shard calls
            return _after_sharding(model, cfg)
        # a checkpointing fix (it undoes or replaces the user's checkpointing, applied above): the sharding follows
        cfg = cfg.replace(ac="none")
    if tree == "gpt":
        return apply_fsdp(model, cfg, mesh)  # the reference workload's own sharding (ac, prefetch, async)
    if cfg.ac != "none":
        checkpoint_blocks(model, cfg.ac)
    model = USER_SHARD[shard](model, mesh) if (shard := fix.get("user_shard")) else shard_tree(model, cfg, mesh)
    return _after_sharding(model, cfg)


def _after_sharding(model, cfg):
    """The user's lines after the fully_shard calls: async unshard on gloo."""
    from fsdp_doctor.workloads.sharding import set_unshard_async

    if cfg.async_unshard:
        set_unshard_async(model)
    return model


# the user's own sharding code where the workload knobs do not say it: torchtitan's plan (with a trainable
# parameter ignored)
USER_SHARD = {"titan": apply_fsdp_titan, "head_in_root": shard_head_in_root, "tied_ends": shard_tied_ends,
              **ARCH_SHARD}


def user_param_groups(model, trainable_only: bool = False, top_only: bool = False) -> list[dict]:
    """The user's optimizer groups, as Hugging Face's Trainer and nanoGPT make them: weight decay on matrices,
    none on biases, norms and other 1-D parameters (a fine-tuner's: the trainable parameters only; ``top_only``: the
    last block's and those after it, the rest left with requires_grad=True, as a loop that fine-tunes the top by
    building its optimizer over it does)."""
    ps = [p for p in model.parameters() if p.requires_grad or not trainable_only]
    if top_only:
        last = {id(p) for p in _blocks(model)[-1].parameters()}
        ps = ps[next(i for i, p in enumerate(ps) if id(p) in last):]
    groups = [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def module_tree(fqns) -> nn.Module:
    """A bare module tree holding exactly the modules ``fqns`` (and their parents), children in the order given."""
    root = nn.Module()
    for fqn in fqns:
        m = root
        for part in fqn.split("."):
            if part not in m._modules:
                m.add_module(part, nn.Module())
            m = m._modules[part]
    return root


def prefetch_chain(code: str, model: nn.Module) -> dict[tuple[str, str], list[str]]:
    """A prefetch snippet run on an unsharded ``model`` whose modules record what it sets:
    {("forward" | "backward", module fqn): [the fqns of the modules it prefetches]}."""
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[tuple[str, str], list[str]] = {}
    for n, m in model.named_modules():
        for kind in ("forward", "backward"):  # an FSDPModule's setters, recorded
            m.__dict__[f"set_modules_to_{kind}_prefetch"] = (
                lambda mods, key=(kind, n): out.__setitem__(key, [names[id(x)] for x in mods]))
    exec(compile(code, "<prefetch>", "exec"), {"model": model})
    return out


def _exec(fix: dict, model, opt, ns: dict | None = None, **inputs):
    """The fix's code run where its user pastes it: ``model`` and ``optimizer`` in scope, and in the loop the
    names the fix reads from it (``Recommendation.inputs``); ``ns``: the names of the script so far (a two-part
    fix's second part reads what its first defined)."""
    missing = set(fix.get("inputs") or {}) - set(inputs)
    assert not missing, f"the loop does not provide {sorted(missing)}"
    ns = ns if ns is not None else {}
    ns.update(model=model, optimizer=opt, **inputs)
    exec(compile(fix["code"], f"<{fix.get('finding', 'fix')}>", "exec"), ns)
    return ns["model"], ns["optimizer"]


def train_scenario(row: dict) -> tuple[list[float], float]:
    """One scenario: the tree built, the user's code (workload knobs: sharding, checkpointing, mixed precision,
    optimizer order, accumulation, zero_grad, faults) with the fix pasted where ``fix["where"]`` says, trained
    under watch(). Returns the losses and the replicas' drift (``replica_drift``)."""
    import gc
    import time

    from fsdp_doctor.workloads import WorkloadConfig
    from fsdp_doctor.workloads.train import autocast, inject_step_faults, release_objects

    # the scenario trained before this one in the process left its model and optimizer in reference cycles
    # (FSDP's hooks): collected now, not counted in this one's memory (the GPU campaign's rows carried the previous
    # row's parameters and optimizer state, up to 153 MiB, through their steps 0-3, until the collection after the
    # profiler window: every peak and timeline of those steps holds them). What survives lives as long as the
    # process (its imports: torch, transformers, accelerate) and is frozen out of the collector's view: each full
    # collection then walks one scenario's objects, not the whole heap again (0.22 s each on this 2-core host, 24 s
    # of the matrix's 111 before-runs and probes per rank)
    gc.collect()
    gc.freeze()
    dev = scenario_device()
    # Dynamo's recompile limits as they are: a fix that raises them (compile.recompile_limit's) is this scenario's
    # alone, not the next one's in the same process
    from torch._dynamo import config as dynamo_config

    from fsdp_doctor.record.fsdp2 import dynamo_limits

    limits = dynamo_limits()
    tree, cfg = row["tree"], WorkloadConfig(**row.get("knobs", {}), device=dev.type)
    fix = row.get("fix") or {}
    rank = dist.get_rank()
    shape = tuple(row.get("mesh") or (dist.get_world_size(),))  # HSDP: replicate over the first dimension
    mesh = init_device_mesh(dev.type, shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    if tree == "gpt":  # the reference workload's model, of the knobs' shape, on cfg.device
        from fsdp_doctor.workloads.gpt import build_model

        model = build_model(cfg)
    else:
        model = BUILD[tree]().to(dev)
    # AdamW for-each, as torch picks it on a GPU (on the CPU its default steps one DTensor at a time: 23 ms a step
    # of the reference GPT against 7 ms), unless plain tensors sit beside DTensors (the root left unsharded, an
    # ignored parameter), which for-each refuses; or as torch picks it here ("default_optimizer")
    make_opt = lambda m: torch.optim.AdamW(  # noqa: E731
        user_param_groups(m, trainable_only=tree in FINETUNE, top_only=row.get("loop") == "top_optimizer"),
        lr=1e-3, **({"fused": True} if row.get("loop") == "fused_optimizer" else {} if row.get("loop") ==
                    "default_optimizer" else {"foreach": len({isinstance(p, DTensor) for p in m.parameters()}) == 1}))
    early = make_opt(model) if cfg.optimizer_before_shard else None
    ns = {}
    if fix.get("where") == "around":  # its first part before the user's fully_shard calls, the rest after them
        before, after = fix["code"].split(SHARDING_GOES_HERE)
        model, early = _exec({**fix, "code": before}, model, early, ns=ns)
        fix = {**fix, "code": after, "where": "sharded"}
    model = _shard(model, tree, cfg, mesh, {**fix, "user_shard": row.get("user_shard")})
    # after the fully_shard calls (or accelerator.prepare, which made them), before the optimizer (unless built before)
    # (a fix for the model as built and wrapped, not for its sharding, "model": compile.recompile_limit's Dynamo
    # settings, there before the first forward compiles)
    if fix.get("where") in ("sharded", "prepared", "parallelized", "model"):
        model, early = _exec(fix, model, early, ns=ns)
    opt = early or make_opt(model)
    script: dict = {}  # the names the fix defines in the user's script (a function its loop calls)
    if fix.get("where") == "optimizer":
        model, opt = _exec(fix, model, opt, ns=script)
    losses = []
    held: dict = {}  # what the user's loop keeps between steps (row["loop"])
    watch = dict(row.get("watch", {}))
    if not tree.startswith(("resnet", "vit", "flux")):  # tokens per optimizer step, all ranks (throughput, FLOPs)
        watch.setdefault("tokens_per_step", cfg.batch_size * cfg.seq_len * cfg.grad_accum * dist.get_world_size())
    if isinstance(watch.get("profile"), dict):  # a window (JSON spec): ProfileSchedule's fields
        watch["profile"] = fsdp_doctor.ProfileSchedule(**watch["profile"])
    try:
        with fsdp_doctor.watch(model, opt, out_dir=row["out_dir"], overwrite=True, **watch) as doctor:
            for step in range(cfg.steps):
                inject_step_faults(cfg, rank, step)
                time.sleep(cfg.loader_ms / 1000)  # the user's slow loader
                if step == ALLOC_LIMIT_AFTER and row.get("alloc_limit") and dev.type == "cuda":
                    limit_allocator(dev, row["alloc_limit"])
                seq = seq_len_at(cfg.seq_len, step) if row.get("loop") == "varying_lengths" else cfg.seq_len
                total = 0.0
                for micro in range(cfg.grad_accum):
                    last = micro == cfg.grad_accum - 1
                    if cfg.grad_accum > 1 and cfg.accum_no_sync:
                        model.set_requires_gradient_sync(last)
                    elif row.get("loop") == "sync_off":  # accumulation's switch, never turned back on
                        model.set_requires_gradient_sync(False)
                    if fix.get("where") == "loop":
                        _exec(fix, model, opt, is_last_micro_batch=last, micro_batch=micro,
                              micro_batches=cfg.grad_accum, step=step)
                    with autocast(cfg):
                        loss = loss_of(model, tree, step, rank, micro, (cfg.batch_size, seq), dev,
                                       keep=held if row.get("loop") in ("keep_outputs", "keep_all_outputs") else None,
                                       labels=row.get("loop") == "labels") / cfg.grad_accum
                    if row.get("loop") == "keep_all_outputs":  # every step's logits kept for a metric, on the device
                        held.setdefault("all", []).append(held.pop("outputs").detach())
                    if fix.get("where") == "backward":
                        _exec(fix, model, opt, ns=held, outputs=held.get("outputs"))
                    loss.backward()
                    total += loss.item()
                if row.get("loop") == "grad_norm_log":  # the user's per-parameter gradient-norm log, every step
                    if fix.get("where") == "after_backward":
                        _exec(fix, model, opt, ns=held, step=step)
                    else:
                        held["grad_norms"] = grad_norms_per_parameter(model)
                opt.step()
                if "collect_between_steps" in script:  # jitter.gc's fix: "call after optimizer.step()", as it says
                    script["collect_between_steps"](step)
                opt.zero_grad(set_to_none=cfg.zero_grad_to_none)
                if row.get("loop") == "loss_allreduce":  # the loss averaged over the ranks for a log line, every step
                    logged = torch.tensor([total], device=dev)
                    dist.all_reduce(logged)  # synchronous: since torch 2.8 on the current (compute) stream
                    total = logged.item() / dist.get_world_size()
                doctor.step()
                losses.append(total)
                # the user's evaluation after every EVAL_EVERY-th step: generation (one sequence, a pass per token)
                # or evaluation in eval mode that forgot torch.no_grad(); a fix for it runs around it
                evaluation = {"generate": (generate_passes, (1, cfg.seq_len)),
                              "eval_autograd": (evaluate_in_eval_mode, (cfg.batch_size, cfg.seq_len)),
                              }.get(row.get("loop"))
                if evaluation and step % EVAL_EVERY == EVAL_EVERY - 1:
                    evaluate = partial(evaluation[0], model, tree, step, rank, evaluation[1], dev)
                    if fix.get("where") == "evaluation":
                        _exec(fix, model, opt, evaluate=evaluate)
                    else:
                        evaluate()
    finally:  # jitter.gc's fix freezes and disables the collector: the next scenario starts as the user would
        if "gc.freeze" in (row.get("fix") or {}).get("code", ""):  # this scenario's model among the frozen
            gc.unfreeze()
        gc.enable()
        release_objects()  # (the gc_heap knob's)
        if row.get("alloc_limit") and dev.type == "cuda":  # the next scenario has the whole device
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
        for name, value in limits.items():
            setattr(dynamo_config, name, value)
    return losses, replica_drift(model)


# the "varying_lengths" loop: each step's sequence length, a fraction of the row's seq_len (the first two steps at the
# longest: step 1's peak, the first with optimizer state, is the longest step's)
VARYING_LENGTHS = (1.0, 1.0, 0.5, 1.0, 0.125, 0.75, 1.0, 0.25, 1.0, 0.5, 0.375, 1.0)
ALLOC_LIMIT_AFTER = 2  # the step from which a row's alloc_limit caps the allocator


def seq_len_at(seq_len: int, step: int) -> int:
    return max(8, int(seq_len * VARYING_LENGTHS[step % len(VARYING_LENGTHS)]))


def limit_allocator(dev: torch.device, share: float) -> None:
    """Caps this process's CUDA caching allocator at ``share`` times the highest allocation so far (the longest
    step's peak): a device that the run nearly fills, as a larger model would, on the GPU machine's 80 GB
    (memory.alloc_retries' GPU row)."""
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, share * torch.cuda.max_memory_allocated(dev) / total), dev)


def grad_norms_per_parameter(model) -> dict[str, float]:
    """The user's gradient-norm log as often written (tests/scenario_matrix.py, loop "grad_norm_log"): each
    parameter's whole gradient gathered (``full_tensor()``: one all-gather per sharded parameter) for its norm."""
    from torch.distributed.tensor import DTensor

    return {n: float((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).norm())
            for n, p in model.named_parameters() if p.grad is not None}


EVAL_EVERY = 3  # the "eval_autograd" loop evaluates after every third step, on EVAL_BATCHES batches
EVAL_BATCHES = 2


def evaluate_in_eval_mode(model, tree: str, step: int, rank: int, size: tuple[int, int], dev) -> float:
    """The user's evaluation as written without torch.no_grad(): the model in eval mode, losses read, no backward
    (tests/scenario_matrix.py, loop "eval_autograd"); under the fix's ``with torch.no_grad():`` the same code."""
    model.eval()
    try:
        return sum(loss_of(model, tree, 10_000 + step, rank, i, size, dev).item() for i in range(EVAL_BATCHES))
    finally:
        model.train()


GEN_PASSES = 8  # the "generate" loop's forward passes per generation


def generate_passes(model, tree: str, step: int, rank: int, size: tuple[int, int], dev) -> None:
    """The user's generation after every third step (tests/scenario_matrix.py, loop "generate"): one forward pass
    without gradients per new token, GEN_PASSES of them on one sequence (no KV cache: each pass the whole
    sequence), every unit gathered for each."""
    with torch.no_grad():
        for i in range(GEN_PASSES):
            loss_of(model, tree, 20_000 + step, rank, i, size, dev)


def replica_drift(model) -> float:
    """How far apart the ranks' copies of the trainable parameters FSDP does not manage are (max - min over
    ranks of their sum); 0 when there are none."""
    from torch.distributed.tensor import DTensor

    own = [p.detach().float().sum() for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if not own:
        return 0.0
    total = torch.stack([x.to(scenario_device()) for x in own]).sum()  # NCCL gathers device tensors
    vals = [torch.zeros((), device=total.device) for _ in range(dist.get_world_size())]
    dist.all_gather(vals, total)
    return float(max(vals) - min(vals))


def _probe_peak(row: dict) -> int:
    """The scenario's peak memory (bytes, the peak rank's), trained once as given."""
    train_scenario(row)
    dist.barrier()  # every rank's records written
    return int(fsdp_doctor.build_report(fsdp_doctor.load_run(row["out_dir"])).memory.peak_bytes)


def run_scenarios(spec_path: Path) -> dict:
    """Trains each scenario of the spec in turn on this process group ([{tree, knobs, watch, out_dir, fix}, ...],
    tests/scenario_matrix.py); one failing scenario is reported, the others still run."""
    out = {}
    for row in json.loads(Path(spec_path).read_text()):
        try:
            if share := row.get("capacity_share"):  # a budget just above the peak: measured by a first run
                peak = _probe_peak({**row, "out_dir": row["out_dir"] + "_probe", "fix": None})
                row.setdefault("watch", {})["capacity_bytes"] = int(peak / share)
            losses, drift = train_scenario(row)
            out[row["name"]] = {"losses": losses, "replica_drift": drift,
                                "capacity_bytes": row.get("watch", {}).get("capacity_bytes"),
                                # the allocator's settings the row ran under (a startup fix sets them)
                                "alloc_conf": alloc_conf(torch.device("cuda"))}  # as a CUDA run records them
        except Exception as e:  # noqa: BLE001 - reported per scenario
            import traceback

            out[row["name"]] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300],
                                "traceback": traceback.format_exc()[-3000:]}
    return out


AC_WATCH = {"profile": False, "memory": {"full_every": 1}, "capacity_bytes": 8 << 30}  # ample: ac.unneeded's case
AC_STEPS = 4


def run_ac_prediction(out: Path) -> dict:
    """The ResNet with its blocks' children checkpointed and with its blocks checkpointed (tests/test_ac_prediction.py),
    each trained with the doctor (every step's memory measured, recompute included) into ``out/<client>`` and
    without it: {client: {"losses", "identical": losses and final parameter shards bit-identical}}."""
    from contextlib import nullcontext

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    res = {}
    for client in ("resnet_ckpt_children", "resnet_ckpt_blocks"):
        got = []
        for watched in (True, False):
            model = shard_blocks_only(BUILD[client](), mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses = []
            with (fsdp_doctor.watch(model, opt, out_dir=str(out / client), **AC_WATCH) if watched
                  else nullcontext()) as doctor:
                for step in range(AC_STEPS):
                    loss = loss_of(model, client, step, dist.get_rank())
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    if doctor is not None:
                        doctor.step()
                    losses.append(loss.item())
            got.append((losses, [p.to_local().detach().clone() for p in model.parameters()]))
        (a, pa), (b, pb) = got
        res[client] = {"losses": a, "identical": a == b and all(torch.equal(x, y) for x, y in zip(pa, pb))}
    return res


#: a value for each name a loop fix reads from the user's loop (Recommendation.inputs), as the loop's first step
#: (the runner trains one step of one micro-batch: it is the last)
def _shard_dim1(p):
    """A user's shard_placement_fn (Recommendation.inputs: a plan passes the run's own again): 2-D parameters on
    dim 1."""
    from torch.distributed.tensor import Shard

    return Shard(1) if p.ndim == 2 else Shard(0)


LOOP_VALUES = {"step": 0, "is_last_micro_batch": True, "shard_placement_fn": _shard_dim1}


def _plugin_sharded(model, code: str, mesh, finding_code: str):
    """``code`` run on the Trainer's (``trainer.accelerator``) or the user's Accelerator's FSDP2 plugin, accelerate's
    own, which then shards ``model`` as accelerate's FSDP2 prepare() does: its auto-wrap policy over the modules
    bottom up, the root last, with its offload and mixed-precision policies (accelerate checks the policy and finds
    each class the snippet names in the model)."""
    from types import SimpleNamespace

    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import get_module_children_bottom_up
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    holder = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    exec(compile(code, f"<{finding_code} fix>", "exec"),  # (the user's model exists before prepare() shards it)
         {"accelerator": holder, "model": model, "trainer": SimpleNamespace(accelerator=holder, model=model)})
    plugin.validate_cpu_offload()
    plugin.set_auto_wrap_policy(model)
    kw = dict(mesh=mesh, reshard_after_forward=plugin.reshard_after_forward, offload_policy=plugin.cpu_offload,
              mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    for m in get_module_children_bottom_up(model)[:-1] if policy is not None else []:
        if policy(m):
            fully_shard(m, **kw)
    return fully_shard(model, **kw)


def run_snippets(spec_path: Path) -> dict:
    """Executes every fix snippet on a fresh copy of the model it was emitted for (1 rank, on the scenarios'
    device), placed as its Recommendation says (``where``: a fix after the backward runs where gradients exist;
    ``inputs``: the loop's names it reads, from LOOP_VALUES), then trains one step of the result; a snippet that
    pins host memory must leave the parameters FSDP offloads pinned. Returns {"results": [[client, code, "ok" |
    error line], ...]}."""
    from torch.distributed.fsdp import FSDPModule

    spec = json.loads(Path(spec_path).read_text())
    dev = scenario_device()
    mesh = init_device_mesh(dev.type, (1,))
    out = []
    # torch.compile in a snippet (kernels.launch_bound, verdict.severe) traces the FSDP blocks with dynamo and
    # AOTAutograd as on a GPU; inductor's C++ code generation for this CPU would take a minute and say nothing
    # about the snippet, so the graphs run through aot_eager here
    compile_ = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, *a, **kw: compile_(self, *a, **{"backend": "aot_eager", **kw})
    for client, finding_code, snippet, where, inputs in spec:
        if "pin_memory=True" in snippet and not torch.accelerator.is_available():  # CPUOffloadPolicy runs here
            out.append([client, finding_code, "skipped: pinned host memory needs an accelerator"])
            continue
        if where == "trl_reference":  # a reference model built from the policy's checkpoint, for a TRL trainer
            out.append([client, finding_code, "skipped: run in a TRL DPOTrainer by tests/test_trl.py"])
            continue
        try:
            model = BUILD[client]().to(dev)
            ns, code = {}, snippet
            if SHARDING_GOES_HERE in snippet:  # two parts around the user's fully_shard calls: the optimizer built
                before, code = snippet.split(SHARDING_GOES_HERE)  # before them, as the finding found it
                ns = {"model": model, "optimizer": torch.optim.AdamW(user_param_groups(model), lr=1e-3)}
                exec(compile(before, f"<{finding_code} fix, before sharding>", "exec"), ns)
            if where in PLUGIN_INPUTS:  # a setting of accelerate's FSDP2 plugin: it shards the model as prepare()
                model = _plugin_sharded(model, code, mesh, finding_code)
                loss_of(model, client, 0, 0, device=dev).backward()
                out.append([client, finding_code, "ok"])
                continue
            if BEFORE_SHARDING not in snippet:  # a snippet for the sharded model; the others say where they go
                model = SHARD_FOR.get(finding_code, SHARD[client])(model, mesh)
            # only what watch(model, optimizer) was given: a snippet defines (imports) everything else it uses
            ns.setdefault("optimizer", torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
            ns["model"] = model
            if where == "after_backward":  # optim.step_comm's: it reads the gradients
                loss_of(model, client, 0, 0, device=dev).backward()
            if "evaluate" in inputs:  # the user's evaluation: a forward pass without a backward after it
                ns["evaluate"] = partial(loss_of, model, client, 0, 0, device=dev)
            ns.update((name, LOOP_VALUES[name]) for name in inputs if name != "evaluate")  # (none: a KeyError)
            exec(compile(code, f"<{finding_code} fix>", "exec"), ns)
            model, opt = ns["model"], ns["optimizer"]
            if SHARDING_GOES_HERE in snippet:
                own = {id(p) for p in model.parameters()}
                assert all(id(p) in own for g in opt.param_groups for p in g["params"]), \
                    "the optimizer holds tensors that are not the model's parameters"
            if not isinstance(model, FSDPModule):
                fully_shard(model, mesh=mesh)  # a snippet that only prepares the model: the user shards next
            if "pin_memory=True" in snippet:
                host = [p.to_local() for p in model.parameters() if p.to_local().device.type == "cpu"]
                assert host and all(t.is_pinned() for t in host), "offloaded parameters not in pinned host memory"
            loss_of(model, client, 0, 0, device=dev).backward()
            out.append([client, finding_code, "ok"])
        except Exception as e:  # noqa: BLE001 - reported per snippet
            out.append([client, finding_code, f"{type(e).__name__}: {e}".splitlines()[0][:300]])
        finally:  # jitter.gc's fix freezes and disables the collector: the next snippet starts as the user would
            import gc

            gc.unfreeze()
            gc.enable()
    return {"results": out}


def main(argv: list[str], clients: dict | None = None) -> int:
    """One rank: ``clients`` (default CLIENTS; tests/recorder_cases.py passes its cases) names what to run."""
    client, rank, world, port, out = argv[0], int(argv[1]), int(argv[2]), argv[3], Path(argv[4])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if client == "scenarios":  # fixes for the top of the user's script, pasted before anything touches the device
        for row in json.loads(out.read_text()):
            fix = row.get("fix") or {}
            if fix.get("where") == "startup":
                exec(compile(fix["code"], f"<{fix.get('finding')} fix, at startup>", "exec"), {})
    torch.set_num_threads(1)
    dev = scenario_device()  # (the CPU unless the launcher asked for CUDA: _launch(..., device="cuda"))
    if dev.type == "cuda":  # NCCL on this rank's GPU (set before the group: device_id binds the communicator)
        from fsdp_doctor.workloads import WorkloadConfig
        from fsdp_doctor.workloads.train import backend_for, setup_rank

        setup_rank(WorkloadConfig(device="cuda"), dev.index)
        dist.init_process_group(backend_for("cuda"), rank=rank, world_size=world, device_id=dev)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = (run_snippets(out) if client == "snippets" else run_scenarios(out) if client == "scenarios"
               else (clients or CLIENTS)[client](out))
        # every rank done before any leaves: a rank that exits while the other is still connecting a group its
        # library builds (OLMo-core's Trainer's new_group) reset the other's gloo handshake ("Connection reset by
        # peer", two CI runs of the long tier)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
