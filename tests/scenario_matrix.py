"""The scenario matrix: one table of model trees x the user's code with one planted problem x the finding expected,
plus a tuned baseline per tree (no warning expected), and the one runner that trains them and applies each fix.

A row's user code is the reference workload's knobs (fsdp_doctor/workloads/config.py: sharding, checkpointing,
mixed precision, optimizer order, accumulation, zero_grad, faults) applied to its tree by tests/clients.py
``train_scenario``; ``watch`` holds watch() options (a capacity), ``capacity_share`` a budget just above the
row's own measured peak. Every row's before-run (the user's unmodified code) is trained in one launch of 2 gloo
ranks; every fix is then pasted where its ``Recommendation.where`` says, in a second launch (fresh processes), and
rechecked: the finding gone (or its figure improved by at least half the prediction), no new warning, the peak
within 10% of the predicted one. tests/test_scenario_matrix.py asserts it; benchmarks/scenarios.py prints the
finding-by-scenario table from the same rows and runner.

``GPU_ROWS`` (flagged ``gpu``) plant the problems of the rules that read a GPU trace or need a GPU (offload, eager
attention, small collectives, exposed all-gathers, launch-bound steps, layers left eager at Dynamo's recompile
limit where inductor's are faster) at sizes where the device sets the step; they run with ``run_matrix(...,
device="cuda")`` (benchmarks/scenarios.py --device cuda, the GPU campaign's ``scenarios_gpu`` step, tests/test_gpu.py)
on 2 NCCL ranks (1 where a row says). On the CPU they run shrunk, on gloo, without what the CPU cannot do (CPU
offload): their rules then mostly stay quiet, and the run checks that everything runs.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from fsdp_doctor.report_sections import Predicted

MiB = 1 << 20
ORDER = {"info": 0, "warning": 1, "critical": 2}
# timing-driven codes a shared 2-core host produces by itself now and then: never counted as a new warning of a
# fix, nor as a false alarm of the tuned baselines unless the row planted them
NOISE = frozenset({"straggler.rank", "straggler.intermittent", "straggler.trace", "jitter.gc", "jitter.data_wait",
                   "jitter.recurring_outside", "prefetch.exposed_allgather", "throughput.low_mfu", "verdict.severe"})
# findings a fix uncovers, which its finding kept quiet: with several roots wrap.params_in_root stays quiet
# (root_not_sharded says it); the one-line root fix then shows the embeddings and head in the new root. Under a
# budget checkpointing cannot meet (gpt_tight_capacity: 14.9 MB predicted and measured for 12 MiB), the peak left
# has no dominant category once the block in backward counts as gathered (its 793 KB no longer temporaries), and
# memory.near_capacity_spread names the next lever, the units kept gathered after forward
# wrap.too_fine's blocks shorten the step (gpt_leaf: 328 -> 194 ms) while the last unit of forward, the run's own
# lm_head unit the plan keeps as it was, waits as long as before for its backward all-gather (5.5 and 4.2 ms): the
# same wait becomes a larger share of the step, and reshard.last_unit, under 1% of it before on a loaded host (CI),
# says it past 2% after
UNCOVERS = {"wrap.root_not_sharded": {"wrap.params_in_root"}, "ac.recommended": {"memory.near_capacity_spread"},
            "wrap.too_fine": {"reshard.last_unit"},
            # full checkpointing's peak (gpt_sac_tight: 14.9 MB of a 22.6 MB budget, 66%) leaves room for the last
            # block's activations, freed as its backward starts: ac.fewer_units offers them, its severity the share
            # of the step its 9 ms recompute is (4%, info, idle; past 5%, a warning, on a loaded host)
            "ac.selective_to_full": {"ac.fewer_units"},
            # attention switched to sdpa (hf_llama_eager_long): the score matrices gone, the peak falls far under the
            # budget (29.91 -> 8.71 MiB of a 31.48 MiB one) and the blocks' checkpointing is more than it needs
            "memory.temporaries": {"ac.unneeded"}}
# findings that say "memory to spare: spend it on speed", an opportunity and never a harm: a fix that lowers the
# peak uncovers them (the bf16 model of optim.state_dominates leaves room for ZeRO-2 where the tight budget had
# none), and after ac.unneeded's fix the headroom left is still offered (its severity follows the time saved,
# which a loaded host moves); not counted as a new warning of a fix. accum.regather is one too: units kept gathered
# between micro-batches for the time of their all-gathers (the Trainer's tight case: after ac.recommended's fix freed
# the memory it warned, its severity the time saved on a loaded host)
HEADROOM = frozenset({"reshard.zero2_affordable", "accum.regather"})
# what two NCCL ranks sharing one GPU over loopback sockets (1.5-2 GB/s, ../shared/notes/gpu-machine.md) make true
# of every GPU row: its collectives set the step (exposed collectives 51-92% of it on the H100), and ZeRO-2 would
# save the backward's all-gathers. The tuned GPU baselines show these rightly: not false alarms there
LOOPBACK = frozenset({"comm.bound", "comm.exposed_reducescatter"}) | HEADROOM


def baseline_exempt(row) -> frozenset:
    """The warnings a tuned baseline may show: the host's noise, and on a GPU row what the loopback link makes true."""
    return NOISE | (LOOPBACK if row.gpu else frozenset())
# rules whose problem needs a GPU trace or a GPU: found from the known-answer traces, their snippets executed
GPU_ONLY = ("comm.", "kernels.", "offload.")

GPT = {"steps": 6, "async_unshard": True}  # the reference workload's shape (d_model 128, 4 layers, seq 64, batch 4)
SMALL = {"steps": 6, "async_unshard": True, "batch_size": 2, "seq_len": 32}  # the other trees' batches
PROFILE = {"profile": {"first": 3, "active": 1, "warmup": 1, "every": 0}}
NO_PROFILE = {"profile": False}


@dataclass(frozen=True)
class Row:
    name: str
    tree: str  # tests/clients.py BUILD: gpt, hf_llama, titan (torchtitan-shaped llama), resnet, ...
    code: Optional[str]  # the finding planted (None: a tuned baseline, no warning expected)
    knobs: dict = field(default_factory=dict)  # the user's code: WorkloadConfig fields
    watch: dict = field(default_factory=dict)  # watch() options beyond the profiler window
    profile: bool = False  # rules that read a trace
    min_severity: str = "warning"
    user_shard: Optional[str] = None  # tests/clients.py USER_SHARD: the user's own sharding code
    capacity_share: Optional[float] = None  # the budget: the row's own peak / this share
    apply: bool = True  # its fix applied and rechecked (False: the finding carries no code to apply)
    mesh: Optional[tuple] = None  # a 2-D (HSDP) mesh shape; default 1-D over all ranks
    world: int = 2  # ranks (rows of one world size train in one launch)
    # what the fix must improve when the finding stays (it describes the code, not an effect): an evidence key of
    # the finding (a number, or a list: its length) or "replica_drift" (the runner's); improved = halved or better
    figure: Optional[str] = None
    # the fix's gain is a GPU's (overlap, kernels): applied and run here, its gain rechecked there; the finding may
    # stay (its rule reads what the fix does not change) unless the row names a figure, which must improve too
    gpu_gain: bool = False
    why: str = ""  # what is planted, in a few words
    gpu: bool = False  # a GPU row (GPU_ROWS): its knobs are the GPU's shape, shrunk on the CPU
    # the user's loop beyond the knobs: "loss_allreduce" all-reduces the loss synchronously after each step (a log
    # line's average); "keep_outputs" keeps what the model returned (outputs = model(...)) until
    # the next forward rebinds the name, as Hugging Face's no-trainer examples do; "keep_all_outputs" appends every
    # step's logits, detached, to a list on the device (kept for a metric); "eval_autograd" evaluates after
    # every third step with model.eval() and no torch.no_grad() (tests/clients.py evaluate_in_eval_mode);
    # "top_optimizer" builds the optimizer over the last block and what follows it only (tests/clients.py
    # user_param_groups); "sync_off" calls set_requires_gradient_sync(False) before every backward; "generate" runs
    # 8 forward passes without gradients after every third step (tests/clients.py generate_passes); "labels": a
    # Hugging Face model computes the loss in its forward (model(input_ids=..., labels=...).loss); "fused_optimizer"
    # builds AdamW fused (the clients' default is foreach, as torch picks it on a GPU), "default_optimizer" as torch
    # picks it on the row's device (on the CPU, and for offloaded shards, its loop)
    loop: Optional[str] = None
    # the rerun's peak against the prediction: within this share of it (2% where a test holds the rule to that)
    peak_within: float = 0.10
    # a GPU row's device nearly full: from tests/clients.py ALLOC_LIMIT_AFTER on, the caching allocator is capped at
    # this times the highest allocation so far (torch.cuda.set_per_process_memory_fraction); None: the whole device
    alloc_limit: Optional[float] = None

    def spec(self, out: Path, fix: Optional[dict] = None, capacity: Optional[int] = None,
             device: str = "cpu") -> dict:
        knobs = {**(GPT if self.tree == "gpt" else SMALL), **self.knobs}
        if self.gpu and device == "cpu":  # the plumbing only: tiny, asynchronous gloo unshard, no CPU offload
            knobs = {k: v for k, v in {**knobs, **CPU_SHAPE}.items() if k not in ("cpu_offload", "offload_pin_memory")}
        watch = {**(PROFILE if self.profile else NO_PROFILE), **self.watch}
        if self.profile:
            from fsdp_doctor import ProfileSchedule  # noqa: F401 - the dict form is watch()'s own

        if capacity:
            watch["capacity_bytes"] = capacity
        spec = {"name": self.name, "tree": self.tree, "knobs": knobs, "watch": watch, "out_dir": str(out),
                "user_shard": self.user_shard, "fix": fix, "mesh": self.mesh, "loop": self.loop,
                "alloc_limit": self.alloc_limit}
        if self.capacity_share and not capacity:
            spec["capacity_share"] = self.capacity_share
        return spec


def _r(name, tree, code, why, **kw) -> Row:
    return Row(name, tree, code, why=why, **kw)


