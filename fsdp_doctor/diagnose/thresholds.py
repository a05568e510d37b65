"""Thresholds and assumptions that more than one rule reads, in one place (a rule's own thresholds stay beside
it). Shares are fractions; times ms; sizes bytes."""

# Memory: a peak at or above this share of capacity is "near capacity" (the CUDA caching allocator rarely runs
# cleanly above ~90%; this leaves room for fragmentation); a recommendation aims to bring the peak below it.
NEAR_CAPACITY_SHARE = 0.85
# A recommendation that spends memory for time (ZeRO-2 on a unit, checkpointing fewer units, parameters kept
# gathered between micro-batches) keeps the predicted peak below this share of capacity: room for fragmentation
# and the allocator's cache, under where activation checkpointing is recommended (so that no such fix makes a
# case for it) ...
HEADROOM_MAX_SHARE = 0.80
# ... and is worth a finding when it saves at least this share of the step, a warning from this share on.
HEADROOM_MIN_GAIN_SHARE = 0.02
HEADROOM_WARN_GAIN_SHARE = 0.10
# A change whose gain is memory only (on gloo a coarse unit split into blocks; a module of the root's made a unit
# of its own) gains nothing under this share of the step's peak.
MEMORY_ONLY_MIN_PEAK_SHARE = 0.01
# Leftovers: a module of the root's (a position embedding, a final norm) that a sharding plan would make a unit of its
# own where the root stays gathered anyway (it keeps tied modules: an embedding sharing its weight with the head)
# gains memory only, at most its gathered copy, which the root held through the step, and costs the unit's
# collectives: an all-gather in forward and in backward (not for the trailing unit, kept gathered after forward) and
# a reduce-scatter, each at the run's own cost per call. It becomes a unit where what it frees is at least
# MEMORY_ONLY_MIN_PEAK_SHARE of the peak and at least this many times the share of the step its collectives add:
# a share of the peak for no larger share of the step, so that peak x step (the memory-time a step holds) does not
# grow. (GPT-2's wpe, beside its tied wte and lm_head: a unit of its own cost 6.3 ms of exposed reduce-scatter a
# step on gloo for at most its 64 KiB gathered copy, 1.2% of the peak: a new-user trial; the tiny GPT-2 as one unit,
# 2 gloo ranks, its plan pasted with wpe a unit and without: step 49.9 -> 43.3 ms, median of 7 runs each, peak
# +16 KiB, 0.5%. On the real GPT-2 wpe is 3 MiB beside a multi-GiB peak.)
LEFTOVER_PEAK_SHARE_PER_STEP_SHARE = 1.0
# A memory category "dominates" the peak from this share on (activations, optimizer state, sharded state).
DOMINANT_CATEGORY_SHARE = 0.40

# Collectives: all-gathers whose median message is below this are latency-bound (NCCL reaches its bus
# bandwidth only from a few MiB on); a plan of fewer, larger units groups at most this many consecutive blocks per
# unit (estimate.grouped_plan: fewer where a group's all-gather reaches SMALL_MAX_MEDIAN_BYTES sooner, or where
# the limits below bind), paying one call's latency instead of one per block.
SMALL_MAX_MEDIAN_BYTES = 4 << 20
GROUP_FACTOR = 4
# Wrapping: one unit holding at least this share of all parameters gathers most of the model at once
# (wrap.too_coarse fires from it); a grouped plan keeps every group under it.
COARSE_SHARE_MIN = 0.5
# ... and a grouped plan keeps at least this many units per block container (all of its blocks when it has
# fewer): FSDP overlaps each unit's all-gather with the previous unit's compute only, so with fewer units most
# of the gathering has nothing before it (on the 2-rank H100 GPT of 4 blocks, all four in one unit made
# wrap.too_coarse fire on the rerun).
MIN_BLOCK_UNITS = 4

# Share of an exposed all-gather that explicit prefetching hides: on a GPU all of it (a separate stream); on
# gloo none (the copies share the cores with compute; the host blocks in every all-gather).
PREFETCH_OVERLAP_GPU = 1.0
PREFETCH_OVERLAP_CPU = 0.0

# Verdicts: a step whose largest group (communication, host, input, idle) takes at least this share is bound
# by it, and a "severe" one from SEVERE_BOUND_SHARE on.
BOUND_MIN_SHARE = 0.25
SEVERE_BOUND_SHARE = 0.50

# A rank whose own time (step minus exposed communication) exceeds the median of the others' by this share and at
# least this long is a straggler: the other ranks wait for it inside their collectives (estimate.trace_straggler:
# straggler.trace, and the trace's exposed collectives read from the straggler's own), in most of the profiled steps
# (estimate._unsteady: the records' STRAGGLER_MIN_CONSISTENCY)
TRACE_STRAGGLER_MIN_FRACTION = 0.15
TRACE_STRAGGLER_MIN_MS = 0.5

# this many steps in a row or more, and no others, before the run's last, are one stretch that slowed and recovered,
# not work done every few steps (jitter.recurring_outside, straggler.intermittent; two in a row can be one save that
# spans a step boundary)
STRETCH_MIN_STEPS = 3

# torch's optimizers whose fused implementation (fused=True: one kernel per step on CUDA and, from torch 2.4, the
# CPU) runs on FSDP2's DTensor parameters: DTensor has a sharding rule for Adam's and AdamW's fused kernels only
# (torch 2.6 - 2.15, torch/distributed/tensor/_ops/_pointwise_ops.py); SGD's and Adagrad's raise (2.13 - 2.15:
# "aten._fused_sgd_.default does not have a sharding strategy registered"; 2.6: "found no DeviceMesh")
FUSED_OPTIMIZERS = ("Adam", "AdamW")
UNFUSABLE_OPTIMIZERS = ("SGD", "Adagrad")  # fused in torch, not on DTensor parameters

# What Adam's and AdamW's step costs on one CPU thread (torchrun's OMP_NUM_THREADS=1) over FSDP2's sharded DTensor
# parameters, by implementation: (ns per element, us per tensor), fitted on this project's CPU VM from 400 tensors of
# 256 elements and 20 of 1 M (benchmarks/cpu_optimizer_cost.py fits them again). The loop dispatches every operator
# of the update once per tensor, each a DTensor dispatch; foreach once per operator for all of them, with an
# intermediate per operator; fused makes one call. Their ratios scale a step's measured time (optim.unfused_step: the
# fused step from the loop's; offload.recommended: the host's step in the implementation it would take from the
# loop's per-element figure), so that the host's speed cancels (the same VM looped at 5.0 and 8.05 ns per element in
# two sessions)
CPU_STEP_COST = {"for-loop": (4.55, 119.5), "foreach": (3.92, 31.8), "fused": (1.24, 20.6)}