AMPLE = {"capacity_bytes": 8 << 30}
# prefetch.exposed_allgather planted so that the all-gathers set the step: micro-batches of 16 tokens with the
# gradient sync on the last only, so every unit is gathered in each micro-batch's forward and backward with little
# compute to hide behind, while the reduce-scatters and the optimizer step run once per step: 50-79% of the step
# on the GPT, 49-67% on the HF Llama, at load averages 3 to 12 on this 2-core host. The reference shape (one batch
# of 4 x 64 tokens) waited 14-29% against the 15% the rule fires from, mostly for the other rank and the scheduler
# rather than for bytes (one 774 KiB all-gather took 0.5 to 6 ms in one trace), and failed its row under load.
# Larger units alone do not help on gloo: the blocking reduce-scatter and AdamW grow with them (a 12 MiB unit's
# reduce-scatter took 112 ms against its all-gather's 20 ms, loaded).
GATHER_BOUND = {"batch_size": 1, "seq_len": 16, "grad_accum": 4, "accum_no_sync": True}
LLAMA_MP = {"param_dtype": "bf16", "reduce_dtype": "fp32"}  # torchtitan's: frozen bf16 weights beside fp32 ones
BF16_REDUCE = {"param_dtype": "bf16", "reduce_dtype": "bf16"}  # what accelerate's FSDP2 plugin makes of bf16=True

ROWS: list[Row] = [
    # tuned baselines: the expert plan of each tree (embeddings one unit, each block, [norm, head] kept gathered)
    _r("gpt_tuned", "gpt", None, "expert plan, async unshard", profile=True, knobs={"steps": 8}),
    _r("hf_llama_tuned", "hf_llama", None, "expert plan"),
    # a 2x1 HSDP mesh shards over one rank: the root's parameters are never all-gathered, nothing to gain
    _r("gpt_hsdp21_blocks_only", "gpt", None, "blocks and root only on a 2x1 HSDP mesh", knobs={"wrap": "blocks_only"},
       mesh=(2, 1)),
    _r("titan_tuned", "titan", None, "expert plan, bf16/fp32 mixed precision", knobs=LLAMA_MP),
    _r("resnet_tuned", "resnet", None, "expert plan"),
    _r("transformer_tuned", "transformer", None, "blocks and root, the tied embedding/output in the root",
       knobs={"ac": "none"}),
    # sharding choices
    _r("gpt_whole", "gpt", "wrap.too_coarse", "one unit: fully_shard(model)", knobs={"wrap": "whole"}),
    _r("resnet_whole", "resnet", "wrap.too_coarse", "one unit: fully_shard(model)", knobs={"wrap": "whole"}),
    _r("hf_llama_whole", "hf_llama", "wrap.too_coarse", "one unit: fully_shard(model)", knobs={"wrap": "whole"}),
    _r("transformer_whole", "transformer", "wrap.too_coarse", "one unit, tied embedding and output",
       knobs={"wrap": "whole"}),
    # its plan splits the one unit's mixed precision over the new units (the blocks' loop once dropped it: a bf16
    # input met fp32 weights when pasted)
    _r("gpt_whole_mp", "gpt", "wrap.too_coarse", "one unit, bf16 compute and fp32 reduction",
       knobs={"wrap": "whole", **LLAMA_MP}),
    _r("gpt_leaf", "gpt", "wrap.too_fine", "every Linear its own unit", knobs={"wrap": "leaf"}),
    _r("gpt_blocks_only", "gpt", "wrap.params_in_root", "blocks and root only", knobs={"wrap": "blocks_only"}),
    # the blocks reshard to 2 of 4 ranks after forward (an int reshard_after_forward): the plan keeps it (it once
    # printed the blocks' loop without it: pasted, the blocks resharded to all 4 ranks)
    _r("gpt_blocks_only_raf2", "gpt", "wrap.params_in_root", "blocks (reshard to 2 of 4 ranks) and root only",
       knobs={"wrap": "blocks_only", "reshard_after_forward": 2}, world=4),
    _r("hf_llama_blocks_only", "hf_llama", "wrap.params_in_root", "blocks and root only",
       knobs={"wrap": "blocks_only"}),
    # the loss computed in the model's own forward (labels=, as HF's examples and Trainer do): the root's backward
    # starts before the loss's, and its prefetch of the last block is held through it; once the root holds no
    # parameters, the head's unit issues that prefetch after the loss's backward (a new-user trial: 128 KiB predicted
    # saved, 288 KiB measured)
    _r("hf_llama_blocks_only_labels", "hf_llama", "wrap.params_in_root", "blocks and root only, the loss in forward",
       knobs={"wrap": "blocks_only"}, loop="labels", peak_within=0.02),
    # the embedding and the blocks units, the final norm and head in the root (19% of the parameters): the plan
    # frees the head's gathered copy at the peak, 2.6% of it at 2 x 32 tokens; at 8 x 64 tokens the activations make
    # it under 1% of the peak and the rule is quiet, saying so (a DiT's patch embedding and output projections in its
    # root, 5.3% of the parameters, read a warning "peak 1.02 MiB -> 1.02 MiB": its plan pasted freed 0.7%, as
    # predicted)
    _r("hf_llama_head_in_root", "hf_llama", "wrap.params_in_root", "embedding and blocks units, head in the root",
       user_shard="head_in_root"),
    _r("hf_llama_head_in_root_long_batch", "hf_llama", None, "head in the root, 8 x 64 tokens: under 1% of the peak",
       user_shard="head_in_root", knobs={"batch_size": 8, "seq_len": 64}),
    _r("hf_llama_tuned_long_batch", "hf_llama", None, "expert plan, 8 x 64 tokens", knobs={"batch_size": 8, "seq_len": 64}),
    # an 8,192-token vocabulary's embedding tied to the head, in one unit with the final norm (accelerate's grouping
    # of a tied model) beside each block: 83% of the parameters in a unit that cannot split (wrap.too_coarse asked for
    # each block a unit, which they were, on a new-user trial's Qwen2 under the Trainer)
    _r("hf_llama_tied_vocab_ends", "hf_llama_tied_vocab", None,
       "blocks, then the tied embedding, norm and head one unit kept gathered", user_shard="tied_ends"),
    # torchtitan's bf16 parameters on 4 ranks: the root's gathered copy twice its fp32 shard. On 2 ranks the two are
    # equal and the plan frees nothing (its expert plan, titan_tuned, measured 1,160,532 B against 1,160,404 B): quiet
    _r("titan_blocks_only", "titan", "wrap.params_in_root", "blocks and root only, 4 ranks",
       knobs={"wrap": "blocks_only", **LLAMA_MP}, world=4),
    _r("titan_blocks_only_2_ranks", "titan", None, "blocks and root only, bf16 on 2 ranks: the plan frees nothing",
       knobs={"wrap": "blocks_only", **LLAMA_MP}),
    # (a profiler window: FSDP's labels name no root, so the trace counts every root's collectives as one "(root)"
    # unit's, several a step; tests/test_scenario_matrix.py holds the trace rules to that)
    _r("gpt_no_root", "gpt", "wrap.root_not_sharded", "fully_shard never on the root", knobs={"wrap": "no_root"},
       min_severity="warning", profile=True),
    _r("hf_llama_no_root", "hf_llama", "wrap.root_not_sharded", "fully_shard never on the root",
       knobs={"wrap": "no_root"}, profile=True),
    _r("resnet_no_root", "resnet", "wrap.root_not_sharded", "fully_shard never on the root",
       knobs={"wrap": "no_root"}),
    _r("titan_mixed_dtype", "titan", "wrap.mixed_dtype_unit", "frozen bf16 weights beside fp32, no policy"),
    _r("llama_ignored_param", "llama", "wrap.unreduced_params", "torchtitan plan, a trainable param ignored",
       user_shard="titan", min_severity="critical", figure="replica_drift"),
    # the optimizer
    _r("gpt_optimizer_before_shard", "gpt", "optim.before_shard", "AdamW built before fully_shard",
       knobs={"optimizer_before_shard": True}, min_severity="critical"),
    _r("hf_llama_optimizer_before_shard", "hf_llama", "optim.before_shard", "AdamW built before fully_shard",
       knobs={"optimizer_before_shard": True}, min_severity="critical"),
    # activation checkpointing and capacity
    _r("gpt_tight_capacity", "gpt", "ac.recommended", "batch 8 under a 12 MiB budget", knobs={"batch_size": 8},
       watch={"capacity_bytes": 12 * MiB}),
    _r("gpt_ac_ample", "gpt", "ac.unneeded", "every block checkpointed, 8 GiB budget", knobs={"ac": "block"},
       watch=AMPLE, min_severity="info", figure="checkpointed_units", peak_within=0.02),
    _r("hf_llama_ac_ample", "hf_llama", "ac.unneeded", "HF gradient_checkpointing_enable(), 8 GiB budget",
       knobs={"ac": "block"}, watch=AMPLE, min_severity="info", figure="checkpointed_units"),
    # every block checkpointed where half of them fit with their activations kept: peak 12.05 MiB with all four
    # checkpointed, 16.92 MiB with none (over 80% of the budget), each block 1.22 MiB more
    _r("gpt_ac_some", "gpt", "ac.fewer_units", "every block checkpointed, 18.5 MiB budget", knobs={"ac": "block"},
       watch={"capacity_bytes": int(18.5 * MiB)}, min_severity="info", figure="checkpointed_units"),
    _r("hf_llama_ac_some", "hf_llama", "ac.fewer_units", "HF gradient_checkpointing_enable(), 2.9 MiB budget",
       knobs={"ac": "block"}, watch={"capacity_bytes": int(2.9 * MiB)}, min_severity="info",
       figure="checkpointed_units"),
    # torchtitan's default, selective checkpointing of every block (the matmuls' outputs saved), near capacity:
    # full checkpointing keeps only the blocks' inputs
    _r("gpt_sac_tight", "gpt", "ac.selective_to_full", "every block selectively checkpointed, budget 5% above peak",
       knobs={"ac": "selective", "batch_size": 8}, capacity_share=0.95),
    _r("gpt_ac_children", "gpt", "ac.wrong_granularity", "each block's attn and mlp checkpointed",
       knobs={"ac": "children"}, watch=AMPLE),
    _r("resnet_ac_children", "resnet", "ac.wrong_granularity", "each block's convolutions checkpointed",
       knobs={"ac": "children"}, watch=AMPLE),
    _r("resnet_tight_capacity", "resnet", "ac.recommended", "activations of a batch of 32 images, budget 5% above peak",
       knobs={"batch_size": 16}, capacity_share=0.95),
    # a vocabulary 16 times the tiny model's (8,192 tokens beside a 64-wide model, as 128k beside a 4k-wide one), the
    # loss in the model's forward: its logits, their log-softmax and gradients hold most of a peak near capacity; the
    # lever is the user's loss (chunked, fused with the head), said in words (a new-user trial's 32,000-token Llama
    # read no memory finding at 91% of capacity, memory.near_capacity_spread quiet as "its own rule applies")
    _r("hf_llama_big_vocab", "hf_llama_vocab", "memory.temporaries", "8,192-token vocabulary, budget 5% above peak",
       knobs={"batch_size": 8, "seq_len": 64}, loop="labels", capacity_share=0.95, apply=False),
    # eager attention over 512 tokens, each block checkpointed (HF's own): the score matrices its backward's
    # recompute and gradients make set the peak; the fix is the model's own switch to scaled_dot_product_attention
    _r("hf_llama_eager_long", "hf_llama_eager_long", "memory.temporaries",
       "eager attention over 512 tokens, blocks checkpointed, budget 5% above peak",
       knobs={"batch_size": 2, "seq_len": 512, "ac": "block"}, capacity_share=0.95),
    _r("gpt_raf_tight", "gpt", "memory.near_capacity_spread", "reshard_after_forward=False, budget 5% above peak",
       knobs={"batch_size": 1, "reshard_after_forward": False, "steps": 4}, capacity_share=0.95, peak_within=0.02),
    # accelerate's plan since 1.14 (the [norm, head] unit alone kept gathered) near capacity, as a new-user trial's
    # Qwen2 (4 bf16 micro-batches, the peak at 89%): memory.near_capacity_spread asked to reshard that unit, the last
    # of forward, and reshard.last_unit asked for it back; the lever is checkpointing
    _r("hf_llama_tail_kept_near_capacity", "hf_llama", "ac.recommended",
       "[norm, head] alone kept gathered, 4 bf16 micro-batches, the peak at 89% of capacity",
       knobs={**BF16_REDUCE, "grad_accum": 4, "accum_no_sync": True}, capacity_share=0.89),
    _r("gpt_raf_everywhere", "gpt", "reshard.last_unit", "reshard_after_forward=True on every unit",
       knobs={"reshard_after_forward": True}, min_severity="info"),
    _r("hf_llama_raf_everywhere", "hf_llama", "reshard.last_unit", "reshard_after_forward=True on every unit",
       knobs={"reshard_after_forward": True}, min_severity="info"),
    _r("titan_raf_everywhere", "titan", "reshard.last_unit", "reshard_after_forward=True on every unit",
       knobs={"reshard_after_forward": True, **LLAMA_MP}, min_severity="info"),
    # planted where the backward all-gathers are a share of the step that load does not wash out: micro-batches of
    # 16 tokens with the sync on the last, so each unit is gathered again in every micro-batch's backward. The
    # reference shape saved 3.3 ms of a 111 ms step (GPT; the rule fires from 2%) and went quiet under three CPU
    # hogs (3.2-3.8 of 217 ms; the HF Llama 1.4 of 85 ms); this shape: 21% and 11% idle, 15-22% under the hogs
    _r("hf_llama_zero2_ample", "hf_llama", "reshard.zero2_affordable",
       "every unit resharded under an 8 GiB budget, 4 micro-batches of 16 tokens", knobs=GATHER_BOUND, watch=AMPLE,
       min_severity="info"),
    _r("gpt_zero2_ample", "gpt", "reshard.zero2_affordable",
       "every unit resharded under an 8 GiB budget, 4 micro-batches of 16 tokens", knobs=GATHER_BOUND, watch=AMPLE,
       min_severity="info"),
    # the same loop: each unit resharded after every micro-batch's backward and gathered again in the next forward
    _r("gpt_regather", "gpt", "accum.regather", "4 micro-batches of 16 tokens, resharded after each backward",
       knobs=GATHER_BOUND, watch=AMPLE, min_severity="info"),
    _r("hf_llama_regather", "hf_llama", "accum.regather", "4 micro-batches of 16 tokens, resharded after each "
       "backward", knobs=GATHER_BOUND, watch=AMPLE, min_severity="info"),
    # a generation after every third step: 8 forward passes without gradients, every unit gathered in each
    _r("gpt_generate", "gpt", "eval.regather", "8 forward passes without gradients after every third step",
       loop="generate", watch=AMPLE, min_severity="info"),
    _r("gpt_prefetch_deep", "gpt", "prefetch.too_early", "explicit prefetch 3 units ahead, budget 5% above peak",
       knobs={"forward_prefetch": 3, "backward_prefetch": 3}, capacity_share=0.95, profile=True,
       min_severity="info"),
    # explicit prefetch lists in the wrong order: each block gathers the one before it again in forward, the one after
    # it in backward (12 all-gathers a step for 9 on a new-user trial's 4-block model)
    _r("gpt_prefetch_wrong_order", "gpt", "prefetch.wrong_order", "explicit prefetch lists in the wrong order",
       knobs={"prefetch_reversed": True}, profile=True),
    _r("gpt_state_tight", "gpt", "optim.state_dominates", "one short sequence per rank, budget 5% above peak",
       knobs={"batch_size": 1, "seq_len": 8, "d_model": 64, "n_layers": 8}, capacity_share=0.95),
    # the same with wider blocks: the peak in AdamW's foreach step (the users' default on CUDA, the clients' here)
    _r("gpt_optimizer_peak", "gpt", "optim.foreach_temporaries", "AdamW's foreach step at the peak, budget 5% above it",
       knobs={"batch_size": 1, "seq_len": 8, "d_model": 128, "n_layers": 8}, capacity_share=0.95),
    # AdamW as torch picks it on the CPU, stepping the 8 blocks' 80 tensors one at a time: a note (a CPU run)
    _r("gpt_unfused_step", "gpt", "optim.unfused_step", "AdamW's default loop on the CPU, 8 blocks",
       knobs={"n_layers": 8}, min_severity="info", loop="default_optimizer"),
    _r("gpt_exposed_allgather", "gpt", "prefetch.exposed_allgather",
       "FSDP's implicit prefetch on gloo, 4 micro-batches of 16 tokens", knobs=GATHER_BOUND, min_severity="info",
       gpu_gain=True),
    # its first lever here is the batch size: advice in words (a larger micro-batch), no code to paste
    _r("gpt_low_mfu", "gpt", "throughput.low_mfu", "MFU against a 1 TFLOP/s peak", watch={"peak_tflops": 1.0},
       min_severity="info", apply=False),
    _r("hf_llama_exposed_allgather", "hf_llama", "prefetch.exposed_allgather",
       "FSDP's implicit prefetch on gloo, 4 micro-batches of 16 tokens", knobs=GATHER_BOUND, min_severity="info",
       gpu_gain=True),
    # the training loop
    _r("gpt_accum", "gpt", "accum.sync_every_micro_batch", "4 micro-batches, gradient sync on each",
       knobs={"grad_accum": 4}, profile=True, min_severity="info"),
    _r("gpt_zero_grad", "gpt", "memory.grads_kept", "zero_grad(set_to_none=False), 18 MiB budget",
       knobs={"zero_grad_to_none": False}, watch={"capacity_bytes": 18 * MiB}, peak_within=0.02),
    _r("gpt_outputs_kept", "gpt", "memory.outputs_kept", "the loop keeps the model's logits until the next forward",
       loop="keep_outputs", min_severity="info", peak_within=0.02),
    # (5%: its rerun's peak lies in the loss phase with the root gathered, 131,328 B, and gloo's worker thread can
    # still hold the root's finished asynchronous all-gather output there: +2.04% on both attempts of one
    # loaded `make test`, the extra all in temporaries; -0.03% otherwise)
    _r("hf_llama_outputs_kept", "hf_llama", "memory.outputs_kept",
       "outputs = model(...) kept until the next forward (logits, past_key_values)", loop="keep_outputs",
       knobs={"batch_size": 4, "seq_len": 64}, min_severity="info", peak_within=0.05),
    _r("gpt_eval_autograd", "gpt", "memory.eval_autograd", "evaluation in eval mode without torch.no_grad()",
       loop="eval_autograd", min_severity="info"),
    _r("hf_llama_eval_autograd", "hf_llama", "memory.eval_autograd",
       "model.eval() and outputs = model(...) in evaluation, without torch.no_grad()", loop="eval_autograd",
       min_severity="info"),
    _r("gpt_grad_norm_log", "gpt", "optim.step_comm", "each parameter's gradient norm logged every step (full_tensor)",
       loop="grad_norm_log", profile=True, min_severity="info"),
    _r("gpt_bf16_reduce", "gpt", "numerics.reduce_dtype", "reduce_dtype=bf16 for fp32 parameters",
       knobs={"reduce_dtype": "bf16"}),
    # bf16 compute: the fix's float32 reduction keeps the accumulated unsharded gradients in float32 (peak +20%)
    _r("gpt_bf16_reduce_accum", "gpt", "numerics.reduce_dtype",
       "bf16 compute and reduction, 4 micro-batches synced on the last", knobs={**GATHER_BOUND, **BF16_REDUCE},
       peak_within=0.05),
    # the optimizer built over the top of the model (the last block and the head) to fine-tune it, the rest left with
    # requires_grad=True: its gradients computed, reduce-scattered and kept for nothing, its activations saved
    _r("gpt_top_optimizer", "gpt", "optim.untrained_params", "the optimizer holds the last block and the head only",
       loop="top_optimizer"),
    _r("hf_llama_top_optimizer", "hf_llama", "optim.untrained_params",
       "the optimizer holds the last block and the head only", loop="top_optimizer"),
    # gradient accumulation's set_requires_gradient_sync(False), never set back: no gradient reaches the optimizer
    _r("gpt_sync_off", "gpt", "optim.no_gradients", "set_requires_gradient_sync(False) before every backward",
       loop="sync_off", knobs={"grad_accum": 2}, min_severity="critical"),
    # torch.autocast kept from a DDP loop over float32 FSDP2 parameters: autocast's bf16 copy of every matmul weight
    # held from its unit's forward to its backward, every all-gather in float32
    _r("gpt_autocast", "gpt", "precision.autocast_fp32_params", "torch.autocast(bf16) over float32 parameters",
       knobs={"autocast": "bf16"}),
    _r("hf_llama_autocast", "hf_llama", "precision.autocast_fp32_params",
       "torch.autocast(bf16) over float32 parameters", knobs={"autocast": "bf16", "batch_size": 4, "seq_len": 64}),
    _r("gpt_autocast_mp", "gpt", None, "torch.autocast(bf16) over a bf16/fp32 policy: nothing to copy",
       knobs={"autocast": "bf16", **LLAMA_MP}),
    _r("gpt_sync_unshard", "gpt", "prefetch.sync_unshard", "gloo all-gathers block the host (no async op)",
       knobs={"async_unshard": False}, profile=True),
    _r("hf_llama_sync_unshard", "hf_llama", "prefetch.sync_unshard", "gloo all-gathers block the host",
       knobs={"async_unshard": False}),
    # the host
    # the loop's own cycles: the collector must free them, off or on (off, the step ran 60% slower: fresh memory for
    # each step's cycles); the lever is the code that makes them, advice in words
    _r("gpt_gc_garbage", "gpt", "jitter.gc", "200k reference cycles per step", knobs={"gc_garbage": 200_000,
                                                                                     "steps": 8}, apply=False),
    # no cycle, but a heap the full collections traverse: frozen out of their view and collected between steps
    _r("gpt_gc_heap", "gpt", "jitter.gc", "500k objects kept for the run, 125k a step kept 3 steps",
       knobs={"gc_heap": 500_000, "steps": 10}),
    # the lever is the user's own data pipeline, which the doctor does not see: advice in words
    _r("gpt_slow_loader", "gpt", "jitter.data_wait", "the loader sleeps 150 ms per batch",
       knobs={"loader_ms": 150.0, "steps": 8}, apply=False),
    _r("gpt_straggler", "gpt", "straggler.rank", "rank 1 sleeps 150 ms every step",
       knobs={"sleep_rank": 1, "sleep_ms": 150.0, "steps": 8}, apply=False),  # what differs there: the user's
    _r("gpt_intermittent", "gpt", "straggler.intermittent", "rank 1 stalls 300 ms in steps 3, 5, 7 of 9",
       knobs={"sleep_rank": 1, "sleep_ms": 300.0, "sleep_steps": [3, 5, 7], "steps": 9},
       watch={"memory": {"transients": False}}, min_severity="info", apply=False),
    _r("gpt_periodic_pause", "gpt", "jitter.recurring_outside", "every rank stops 200 ms every 3rd step of 10",
       knobs={"pause_ms": 200.0, "pause_every": 3, "steps": 10}, watch={"memory": {"transients": False}},
       apply=False),  # the lever is the user's loop: advice in words
]

# ------------------------------------------------------------------------------------------------ architectures
# (wt-arch) trees we had never tried, sharded as their users do (tests/clients.py "architectures"): T5 (encoder
# and decoder stacks, one shared embedding tied to both and to the head), Mixtral (mixture of experts; per decoder
# layer, or with each layer's experts a unit of its own: user_shard "moe_experts"), ViT (patch embeddings, layers,
# classifier). A tuned baseline per tree, then planted problems.
ARCH_ROWS: list[Row] = [
    _r("t5_tuned", "t5", None, "each block of both stacks, the tied shared embedding and head in the root"),
    _r("mixtral_tuned", "mixtral", None, "embedding, each layer's experts, each layer, [norm, head], root",
       user_shard="moe_experts", profile=True),
    _r("mixtral_layers_tuned", "mixtral", None, "expert plan per decoder layer (experts inside their layer)"),
    _r("vit_tuned", "vit", None, "expert plan: embeddings, each layer, [layernorm, classifier], root"),
    _r("t5_whole", "t5", "wrap.too_coarse", "one unit: fully_shard(model)", knobs={"wrap": "whole"}),
    _r("mixtral_whole", "mixtral", "wrap.too_coarse", "one unit: fully_shard(model)", knobs={"wrap": "whole"}),
    _r("vit_whole", "vit", "wrap.too_coarse", "one unit: fully_shard(model)", knobs={"wrap": "whole"}),
    _r("mixtral_blocks_only", "mixtral", "wrap.params_in_root", "layers and root only",
       knobs={"wrap": "blocks_only"}),
    _r("mixtral_experts_blocks_only", "mixtral", "wrap.params_in_root", "experts and layers as units, embedding "
       "and head in the root", user_shard="moe_experts_blocks_only"),
    # a few tiny units whose collectives cost time, under wrap.too_fine's unit count (3 routers of 1 KiB inside
    # their layers: a new-user trial's 2-layer Mixtral waited 17.3 ms of a 108.6 ms step in its routers' all-gathers,
    # and the rule counted 4 units "(fires from 12)"); its fix drops the routers' units alone
    _r("mixtral_router_units", "mixtral", "wrap.too_fine", "each layer's router (mlp.gate, 1 KiB) a unit inside "
       "its layer", user_shard="moe_routers", min_severity="info", knobs={"steps": 12}),
    _r("t5_tight_capacity", "t5", "ac.recommended", "batch 8, budget 5% above peak", knobs={"batch_size": 8},
       capacity_share=0.95),
    _r("vit_tight_capacity", "vit", "ac.recommended", "32 images, budget 5% above peak", knobs={"batch_size": 16},
       capacity_share=0.95),
    _r("mixtral_tight_capacity", "mixtral", "ac.recommended", "batch 8, budget 5% above peak",
       knobs={"batch_size": 8}, capacity_share=0.95),
    # its explicit prefetch follows the order FSDP2 gathers the units: in backward each layer before its experts
    # (the chain once followed module order backward: experts -> their own layer, a layer -> the previous experts)
    _r("mixtral_exposed_allgather", "mixtral", "prefetch.exposed_allgather",
       "each layer's experts a unit, FSDP's implicit prefetch on gloo, 4 micro-batches of 16 tokens",
       user_shard="moe_experts", knobs=GATHER_BOUND, min_severity="info", gpu_gain=True),
]
# (wt-flux) diffusers' Flux (tests/clients.py flux: two block lists one after the other). A new-user trial wrapped
# its double-stream blocks alone: the root kept the single-stream ones (48% of the parameters) and
# wrap.params_in_root stayed quiet, "would lower the peak by 0 B": its peak model read the blocks after the wrapped
# ones as one trailing unit kept gathered after forward; its plan pasted lowered the peak 99.53 -> 95.38 MiB
ARCH_ROWS += [
    _r("flux_tuned", "flux", None, "expert plan: [x, context, time embedders], each block of both lists, "
       "[norm_out, proj_out], root"),
    _r("flux_double_only", "flux", "wrap.params_in_root", "its double-stream blocks and the root only",
       user_shard="flux_double_only"),
    _r("flux_whole", "flux", "wrap.too_coarse", "one unit: fully_shard(model)", knobs={"wrap": "whole"}),
    _r("flux_ac_ample", "flux", "ac.unneeded", "diffusers' enable_gradient_checkpointing(), 8 GiB budget",
       knobs={"ac": "block"}, watch=AMPLE, min_severity="info", figure="checkpointed_units"),
]
# (wt-vl) transformers' Qwen2.5-VL (tests/clients.py qwen_vl: a vision tower, then a language model). A new-user
# trial: the language layers alone wrapped left the tower in the root (47% of the parameters; its plan pasted
# 16.98 -> 15.10 MiB as predicted), and with the tower sharded whole the plan split it into its blocks unasked
ARCH_ROWS += [
    _r("qwen_vl_tuned", "qwen_vl", None, "expert plan: embedding, each vision block, merger, each language layer, "
       "[norm, lm_head], root", user_shard="qwen_vl_expert"),
    _r("qwen_vl_lm_only", "qwen_vl", "wrap.params_in_root", "its language layers and the root only",
       user_shard="qwen_vl_lm_only"),
    _r("qwen_vl_tower", "qwen_vl", "wrap.params_in_root", "the vision tower whole, each language layer, the root",
       user_shard="qwen_vl_tower"),
]
# (wt-clip) transformers' CLIPModel trained contrastively (tests/clients.py clip: its vision tower runs first)
ARCH_ROWS += [_r("clip_tuned", "clip", None, "expert plan: text embeddings, each layer of both towers, root")]
# (wt-albert) ALBERT (tests/clients.py albert: one shared layer group, 6 calls a pass): resharded after each call, it
# is all-gathered at each of them; kept gathered (ZeRO-2 for it), once a pass in forward and 5 times in backward
ARCH_ROWS += [
    _r("albert_tuned", "albert", None, "its layer group a unit, the root (the tied embedding and decoder in it)"),
    _r("albert_shared_regathered", "albert", "reshard.zero2_affordable",
       "the layer group resharded after each of its 6 calls a pass, an 8 GiB budget", watch=AMPLE,
       min_severity="info"),
]
ROWS += ARCH_ROWS

# (wt-gpt2) GPT-2 (Conv1D layers, learned position embeddings, lm_head tied to wte) and BERT for masked language
# modelling (embeddings with a LayerNorm, the MLM decoder tied to the word embeddings), tests/clients.py gpt2/bert.
# Their reruns found: BERT's plans left the embeddings and the head whole in the root (a tie inside each), HF
# gradient checkpointing that ac.unneeded's fix did not turn off, root_not_sharded's peak 11% high on BERT.
GPT2_BERT_ROWS: list[Row] = [
    # profiled: tests/test_scenario_matrix.py checks their figures against the model (Conv1D's (in, out) weights).
    # GPT-2's is the doctor's plan: beside the tied wte/lm_head, wpe and ln_f as units of their own would free less of
    # the peak than their collectives add to the step (snippets.leftover_stays), so they stay in the root (it was
    # "wpe, each block, ln_f kept gathered, root", the plan's until then); BERT's keeps units of the modules beside
    # its tie, which raise no warning either
    _r("gpt2_tuned", "gpt2", None, "each block, root (the tied wte/lm_head, wpe and ln_f)", profile=True,
       knobs={"wrap": "blocks_only"}),
    _r("bert_tuned", "bert", None, "[position, token-type embeddings, LayerNorm], each encoder layer, the head's "
       "transform kept gathered, root (the word embeddings tied to the MLM decoder)", profile=True),
    # a new-user trial's GPT-2 (a 2048-token vocabulary, 256 positions): the root, the tied wte/lm_head, wpe (64 KiB,
    # 12.5% of wte) and ln_f, holds half the parameters. wrap.params_in_root warned with a plan making wpe a unit:
    # pasted, the peak fell by its 64 KiB (5,462,824 -> 5,397,288 B, 1.2%), the step no shorter
    _r("gpt2_wide_blocks_only", "gpt2_wide", None, "blocks and root: the tied wte/lm_head, wpe and ln_f in the root",
       knobs={"wrap": "blocks_only"}),
    # BERT's other embeddings and its head's transform beside the tie: as units, 0.8% of the peak each, for
    # collectives of 5-21% of the step (the plan made them units: pasted, peak 2,122,096 -> 2,093,936 B, -1.3%)
    _r("bert_blocks_only", "bert", None, "encoder layers and root: the tied word embeddings/decoder, the other "
       "embeddings and the head's transform in the root", knobs={"wrap": "blocks_only"}),
    _r("gpt2_whole_mp", "gpt2", "wrap.too_coarse", "one unit, bf16 compute and fp32 reduction",
       knobs={"wrap": "whole", **LLAMA_MP}),
    _r("gpt2_bf16_reduce", "gpt2", "numerics.reduce_dtype", "reduce_dtype=bf16 for fp32 parameters",
       knobs={"reduce_dtype": "bf16"}),
    _r("bert_sync_unshard", "bert", "prefetch.sync_unshard", "gloo all-gathers block the host",
       knobs={"async_unshard": False}),
    _r("bert_accum", "bert", "accum.sync_every_micro_batch", "4 micro-batches, gradient sync on each",
       knobs={"grad_accum": 4}, profile=True, min_severity="info"),
    _r("bert_optimizer_before_shard", "bert", "optim.before_shard", "AdamW built before fully_shard",
       knobs={"optimizer_before_shard": True}, min_severity="critical"),
]
# the same problems planted on both trees (GPT-2: Conv1D leaves; BERT: Linear leaves, a tie inside its embeddings)
GPT2_BERT_ROWS += [row for tree, leaves, children in (
    ("gpt2", "Conv1D", "ln_1, attn, ln_2, mlp"), ("bert", "Linear", "attention, intermediate, output")) for row in (
    _r(f"{tree}_whole", tree, "wrap.too_coarse", "one unit: fully_shard(model)", knobs={"wrap": "whole"}),
    _r(f"{tree}_leaf", tree, "wrap.too_fine", f"every {leaves}, LayerNorm and Embedding its own unit",
       knobs={"wrap": "leaf"}),
    _r(f"{tree}_no_root", tree, "wrap.root_not_sharded", "fully_shard never on the root (the tied embedding in no "
       "unit)", knobs={"wrap": "no_root"}, min_severity="critical"),
    _r(f"{tree}_tight_capacity", tree, "ac.recommended", "batch 8, budget 5% above peak", knobs={"batch_size": 8},
       capacity_share=0.95),
    _r(f"{tree}_ac_ample", tree, "ac.unneeded", "HF gradient_checkpointing_enable(), 8 GiB budget",
       knobs={"ac": "block"}, watch=AMPLE, min_severity="info", figure="checkpointed_units"),
    _r(f"{tree}_ac_children", tree, "ac.wrong_granularity", f"each block's {children} checkpointed",
       knobs={"ac": "children"}, watch=AMPLE))]
ROWS += GPT2_BERT_ROWS
# GPT-NeoX under HF's gradient_checkpointing_enable(): its layers' last child (post_mlp_dropout) saves nothing, so
# the non-reentrant recompute stops before it; the layers read "children" and ac.wrong_granularity warned (a
# new-user trial), its fix changing nothing. Checkpointed whole: ac.unneeded, its fix checkpointing off
ROWS.append(_r("neox_ac_ample", "neox", "ac.unneeded", "HF gradient_checkpointing_enable(), 8 GiB budget",
               knobs={"ac": "block"}, watch=AMPLE, min_severity="info", figure="checkpointed_units"))
# ------------------------------------------------------------------------------------------------ (end architectures)

# ------------------------------------------------------------------------------------------------ fine-tuning rows
# (fine-tuning block) a frozen base, the optimizer over the trainable parameters only (tests/clients.py FINETUNE):
# an HF Llama with LoRA adapters on q_proj/v_proj, an HF Qwen2 with only its last block and head trainable
FINETUNE_ROWS: list[Row] = [
    # profiled: tests/test_scenario_matrix.py checks their reduce-scatter sizes against the trainable parameters
    _r("lora_tuned", "hf_llama_lora", None, "LoRA on q/v, expert plan", profile=True),
    _r("qwen2_tail_tuned", "qwen2_tail", None, "last block and head trainable, expert plan", profile=True),
    # how fine-tuners shard: each decoder layer, then the root (the frozen embeddings and head left in it)
    _r("lora_blocks_only", "hf_llama_lora", "wrap.params_in_root", "LoRA, decoder layers and root only",
       knobs={"wrap": "blocks_only"}),
    _r("qwen2_tail_blocks_only", "qwen2_tail", "wrap.params_in_root", "trainable tail, decoder layers and root only",
       knobs={"wrap": "blocks_only"}),
    _r("lora_optimizer_before_shard", "hf_llama_lora", "optim.before_shard",
       "AdamW over the adapters built before fully_shard", knobs={"optimizer_before_shard": True},
       min_severity="critical"),
    _r("qwen2_tail_optimizer_before_shard", "qwen2_tail", "optim.before_shard",
       "AdamW over the trainable tail built before fully_shard", knobs={"optimizer_before_shard": True},
       min_severity="critical"),
    # accumulating micro-batches for a larger effective batch: FSDP2 then holds the unsharded gradients of the
    # trainable parameters only (the adapters': 3.5 KiB per layer), what accum's predicted peak adds
    _r("lora_accum", "hf_llama_lora", "accum.sync_every_micro_batch", "LoRA, 4 micro-batches, gradient sync on each",
       knobs={"grad_accum": 4}, profile=True, min_severity="info"),
    _r("lora_raf_everywhere", "hf_llama_lora", "reshard.last_unit", "reshard_after_forward=True on every unit",
       knobs={"reshard_after_forward": True}, min_severity="info"),
    _r("lora_tight_capacity", "hf_llama_lora", "ac.recommended", "LoRA, 8 sequences per rank, budget 5% above peak",
       knobs={"batch_size": 8}, capacity_share=0.95),
    # the expert plan as fine-tuners write it: FSDP2's default backward prefetch gathers the frozen layers.1 from
    # layers.2's pre-backward, though layers.1 never runs backward (148,480 B per step, held to the end of backward and
    # at its peak); the tuned baselines show it too, as a note (lora_tuned: its frozen embedding, from layers.0)
    _r("qwen2_tail_frozen_gather", "qwen2_tail", "prefetch.frozen_gathered",
       "trainable tail, expert plan: the frozen block below it gathered in backward", profile=True,
       min_severity="info"),
    # only the trainable last block saves activations: its recompute holds them through its whole backward (the
    # un-checkpointed backward frees them as it goes), +262,400 B there; ac.recommended once predicted 10.3% low
    _r("qwen2_tail_tight_capacity", "qwen2_tail", "ac.recommended",
       "trainable tail, 8 sequences per rank, budget 5% above peak", knobs={"batch_size": 8}, capacity_share=0.95),
    # the frozen layers never run backward: its explicit prefetch gathers none of them there, where FSDP's implicit
    # prefetch gathers the one before the trainable block for nothing (profiled: the traces show it); the chain once
    # had the trainable block prefetch it too
    _r("qwen2_tail_exposed_allgather", "qwen2_tail", "prefetch.exposed_allgather",
       "trainable tail, FSDP's implicit prefetch on gloo, 4 micro-batches of 16 tokens", knobs=GATHER_BOUND,
       min_severity="info", gpu_gain=True, profile=True),
    # locked-image tuning of a CLIP (the vision tower frozen): its forward runs the vision tower before the text
    # tower, which module order puts first, so the first text unit's default backward prefetch gathers the last
    # vision layer in every backward (the rule once read module order and stayed quiet)
    _r("clip_lit_frozen_gather", "clip_lit", "prefetch.frozen_gathered",
       "LiT, expert plan: the last frozen vision layer gathered by the text embeddings' backward", profile=True,
       min_severity="info"),
]
ROWS += FINETUNE_ROWS
# ------------------------------------------------------------------------------------------------ (end fine-tuning)

# ------------------------------------------------------------------------------------------------ GPU rows
# the GPU's shape (tests/test_gpu.py SMALL): seconds per run on an H100, the device (not the host) sets the step;
# bf16 compute, fp32 reduction (numerics.reduce_dtype stays quiet); NCCL never blocks the host (no async unshard).
# 10 steps: the FLOP-counting step 1, the profiler window (warm-up 2, active 3) and its export in step 4 leave 5
# steady steps for the rules that read step times (with 6, one: reshard.zero2_affordable then had none)
GPU_SHAPE = {"steps": 10, "async_unshard": False, "n_layers": 4, "d_model": 512, "n_heads": 8, "n_kv_heads": 2,
             "vocab": 8192, "seq_len": 512, "batch_size": 4, "param_dtype": "bf16", "reduce_dtype": "fp32"}
HF_GPU_SHAPE = {"steps": 10, "async_unshard": False, "seq_len": 512, "batch_size": 4, **LLAMA_MP}
TINY_GPU = {"steps": 10, "async_unshard": False, "n_layers": 4, "d_model": 64, "seq_len": 32, "batch_size": 2}
# what the GPU rows become on the CPU (the campaign's dry run): the other trees' batches, a small GPT
CPU_SHAPE = {"async_unshard": True, "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "vocab": 512,
             "seq_len": 32, "batch_size": 2}


def _g(name, tree, code, why, **kw) -> Row:
    return Row(name, tree, code, why=why, gpu=True, profile=True, **kw)


GPU_ROWS: list[Row] = [
    _g("gpu_gpt_tuned", "gpt", None, "expert plan, explicit prefetch 1 ahead, bf16/fp32",
       knobs={**GPU_SHAPE, "forward_prefetch": 1, "backward_prefetch": 1}),
    # the loss all-reduced synchronously for a log line every step (as a Hugging Face Trainer gathers its token count):
    # since torch 2.8 its NCCL kernel runs on the compute stream, for microseconds: no finding (comm.on_compute_stream
    # warned on any such call)
    _g("gpu_gpt_loss_allreduce", "gpt", None, "the tuned plan, its loss all-reduced synchronously every step",
       knobs={**GPU_SHAPE, "forward_prefetch": 1, "backward_prefetch": 1}, loop="loss_allreduce"),
    _g("gpu_gpt_offload", "gpt", "offload.costly", "CPUOffloadPolicy on a model that fits the GPU",
       knobs={**GPU_SHAPE, "cpu_offload": True}),
    # the offloaded shards' AdamW as torch picks it for host tensors (its loop) under a budget that needs the offload
    # (the state back on the device: 97% of it, so offload.costly is quiet): the fused CPU step is the lever
    _g("gpu_gpt_offload_unfused", "gpt", "optim.unfused_step", "CPUOffloadPolicy, AdamW's default loop on the host, "
       "a budget the offload is needed for", knobs={**GPU_SHAPE, "cpu_offload": True}, capacity_share=0.7,
       loop="default_optimizer"),
    _g("gpu_gpt_offload_unpinned", "gpt", "offload.unpinned", "CPUOffloadPolicy(pin_memory=False)",
       knobs={**GPU_SHAPE, "cpu_offload": True, "offload_pin_memory": False}),
    _g("gpu_hf_llama_eager", "hf_llama_eager", "kernels.eager_attention", "HF Llama, attn_implementation='eager'",
       knobs=HF_GPU_SHAPE, min_severity="info"),
    # a model without SDPA (a learnable attention sink per head): the fix switches it to flex_attention, which
    # compiles in the rerun's first steps (GraniteSWA's flex runs on CUDA alone; tests/test_kernel_fixes.py checks
    # Gemma2's flex forward on the CPU). Not Gemma2 here: the GPU machine's transformers 5.17 gives Gemma2 SDPA, and
    # its recorded run (the first GPU session's) ran cuDNN's flash kernels, the rule rightly quiet
    _g("gpu_hf_granite_swa_eager", "hf_granite_swa", "kernels.eager_attention",
       "HF GraniteSWA, eager: no SDPA for it (attention sinks)", knobs=HF_GPU_SHAPE, min_severity="info"),
    _g("gpu_gpt_leaf", "gpt", "comm.small_collectives", "every Linear its own unit: small all-gathers",
       knobs={**GPU_SHAPE, "wrap": "leaf"}),
    _g("gpu_gpt_leaf_units", "gpt", "wrap.too_fine", "every Linear its own unit", knobs={**GPU_SHAPE, "wrap": "leaf"}),
    # comm.bound is true of every 2-rank row on the loopback link (LOOPBACK); here its lever is real: float32
    # parameters all-gathered, whose 16-bit fix halves those bytes (the step's gain checked against the prediction)
    _g("gpu_gpt_fp32_comm", "gpt", "comm.bound", "float32 parameters all-gathered over the slow link",
       knobs={**GPU_SHAPE, "param_dtype": "fp32"}, gpu_gain=True),
    # two ranks time-share one GPU here: the device computes ~0.5 ms a step that prefetching could hide behind, so
    # the finding is a note without code (H100: possible gain 0.26-1.94 ms on every row); a gain check needs two GPUs
    _g("gpu_gpt_exposed_allgather", "gpt", "prefetch.exposed_allgather", "FSDP's implicit prefetch only",
       knobs=GPU_SHAPE, min_severity="info", gpu_gain=True, apply=False),
    # the issue's recorded GPU scenarios (#22, item 4), the CPU rows' problems at the GPU's shape: their runs are
    # the GPU fixtures for traces/ (one launch for all, instead of a demo launch each), their fixes rechecked there
    _g("gpu_gpt_zero2", "gpt", None, "reshard_after_forward=False on every unit, ample memory",
       knobs={**GPU_SHAPE, "reshard_after_forward": False}),
    _g("gpu_gpt_whole", "gpt", "wrap.too_coarse", "one unit: fully_shard(model)", knobs={**GPU_SHAPE, "wrap": "whole"}),
    _g("gpu_gpt_zero2_ample", "gpt", "reshard.zero2_affordable", "every unit resharded under an 8 GiB budget",
       knobs=GPU_SHAPE, watch=AMPLE, min_severity="info"),
    _g("gpu_gpt_ac_ample", "gpt", "ac.unneeded", "every block checkpointed, 8 GiB budget",
       knobs={**GPU_SHAPE, "ac": "block"}, watch=AMPLE, min_severity="info", figure="checkpointed_units"),
    # the budget puts the checkpointed peak at 65% of capacity: its 80% aim leaves 23% of that peak for the activations
    # of the blocks un-checkpointed (the CPU row's shape: 3 of 4 blocks)
    _g("gpu_gpt_ac_some", "gpt", "ac.fewer_units", "every block checkpointed, budget: the peak at 65%",
       knobs={**GPU_SHAPE, "ac": "block"}, capacity_share=0.65, min_severity="info", figure="checkpointed_units"),
    _g("gpu_gpt_tight_capacity", "gpt", "ac.recommended", "batch 8, budget 5% above peak",
       knobs={**GPU_SHAPE, "batch_size": 8}, capacity_share=0.95),
    # one short sequence per rank, 8 blocks: the peak in AdamW's step, foreach on CUDA by default (DTensor
    # parameters), its intermediate a fp32 copy of the sharded parameters; the fix runs it fused
    _g("gpu_gpt_optimizer_peak", "gpt", "optim.foreach_temporaries", "AdamW's default foreach step at the peak, "
       "budget 5% above it", knobs={**GPU_SHAPE, "batch_size": 1, "seq_len": 64, "n_layers": 8}, capacity_share=0.95),
    # the loss's logits near capacity (the CPU row hf_llama_big_vocab on a GPU): a 32,768-token vocabulary beside a
    # 512-wide, 2-layer HF Llama in bf16, the loss in its forward (float32 logits: 8 x 512 x 32,768 x 4 B, 1 GiB),
    # 8 x 512 tokens a rank; in words, no code
    _g("gpu_hf_llama_big_vocab", "hf_llama_vocab", "memory.temporaries",
       "32,768-token vocabulary, the loss in forward, budget 5% above peak", knobs={**HF_GPU_SHAPE, "batch_size": 8},
       loop="labels", capacity_share=0.95, apply=False),
    # one short sequence per rank: the sharded parameters, gradients and AdamW's state are most of the peak, which a
    # budget 3% above it puts at 97% of capacity (offload.recommended fires from 95%); its fix moves that state to
    # the host, and the same budget then has room (offload.costly stays quiet: the state would not fit back)
    # (AdamW fused: foreach's intermediate, a copy of the sharded parameters, held its recorded peak, the step's,
    # whose free lever is optim.foreach_temporaries' and offload.recommended, judged on the peak the fused step
    # leaves, is quiet there; recorded before, foreach)
    _g("gpu_gpt_offload_needed", "gpt", "offload.recommended", "one sequence of 64 tokens per rank, budget 3% above "
       "peak", knobs={**GPU_SHAPE, "batch_size": 1, "seq_len": 64}, capacity_share=0.97, loop="fused_optimizer"),
    _g("gpu_gpt_optimizer_before_shard", "gpt", "optim.before_shard", "AdamW built before fully_shard",
       knobs={**GPU_SHAPE, "optimizer_before_shard": True}, min_severity="critical"),
    _g("gpu_gpt_small_batch", "gpt", "throughput.low_mfu", "one sequence of 64 tokens per rank",
       knobs={**GPU_SHAPE, "batch_size": 1, "seq_len": 64}, min_severity="info", apply=False),
    _g("gpu_gpt_accum", "gpt", "accum.sync_every_micro_batch", "4 micro-batches, gradient sync on each",
       knobs={**GPU_SHAPE, "grad_accum": 4}, min_severity="info"),
    # each unit gathered again in every micro-batch's forward (NCCL prefetches forward all-gathers less than gloo
    # blocks on them: whether the waits left are worth keeping the units gathered is what this row measures)
    _g("gpu_gpt_regather", "gpt", "accum.regather", "4 micro-batches of 128 tokens, gradient sync on the last",
       knobs={**GPU_SHAPE, "seq_len": 128, "batch_size": 1, "grad_accum": 4, "accum_no_sync": True}, watch=AMPLE,
       min_severity="info"),
    # a generation after every third step: 8 forward passes without gradients, each gathering every unit
    _g("gpu_gpt_generate", "gpt", "eval.regather", "8 forward passes without gradients after every third step",
       knobs=GPU_SHAPE, loop="generate", watch=AMPLE, min_severity="info"),
    _g("gpu_gpt_straggler", "gpt", "straggler.rank", "rank 1 sleeps 30 ms every step",
       knobs={**GPU_SHAPE, "sleep_rank": 1, "sleep_ms": 30.0, "steps": 12}, apply=False),  # 7 steady steps
    # every rank stops 60 ms before every third step's forward (a save the doctor is not told of): on the GPU the
    # device's idle before those forwards decides (the loop's loss.item() leaves the host no backlog to hide it)
    # torch.autocast(bf16) over float32 parameters: the bf16 copies of the matmul weights held for backward, and
    # float32 all-gathers, on the device (the caching allocator's figures)
    _g("gpu_gpt_autocast", "gpt", "precision.autocast_fp32_params", "torch.autocast(bf16) over float32 parameters",
       knobs={**GPU_SHAPE, "param_dtype": None, "reduce_dtype": None, "autocast": "bf16"}),
    # the optimizer over the last block and the head, the rest trainable: its prediction's ceiling on the device
    _g("gpu_gpt_top_optimizer", "gpt", "optim.untrained_params", "the optimizer holds the last block and the head only",
       knobs=GPU_SHAPE, loop="top_optimizer"),
    _g("gpu_gpt_periodic_pause", "gpt", "jitter.recurring_outside", "every rank stops 60 ms every 3rd step",
       knobs={**GPU_SHAPE, "pause_ms": 60.0, "pause_every": 3, "steps": 12}, min_severity="info", apply=False),
    # the log's time on the CPU rerun varies with the host's load (predicted -52 to -56 ms, measured -20 to -58): its
    # gain is checked on the GPU
    _g("gpu_gpt_grad_norm_log", "gpt", "optim.step_comm", "each parameter's gradient norm logged every step",
       knobs=GPU_SHAPE, loop="grad_norm_log", min_severity="info", gpu_gain=True),
    # every step's logits appended to a list on the device (a metric computed at the end): the allocation at each
    # step's end grows by them (memory.growing reads the allocator; on the CPU it is skipped). Nothing to paste
    _g("gpu_gpt_outputs_grow", "gpt", "memory.growing", "every step's logits kept in a list on the device",
       knobs=GPU_SHAPE, loop="keep_all_outputs", apply=False),
    _g("gpu_hf_llama_outputs_kept", "hf_llama", "memory.outputs_kept",
       "outputs = model(...) kept until the next forward (logits, past_key_values)", knobs=HF_GPU_SHAPE,
       loop="keep_outputs", min_severity="info"),
    # sequence lengths that vary from step to step (1/8 to all of seq_len) on a device the run nearly fills: the
    # allocator capped at 1.1x the longest step's peak from step 2 on (a larger model's 80 GB, on the H100). On the
    # H200 the steady peak filled 76% of that limit, and expandable segments, the fix it printed then, left 4 of
    # its 6 retries (benchmarks/alloc_retries_probe.py: none at 65%, with or without them): the advice is now the
    # peak, in words, and nothing is pasted (a startup fix would rerun in a launch of its own)
    _g("gpu_gpt_alloc_retries", "gpt", "memory.alloc_retries", "sequence lengths that vary per step, a nearly full "
       "device", knobs=GPU_SHAPE, loop="varying_lengths", alloc_limit=1.1, figure="retries", apply=False),
    # One rank: on the campaign's rig two ranks share one GPU and talk over loopback sockets, every all-gather takes
    # milliseconds and the host runs ahead of the device, so the tiny GPT's kernels wait in the queue behind the
    # collectives instead of for their launches (its old 2-rank recording: 3% of them started within 50 µs of their
    # launch, the device waited for launches 11% of the step); alone, the device has nothing to wait for but the
    # host (traces/gpu: 100%, 81%). Its fix is one unit for the whole model (FSDP2's hooks took a third of the
    # step; each block compiled, printed before, measured slower): the step still waits for launches after it,
    # so the check is its gain
    _g("gpu_gpt_tiny_launch_bound", "gpt", "kernels.launch_bound", "a tiny GPT: the host launches, the GPU waits",
       knobs=TINY_GPU, min_severity="info", world=1, gpu_gain=True),
    # Dynamo's recompile limit (8) hit on the forward the layers share: 16 HF Llama decoder layers, each compiled in
    # place with inductor, need a variant each, and the last 8 run eager (tests/test_recompile_limit.py: 10 layers on
    # 2 gloo ranks, aot_eager, where compiled and eager took the same time, so no step gain was quoted). One rank: on
    # the loopback link each layer's forward and backward would hold its all-gather's wait; alone, they hold the
    # layers' launches and kernels, and the fix's predicted gain (the eager layers' time over the compiled ones'
    # median) is checked against the rerun's step, besides the eager layers gone (tests/clients.py
    # hf_llama_layers_compiled)
    _g("gpu_hf_llama_recompile_limit", "hf_llama_layers_compiled", "compile.recompile_limit",
       "16 HF Llama decoder layers each compiled in place: 8 past Dynamo's recompile limit run eager",
       knobs=HF_GPU_SHAPE, world=1, gpu_gain=True, figure="eager_count"),
]
BY_NAME = {r.name: r for r in ROWS + GPU_ROWS}
# where the GPU session's recorded runs of GPU_ROWS are committed (benchmarks/gpu_campaign.py --adopt)
RECORDED_GPU = HERE.parent / "traces" / "gpu" / "scenarios"


def recorded_gpu_rows() -> list[Row]:
    """The GPU rows recorded so far: a row added since the last GPU session is not (a test that reads them all
    must not skip for it; each row's own test skips until it is recorded)."""
    return [r for r in GPU_ROWS if (RECORDED_GPU / r.name / "manifest.json").exists()]
# rows whose rerun shows the doctor's advice wrong, left to the rule's owner (tests xfail strictly on them, so a
# fix of the rule turns them into failures to remove from here)
KNOWN_WRONG: dict[str, str] = {
    # a GPU row: benchmarks/scenarios.py --device cuda prints "advice wrong" for it (tests/test_scenario_matrix.py
    # reads the CPU rows only, tests/test_gpu.py's GPU-row test does not read it); traces/gpu/scenarios_gpu.json
    # (gpu_gpt_tiny_launch_bound, kernels.launch_bound: each block compiled predicted 27.7 -> 6.8 ms and measured
    # 32.5 on the H100, 31.3 on the H200, until the rule read FSDP2's own host time and printed one unit for the
    # whole model: 30.26 -> 21.82 ms predicted, 19.30 measured on the H200; benchmarks/launch_levers.py)
    # (gpt_tight_capacity, ac.recommended: predicted 10.6 MiB with the blocks checkpointed, measured 14.9 MiB, until
    # the rule placed its saving on the peak step's timeline instead of at the old peak)
}


# ------------------------------------------------------------------------------------------------ the runner
def launch(specs: list[dict], tmp: Path, tag: str, device: str = "cpu", world: int = 2) -> dict:
    """Trains the scenarios of ``specs`` one after the other on ``world`` ranks (one launch: gloo, or NCCL on
    ``device="cuda"``); {name: rank 0's result}."""
    from test_clients import _launch

    path = tmp / f"{tag}.json"
    path.write_text(json.dumps(specs))
    results, _ = _launch("scenarios", world, path, timeout_s=900, device=device)
    return results[0]


def launch_rows(rows: list[Row], spec, tmp: Path, tag: str, device: str = "cpu") -> dict:
    """``launch`` for rows of any world size: one launch per world size (``spec(row)``: the row's spec)."""
    got: dict = {}
    for world in sorted({r.world for r in rows}):
        part = [r for r in rows if r.world == world]
        got.update(launch([spec(r) for r in part], tmp, tag if world == 2 else f"{tag}_{world}ranks", device, world))
    return got


def diagnosis(path: Path):
    """(run, report) of a run directory: the report holds the findings and every rule's status."""
    import fsdp_doctor

    run = fsdp_doctor.load_run(path)
    return run, fsdp_doctor.build_report(run)


def at_least(findings, code: str, severity: str):
    return next((f for f in findings if f.code == code and ORDER[f.severity] >= ORDER[severity]), None)


def warnings_of(findings) -> set[str]:
    return {f.code for f in findings if ORDER[f.severity] >= ORDER["warning"]}


@dataclass
class Outcome:
    """One row: its before-run, and where a fix was applied, its rerun and the recheck."""

    row: Row
    report: object = None  # the before-run's Report
    error: str = ""
    capacity: Optional[int] = None
    finding: object = None  # the planted finding at its severity, as found
    fix: Optional[dict] = None
    after: object = None  # the rerun's Report
    after_dir: Optional[Path] = None  # the rerun's records
    after_error: str = ""
    rerun_note: str = ""  # why no rerun: no code, GPU-only, not planted
    retried: str = ""  # ran again (before and after) since the first rerun's peak missed: what it measured then
    result: dict = field(default_factory=dict)  # the runner's (rank 0): losses, replica_drift, capacity
    after_result: dict = field(default_factory=dict)

    @property
    def findings(self):
        return self.report.findings if self.report is not None else []

    def recheck(self) -> dict:
        """What the rerun shows against the finding's prediction."""
        f, after = self.finding, self.after
        if f is None or after is None:
            return {}
        gone = f.code not in {x.code for x in after.findings}
        p = f.predicted if isinstance(f.predicted, Predicted) else None
        peak_before, peak_after = self.report.memory.peak_bytes, after.memory.peak_bytes
        want = p.get("peak_bytes_after") if p is not None else None
        improved = False
        if p is not None and p.get("peak_bytes_delta") and peak_before and peak_after:
            improved = (peak_after - peak_before) <= 0.5 * p["peak_bytes_delta"] < 0
        fb, fa = self.figure(self.report, self.result), self.figure(after, self.after_result)
        if fb is not None and fa is not None and fb > 0:
            improved = improved or fa <= 0.5 * fb
        step_b, step_a = _step_ms(self.report), _step_ms(after)
        # a step-time gain (the GPU rows' overlap): at least half the predicted one measured
        step_p = p.get("step_ms_after") if p is not None else None
        gain_ok = None
        if self.row.gpu_gain and step_p is not None and step_b and step_a and step_b > step_p:
            gain_ok = step_b - step_a >= 0.5 * (step_b - step_p)
        # a warning the before-run did not have at any severity (one there as a note that grew is not the fix's)
        new = (warnings_of(after.findings) - {x.code for x in self.findings} - NOISE - HEADROOM
               - (LOOPBACK if self.row.gpu else frozenset())
               - UNCOVERS.get(f.code, set()))
        return {"gone": gone, "improved": improved, "new_warnings": sorted(new),
                "peak_predicted": want, "peak_measured": peak_after, "peak_at_most": bool(p and (p.get("at_most") or p.get("peak_at_most"))),
                # a ceiling (Predicted.at_most, peak_at_most) holds at or under it
                "peak_ok": None if not want else (peak_after - want <= self.row.peak_within * want
                                                  if p.get("at_most") or p.get("peak_at_most")
                                                  else abs(peak_after - want) <= self.row.peak_within * want),
                "step_ms_predicted": p.get("step_ms_after") if p is not None else None,
                "step_ms_before": step_b, "step_ms_measured": step_a, "gain_ok": gain_ok, "figure": self.row.figure,
                "figure_before": fb, "figure_after": fa}

    def figure(self, report, result: dict) -> Optional[float]:
        key = self.row.figure
        if key is None:
            return None
        if key in result:
            return float(result[key])
        f = next((x for x in report.findings if x.code == self.row.code), None)
        if f is None:
            return 0.0  # the finding is gone: nothing left of its figure
        v = f.evidence.get(key)
        return float(len(v)) if isinstance(v, list) else None if v is None else float(v)


def _step_ms(report) -> Optional[float]:
    try:
        return report.steps.job.p50_ms
    except AttributeError:
        return None


def fix_of(finding) -> Optional[dict]:
    rec = finding.recommendation
    if not rec.code:
        return None
    return {"code": rec.code, "where": rec.where, "inputs": dict(rec.inputs), "finding": finding.code}


def run_matrix(tmp: Path, rows: list[Row] = ROWS, apply: bool = True, device: str = "cpu") -> dict[str, Outcome]:
    """Every row's before-run in one launch, diagnosed; then each planted finding's fix in a second launch. On the
    CPU a row whose rerun's peak misses the prediction runs again, before and after, once (``Outcome.retried``):
    gloo's worker thread frees a finished collective's buffers when the OS schedules it, so on a loaded 2-core host a
    full memory step can count one unit's all-gather output past FSDP's release of it (on an idle host 45 of 400
    all-gather outputs were still alive right after ``wait()`` and the last Python reference's ``del``), and the
    steps replaying that full step repeat it: a peak 145 KiB (one Qwen2 layer) high, a prediction off by 12%. A
    wrong prediction misses twice."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = _before(rows, tmp, device)
    _after([o for o in out.values() if o.fix] if apply else [], tmp, device)
    again = [o.row for o in out.values() if device == "cpu" and o.after is not None and
             o.recheck().get("peak_ok") is False]
    if again:
        redo = _before(again, tmp, device, "_again")
        _after([o for o in redo.values() if o.fix], tmp, device, "_again")
        for o in redo.values():
            first = out[o.row.name].recheck()
            o.retried = (f"peak {first['peak_measured']} B measured against {first['peak_predicted']} B predicted "
                         "the first time")
            out[o.row.name] = o
    return out


def _before(rows: list[Row], tmp: Path, device: str, again: str = "") -> dict[str, Outcome]:
    """The rows' before-runs (in ``tmp/NAME{again}``), diagnosed, each planted finding's fix taken."""
    got = launch_rows(rows, lambda r: r.spec(tmp / (r.name + again), device=device), tmp, "before" + again, device)
    out: dict[str, Outcome] = {}
    for r in rows:
        o = out[r.name] = Outcome(r)
        res = got.get(r.name, {"error": "not run"})
        if "error" in res:
            o.error = res["error"] + "\n" + res.get("traceback", "")
            continue
        o.capacity, o.result = res.get("capacity_bytes"), res
        _, o.report = diagnosis(tmp / (r.name + again))
        if r.code is None:
            continue
        o.finding = at_least(o.findings, r.code, r.min_severity)
        if o.finding is None:
            o.rerun_note = "not found"
        elif not r.apply or not o.finding.recommendation.code:
            o.rerun_note = "no fix code"
        else:
            o.fix = fix_of(o.finding)
    return out


#: what a fix's code says when it compiles kernels on its first steps
COMPILES = ("compile(", "flex_attention")


def _after(fixes: list[Outcome], tmp: Path, device: str, again: str = "") -> None:
    """Reruns each outcome's row with its fix applied (in ``tmp/NAME{again}_fixed``): ``Outcome.after``."""
    # on a GPU a fix that compiles (inductor: torch.compile, or flex_attention's kernel) reruns in a launch of its
    # own: a slow compile costs only its row; a fix for the top of the script (the allocator's settings) too, pasted
    # before the ranks touch the device
    slow = [o for o in fixes if device != "cpu" and any(k in o.fix["code"] for k in COMPILES)]
    startup = [o for o in fixes if o.fix["where"] == "startup"]
    rest = [o for o in fixes if all(o is not x for x in slow + startup)]
    for tag, batch in (("after", rest), ("after_compiled", slow), ("after_startup", startup)):
        if not batch:
            continue
        try:
            of = {o.row.name: o for o in batch}
            got = launch_rows([o.row for o in batch],
                              lambda r: r.spec(tmp / (r.name + again + "_fixed"), of[r.name].fix,
                                               of[r.name].capacity, device), tmp, tag + again, device)
        except Exception as e:  # noqa: BLE001 - the launch failed: each of its rows says so
            got = {o.row.name: {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]} for o in batch}
        for o in batch:
            res = got.get(o.row.name, {"error": "not run"})
            if "error" in res:
                o.after_error = res["error"] + "\n" + res.get("traceback", "")
            else:
                o.after_dir = tmp / (o.row.name + again + "_fixed")
                o.after, o.after_result = diagnosis(o.after_dir)[1], res


# a unit's options that a fix must keep as the user had them, unless its finding is about that option
KEPT_OPTIONS = ("reshard_after_forward", "param_dtype", "reduce_dtype", "offload", "offload_pin_memory")
# (a code or a code's prefix: the options its fix is about)
_MP = {"param_dtype", "reduce_dtype"}
MAY_CHANGE = {"reshard.": {"reshard_after_forward"}, "memory.near_capacity_spread": {"reshard_after_forward"},
              "offload.": {"offload", "offload_pin_memory"}, "numerics.": {"reduce_dtype"}, "precision.": _MP,
              "wrap.mixed_dtype_unit": _MP, "optim.state_dominates": _MP, "comm.bound": _MP}


def about(code: str) -> set[str]:
    """The unit options a finding's fix is about (MAY_CHANGE)."""
    return set().union(*(v for k, v in MAY_CHANGE.items() if code.startswith(k)))


def _switched(o: Outcome) -> list[tuple[str, str, object, object]]:
    """(unit, option, before, after) for each of KEPT_OPTIONS the fix changed on the units its before-run and rerun
    share (by name; the root aside)."""
    if o.report is None or o.after is None or o.finding is None:
        return []
    before = {u.name: u for u in o.report.units or [] if not u.is_root}
    return [(u.name, k, getattr(before[u.name], k, None), getattr(u, k, None))
            for u in o.after.units or [] if u.name in before for k in KEPT_OPTIONS
            if getattr(before[u.name], k, None) != getattr(u, k, None)]


def changed_options(o: Outcome) -> list[str]:
    """The options a fix changed, that its finding is not about, on the units its before-run and rerun share
    (by name; the root aside): ``unit: option before -> after``; and the optimizer's parameter groups (their sizes
    and hyper-parameters)."""
    if o.report is None or o.after is None or o.finding is None:
        return []
    allowed = about(o.finding.code)
    out = [f"{name}: {k} {b!r} -> {a!r}" for name, k, b, a in _switched(o) if k not in allowed]
    groups = [[(g.params, g.options) for g in (rep.run.optimizer_groups or [])] for rep in (o.report, o.after)]
    if groups[0] != groups[1] and "optimizer" not in allowed:  # a fix keeps the user's optimizer groups too
        out.append(f"optimizer groups {groups[0]} -> {groups[1]}")
    return out


def undone(o: Outcome) -> list[str]:
    """Findings of the rerun that ask to change again what the fix changed: a finding about an option (MAY_CHANGE)
    the fix switched, naming a unit it switched it on. Two rules that send the user back and forth (a new-user
    trial: memory.near_capacity_spread resharded the last unit of forward, reshard.last_unit asked for it back)."""
    rerun = o.after.findings if o.after is not None else []
    return [f"{h.code} asks for {name}'s {k} again (the fix: {b!r} -> {a!r})" for name, k, b, a in _switched(o)
            for h in rerun if k in about(h.code) and name in (h.units or [])]


def problems(o: Outcome) -> list[str]:
    """What a row's runs show wrong, as tests/test_scenario_matrix.py checks a row (empty: it passes): it ran, its
    finding found at its severity (a tuned baseline: no warning), its fix rerun without a new warning nor a finding
    that asks to undo it, the finding gone or its figure improved (a GPU gain: half the predicted step time saved),
    the peak as predicted."""
    r = o.row
    if o.error:
        return ["did not run: " + o.error.splitlines()[0]]
    if r.code is None:
        extra = sorted(warnings_of(o.findings) - baseline_exempt(r))
        return [f"warnings on a tuned baseline: {', '.join(extra)}"] if extra else []
    if o.finding is None:
        return [f"{r.code} not found at {r.min_severity} or above"]
    if not r.apply:
        return []
    if not o.fix:
        return [f"{r.code} prints no code"]
    if o.after_error:
        return ["the fix's rerun failed: " + o.after_error.splitlines()[0]]
    rc, out = o.recheck(), []
    if rc["new_warnings"]:
        out.append(f"new warnings after the fix: {', '.join(rc['new_warnings'])}")
    changed = changed_options(o)
    if changed:
        out.append(f"the fix changed options it is not about: {'; '.join(changed)}")
    if back := undone(o):
        out.append(f"the rerun asks to undo the fix: {'; '.join(back)}")
    if r.gpu_gain and rc["gain_ok"] is False:
        out.append(f"step {rc['step_ms_before']:.1f} -> {rc['step_ms_measured']:.1f} ms, predicted "
                   f"{rc['step_ms_predicted']:.1f} ms: under half the predicted gain")
    if (not r.gpu_gain or r.figure) and not (rc["gone"] or rc["improved"]):
        out.append(f"{r.code} neither gone nor improved after the fix")
    if rc["peak_ok"] is False:
        out.append(f"peak {rc['peak_measured'] / MiB:.1f} MiB, predicted {rc['peak_predicted'] / MiB:.1f} MiB (> 10% off)")
    return out
