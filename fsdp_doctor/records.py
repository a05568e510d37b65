"""The one record model shared by the live recorder and every reader.

A run directory written by :func:`fsdp_doctor.watch` holds::

    manifest.json                       the run manifest (format name and version, world size, files)
    rank{R}.records.jsonl               one append-only record stream per rank (JSON lines)
    profiler/rank{R}.{step}.pt.trace.json.gz   Kineto traces of the profiled windows (TensorBoard layout)

Each line of a record stream is one of the tagged structs below (field ``"t"`` names the type). Lines
are written whole and flushed at the end of each step, so a run killed at any point (even SIGKILL)
leaves every completed step readable; a reader ignores a final line cut short. Readers accept any
stream whose ``Header.version`` is ``<= FORMAT_VERSION``; new optional fields may be added within a
version, renames or removals bump it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

import msgspec

FORMAT_NAME = "fsdp-doctor-run"
FORMAT_VERSION = 1
# The run directory's layout is known by one module, fsdp_doctor.store.layout; re-exported for the writers.
from .store.layout import MANIFEST_NAME, PROFILER_DIR, stream_name  # noqa: E402,F401


class Record(msgspec.Struct, tag_field="t", kw_only=True, omit_defaults=True):
    """Base of every record: the rank that wrote it."""

    rank: int


class Header(Record, tag="header"):
    """First line of each stream."""

    # FORMAT_NAME and FORMAT_VERSION, written by the recorder; None: a file written before they were (as defaults,
    # omitted: a later reader would have read them as its own version), read as version 1 (store.reader)
    format: str | None = None
    version: int | None = None
    world_size: int = 1
    pid: int = 0
    host: str = ""
    started_ns: int = 0  # time.time_ns() at watch() entry
    doctor_version: str = ""
    run_id: str = ""  # the same on every rank of one run and in its manifest ("" in files written before it)


class UnitConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Configuration snapshot of one FSDP unit (one FSDPState; a grouped unit is one unit)."""

    name: str  # FSDP's own module fqn for the unit ("" for the root, "norm, lm_head" for a group)
    modules: list[str]  # fqns of the modules the unit was applied to
    # their classes, the user's (LlamaDecoderLayer, not the FSDP subclass), in the same order: what an auto-wrap
    # policy by class (accelerate's plugin over _no_split_modules) matched; [] in runs recorded before it
    module_classes: list[str] = []
    is_root: bool
    # None wherever this torch's FSDP internals could not be read ("unknown"; RunConfig.notes says why)
    param_count: int | None  # elements of the model's parameters (global: with tensor parallelism more than FSDP
    # gathers, which unsharded_bytes counts)
    n_params: int | None  # number of parameter tensors
    sharded_bytes: int | None  # this rank's local shards, padding included
    unsharded_bytes: int | None  # bytes when all-gathered (in param_dtype)
    # of those, the trainable parameters' (requires_grad): what has gradients, reduce-scatters and optimizer state
    # (a fine-tuning run's frozen base has none); None: not read (a run recorded before these fields: all of them)
    trainable_sharded_bytes: int | None = None
    trainable_unsharded_bytes: int | None = None
    orig_dtypes: list[str]  # distinct dtypes of the unit's parameters
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    reshard_after_forward: Union[bool, int, None] = True
    forward_prefetch: list[str] | None = []
    backward_prefetch: list[str] | None = []
    unshard_async_op: bool | None = False
    # False: set_unshard_in_backward(False), FSDP2 never all-gathers the unit in backward (its parameters needed in
    # forward only, an embedding's): kept gathered it would hold them for nothing (a run recorded before: True)
    unshard_in_backward: bool | None = True
    offload: str | None = None  # "cpu" when CPUOffloadPolicy is set
    offload_pin_memory: bool | None = None
    checkpoint: str = "none"  # "none" | "unit" (AC wraps the unit) | "children" | "partial"
    # fqns of the CheckpointWrappers in the unit (the unit itself, or inside it), else the one around it (a unit
    # applied to the wrapper's inner module, as accelerate's FSDP2 plugin does)
    checkpoint_wrappers: list[str] = []
    # the unit's module carries its own checkpointing switch, ``gradient_checkpointing`` on (transformers' decoder
    # layers, GradientCheckpointingLayer, checkpoint themselves while it is set): turned off there, that unit alone
    # stops checkpointing
    checkpoint_flag: bool = False
    # its checkpointing is selective (a policy saves some operators' outputs, torch's
    # create_selective_checkpoint_contexts: torchtitan's default): its recompute re-runs only the others
    checkpoint_selective: bool = False
    # fqns of its modules (nested units' excluded) that update running statistics in training (BatchNorm, SyncBatchNorm,
    # InstanceNorm with track_running_stats): a checkpoint's recompute runs them in training mode again, updating their
    # statistics twice per step
    running_stats_modules: list[str] = []
    param_groups: int | None = 1
    depth: int = 0  # nesting depth among units (root 0)
    # the unit runs inside a compiled frame (a module compiled in place, ``module.compile()``, or the module of
    # ``torch.compile(module)``'s wrapper) that the doctor does not time around: it puts none of its hooks on the unit
    # (they would return at once there, and Dynamo compiled them as frames of their own), so the doctor's own timings
    # of it are not recorded (but see fsdp_hooks_timed)
    compiled_in_place: bool = False
    # the unit is compiled in place itself (``module.compile()``) and timed around its compiled call: its forward,
    # backward and backward all-gather wait are recorded; its forward's all-gather wait is inside the compiled frame,
    # within its forward (not known apart)
    compiled_call_timed: bool = False
    # of the units compiled in place (compiled_in_place): timed from FSDP2's own pre/post-forward and pre/post-backward
    # logs, which FSDP2's hooks write outside compiled code (Dynamo does not trace them): their forward and backward
    # are recorded, each with its all-gather wait inside it (not known apart); False: not timed (records before this
    # field, a compiled frame the doctor was not given)
    fsdp_hooks_timed: bool = False
    # methods of the unit's module that register_fsdp_forward_method made forward methods (a score() calling
    # self.forward): timed as its forward by the doctor, whose hooks inside FSDP's pre-forward they do not run: the
    # forward's all-gather wait is within its forward (not known apart)
    forward_methods: list[str] = []
    # the dims other than 0 its parameters are sharded on (a shard_placement_fn returning Shard(1)): a plan of
    # fully_shard calls passes the user's function again
    shard_dims: list[int] = []
    parent: str | None = None  # name of the enclosing unit
    # the modules holding this unit's own parameters (nested units' excluded), fqns: what fix snippets name
    # (the root's embeddings, final norm and head; a whole-model unit's blocks)
    own_modules: list[str] = []
    # bytes of each own module's parameters as FSDP gathers them (with tensor parallelism this rank's tensor-parallel
    # shard), in their stored dtype
    own_bytes: list[int] = []
    # of those, modules sharing a parameter with another module (a tied embedding and output head)
    tied_modules: list[str] = []
    # of those, modules none of whose own parameters requires a gradient (a frozen feature encoder's convolutions):
    # a plan that makes units of them knows which never train; None: not recorded (runs before it)
    frozen_modules: list[str] | None = None
    # of those, modules whose parameters the first step read outside their own forward, or whose forward it never ran
    # (a GPT's logits read the embedding's weight, F.linear(h, wte.weight); DeBERTa's encoder reads
    # rel_embeddings.weight; or unused): a unit of their own would not be gathered where they are read (torch's "mixed
    # torch.Tensor and DTensor"), so a plan keeps them in the root; None: not watched (a compiled model, a unit with a
    # CheckpointWrapper inside, runs before it); in a process that called torch.compile, the reads are not looked at
    # (record/param_reads.compile_used): only modules whose forward never ran
    read_outside_modules: list[str] | None = None
    # of those, the ones before the unit's first nested unit in module order (a model's embeddings); None: not
    # recorded (runs before it, whose trailing_modules read [] where no own module came before the last nested unit)
    leading_modules: list[str] | None = None
    # of those, the ones after the unit's last nested unit in module order (a model's final norm and head)
    trailing_modules: list[str] = []
    # modules of its own tree (nested units' subtrees excluded) holding own modules but no forward of their own (a
    # ModuleList, a ModuleDict: diffusers' ``mid_block.attentions``), which fully_shard refuses ("does not support
    # containers that do not implement forward"): a plan makes units of what they hold, never of them; None: not
    # recorded (runs before it)
    no_forward_modules: list[str] | None = None
    # ranks FSDP shards each parameter over (1: nothing to all-gather, e.g. the shard dimension of a 2x1 HSDP
    # mesh; tensor-parallel shards not counted); None: not read
    shard_size: int | None = None

    #: what a reader assumes for the fields every snapshot writes, where a report row lacks one or has None
    READER_DEFAULTS: ClassVar[dict[str, Any]] = {
        "modules": [], "is_root": False, "param_count": 0, "n_params": 0, "sharded_bytes": 0, "unsharded_bytes": 0,
        "orig_dtypes": []}


def unit_defaults() -> dict[str, Any]:
    """Every :class:`UnitConfig` field's default, the one source of them: the struct's own defaults plus
    ``READER_DEFAULTS`` for the fields without one (the unit's name aside)."""
    out: dict[str, Any] = {}
    for f in msgspec.structs.fields(UnitConfig):
        if f.default is not msgspec.NODEFAULT:
            out[f.name] = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            out[f.name] = f.default_factory()
    out.update(UnitConfig.READER_DEFAULTS)
    return out


def counted_op_by_op(s: StepRecord) -> bool:
    """The step's memory was counted op by op (the high-water's dispatch mode): its time holds the doctor's cost."""
    return s.memory is not None and s.memory.transients == "exact"


def collective_wait_ms(s: StepRecord) -> float:
    """Time the rank's host spent waiting for all-gathers in this step (forward and backward). Each unit's
    wait covers only its own unshard (nested units are timed separately), so the sum does not double count."""
    return sum(u.ag_wait_fwd_ms + u.ag_wait_bwd_ms for u in s.units)


def doctor_step(s: StepRecord) -> bool:
    """The step holds the doctor's own work, which the step statistics leave out: a profiler window (or a FLOP
    count) or a memory count op by op."""
    return bool(s.profiled) or counted_op_by_op(s)


#: how the line starts that a run says when the model's forward ran in a compiled frame the doctor was not given
#: (record/config_snapshot.FRAME_UNSEEN): a note on how it was measured, which records before that listed among the
#: figures torch did not let it read (RunConfig.unavailable: a problem, exit 3)
FRAME_UNSEEN_START = "the model's forward runs in a compiled frame the doctor was not given"


def config_notes(cfg: RunConfig) -> list[str]:
    """A configuration's notes on how the run was measured (``measured_notes``, and the FRAME_UNSEEN line that older
    records listed in ``unavailable``)."""
    return [*(n for n in cfg.unavailable if n.startswith(FRAME_UNSEEN_START)), *cfg.measured_notes]


def optimizer_model_params(cfg: RunConfig) -> int:
    """The watched model's parameter tensors the optimizer given to watch() holds (0: none, or no optimizer)."""
    return max(0, cfg.optimizer_params - cfg.optimizer_foreign_params - cfg.optimizer_other_params)


def optimizer_of_another_model(cfg: RunConfig) -> str:
    """Where the optimizer given to watch() holds another FSDP2 model's parameters (RunConfig.optimizer_other_params):
    one sentence saying so, for the log at watch() and the report's header; "" where it holds none. Holding none of
    the watched model's own (a distillation's frozen teacher watched with its student's AdamW, a new-user trial: its
    memory table put the student's 259 KiB of Adam state beside the teacher's 195 KiB of parameters, with no word)
    the optimizer's figures and rules are another model's; holding both (one optimizer over a GAN's two networks) its
    step updates both."""
    other = cfg.optimizer_other_params
    if not other:
        return ""
    from .units import fmt_bytes

    own = optimizer_model_params(cfg)
    name = cfg.optimizer or "the optimizer"
    size = f"{fmt_bytes(cfg.optimizer_other_bytes)} per rank"
    if own <= 0:
        return (f"the optimizer given to watch() ({name}) holds none of the watched model's parameters: its {other} "
                f"parameter tensor(s) ({size}) are another FSDP2 model's; "
                "its state is not counted in this model's memory, its step is that model's update, and the rules "
                "on the optimizer are skipped. Give watch() the model this optimizer trains, with it (README: loops "
                "with more than one model)")
    return (f"the optimizer given to watch() ({name}) holds {other} parameter tensor(s) of another FSDP2 model "
            f"({size}) beside {own} of the watched model's: its step updates both models, and both models' state is "
            "this model's optimizer state in the memory figures")


def config_unavailable(cfg: RunConfig) -> list[str]:
    """A configuration's ``unavailable`` lines that are problems (what torch did not let the recorder read)."""
    return [n for n in cfg.unavailable if not n.startswith(FRAME_UNSEEN_START)]


def runs_compiled(u) -> bool:
    """Whether a unit (its snapshot, UnitConfig, or a report's UnitRow made from it) runs in a frame torch.compile
    compiled: compiled in place (its hooks inside the frame, untimed) or timed around its compiled call."""
    return bool(getattr(u, "compiled_in_place", False) or getattr(u, "compiled_call_timed", False))


def offloads_params(cfg) -> bool:
    """Whether some unit with parameters of a run (its RunConfig) keeps them in host memory (CPUOffloadPolicy): its
    optimizer steps those shards on the CPU."""
    return any(u.offload and u.param_count for u in getattr(cfg, "units", None) or [])


class OptimizerGroup(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One of the optimizer's parameter groups: how many tensors, and its numeric hyper-parameters."""

    params: int  # parameter tensors in the group
    options: dict[str, Union[float, list[float]]] = {}  # lr, weight_decay, betas, ...: numbers only
    # the implementation switches the group holds, as it holds them ("foreach", "fused": True, False or None, torch's
    # default for the device); {}: none (an optimizer without them, not torch's own Adam, AdamW, SGD or Adagrad; or
    # records before this field)
    flags: dict[str, Optional[bool]] = {}


class Experts(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A mixture of experts' routed experts, read from the module tree at the first step: the parameters under
    every child module named ``experts`` (Hugging Face's Mixtral, Qwen2-MoE, OLMoE, DeepSeek, ...; torchtitan's
    MoE; torchtitan 0.3's ``routed_experts``), and how many of them each token runs. Shared experts, routers and
    the rest of the model are dense."""

    param_count: int  # every routed expert's parameters, all layers (DTensor numel: global)
    trainable_param_count: int = 0  # of those, the requires_grad ones
    grad_path_param_count: int = 0  # of those, the ones from the model's first trainable parameter on
    # experts each token is routed to, of num_experts per layer; None: not readable, or not the same in every layer
    top_k: int | None = None
    num_experts: int | None = None
    # the experts' parameters' device mesh (dim -> size) where it is not the other parameters' (expert parallelism:
    # torchtitan's efsdp x ep); {}: the same mesh, or not read
    mesh: dict[str, int] = {}

    def share(self) -> float:
        """The share of the expert parameters one token runs: top_k / num_experts (1: unknown, every expert)."""
        return min(self.top_k, self.num_experts) / self.num_experts if self.top_k and self.num_experts else 1.0


# RunConfig.driver of a run a Hugging Face Trainer drove (fsdp_doctor.DoctorCallback): the diagnosis then writes
# its fixes as Trainer callbacks (diagnose/snippets.for_trainer)
TRAINER_DRIVER = "transformers.Trainer"
# RunConfig.driver of a run torchtitan's own Trainer drove (python -m fsdp_doctor.titan): its loop is torchtitan's,
# so a fix goes on its command line (or a Trainer subclass of the user's), never into a loop the user does not write
TITAN_DRIVER = "torchtitan.Trainer"
# RunConfig.driver of a run OLMo-core's Trainer drove (fsdp_doctor.olmo.DoctorCallback): its loop is its train
# module's and its sharding its TransformerDataParallelConfig's, so a fix goes into the configs the user builds them
# from, or after the train module is built (diagnose/snippets.for_olmo)
OLMO_DRIVER = "olmo_core.Trainer"
# RunConfig.driver of a run PyTorch Lightning's Trainer drove (the watched model a LightningModule attached to one):
# a loop fix goes into its training_step, the last micro-batch said from the Trainer's accumulate_grad_batches
# (diagnose/snippets.for_lightning)
LIGHTNING_DRIVER = "lightning.Trainer"
# RunConfig.driver of a run one of torchtune's recipes drove (watch() called in a method of its recipe class, which
# `tune cp` gives the user to edit): its loop and its _setup_model are the recipe's, the sharding its config's
# (training.shard_model: custom_sharded_layers, fsdp_reshard_after_forward); RunConfig.recipe names the file
# (diagnose/snippets.for_torchtune)
TORCHTUNE_DRIVER = "torchtune.recipe"
# RunConfig.sharded_by of a model accelerate's prepare() sharded (its FSDP2 plugin; the Trainer's runs too)
ACCELERATE_SHARDER = "accelerate"
# RunConfig.sharded_by of a model Hugging Face transformers sharded itself (from_pretrained(...,
# distributed_config=DistributedConfig(fsdp_size=...)): its fsdp_plan cut the units, by module-name pattern)
TRANSFORMERS_SHARDER = "transformers"
# RunConfig.sharded_by of a torchtitan model (its parallelize function sharded it from the job's config, whose
# settings a fix changes: its command line; RunConfig.sharder_version says which torchtitan)
TORCHTITAN_SHARDER = "torchtitan"
#: RunConfig.torch_lacks' entry for a release whose FSDPModule has no public set_reshard_after_forward (torch 2.6)
SET_RESHARD_AFTER_FORWARD = "FSDPModule.set_reshard_after_forward"
#: FSDPModule's own methods (torch 2.13; tests/test_snippets_root_calls.py holds it to the installed torch): what a fix
#: calls on the root unit (diagnose/snippets.on_root_unit), kept here as data so that the diagnosis imports no torch
FSDP_MODULE_METHODS = frozenset({
    "_set_unshard_async_op", "reset_iter_state", "reshard", "set_all_reduce_hook",
    "set_allocate_memory_from_process_group_for_comm", "set_custom_all_gather", "set_custom_reduce_scatter",
    "set_force_sum_reduction_for_comms", "set_gradient_divide_factor", "set_is_last_backward",
    "set_modules_to_backward_prefetch", "set_modules_to_forward_prefetch", "set_post_optim_event",
    "set_reduce_scatter_divide_factor", "set_reduce_scatter_max_input_buffers", "set_reduce_scatter_unused_params",
    "set_requires_all_reduce", "set_requires_gradient_sync", "set_reshard_after_backward", "set_reshard_after_forward",
    "set_separate_reduce_scatter_group", "set_symm_mem_for_comm", "set_unshard_in_backward", "unshard"})


#: the environment variables the CUDA caching allocator reads its settings from (the second: newer torch's name)
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


class Untrained(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Trainable parameters (``requires_grad``) that the optimizer given to ``watch()`` does not hold (read at the
    first step's end): their gradients are computed, reduce-scattered and kept for nothing, unless something else
    updates them (``changed``)."""

    tensors: int  # parameter tensors
    param_count: int  # their elements (DTensor numel: global)
    with_grad: int = 0  # of the tensors, those holding a gradient at the first step's end (after the loop's zero_grad)
    grad_bytes: int = 0  # this rank's bytes of those gradients (shards): the optimizer's zero_grad never frees them
    names: list[str] = []  # their names in the model (the first 20)
    # FSDP unit -> [elements outside the optimizer, elements it holds], over the unit's trainable parameters
    units: dict[str, list[int]] = {}
    # the modules holding the parameters the optimizer trains in those units that hold some outside it too (fqns: a
    # ResNet's head `fc` in the root beside its frozen-to-be stem `conv1`, `bn1`); None: not recorded (older runs)
    trained_modules: list[str] | None = None
    # whether their values changed between the first step's end and the third's (another optimizer, or the loop,
    # updates them); None: not checked (the run ended sooner)
    changed: bool | None = None


class AccelerateAccumulation(msgspec.Struct, kw_only=True, omit_defaults=True):
    """accelerate's gradient accumulation where its prepare() sharded the model in the user's loop: what decides
    whether ``accelerator.accumulate(model)`` turns FSDP2's gradient sync off on all but the last micro-batch (its
    GradientState and AcceleratorState, read as the config is written)."""

    # gradient_accumulation_steps: accumulate() syncs on every num_steps-th call only (1, its default: on every call)
    num_steps: int = 1
    # GradientAccumulationPlugin(sync_each_batch=True): accumulate() leaves gradient sync on in every micro-batch
    # (less memory: the gradients are reduce-scattered to shards each time)
    sync_each_batch: bool = False
    # accelerate's distributed type then ("FSDP"; under another, its no_sync looks for DDP's no_sync, which an FSDP2
    # model lacks, and leaves gradient sync on); "": not read
    distributed_type: str = ""
    # backward passes through the model so far that began with accelerate's sync_gradients off: accumulate() on a
    # micro-batch before the last of its num_steps (0: the loop does not enter accumulate(), or num_steps is 1)
    unsynced_backwards: int = 0


class CompiledModule(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A module whose forward torch.compile compiles as a frame of its own: compiled in place (``module.compile()``)
    or wrapped (``torch.compile(module)``), the outermost such (one inside another is traced in that one's frame). The
    code Dynamo keys its cache on is its forward's: ``function`` at ``file``:``line``, which every module of its class
    shares (Hugging Face's decoder layers share transformers' ``forward_with_checkpointing`` across classes)."""

    name: str  # its fqn in the watched model ("" for the model itself)
    cls: str  # its class, the user's (not the FSDP subclass fully_shard makes: LlamaDecoderLayer)
    function: str = ""  # its forward's code: name, file, first line ("": not a Python function)
    file: str = ""
    line: int = 0


class RecompileLimit(msgspec.Struct, kw_only=True, omit_defaults=True):
    """torch.compile's Dynamo gave up compiling a frame at its recompile limit (its one warning, "torch._dynamo hit
    config.recompile_limit (8)"): that code runs eagerly wherever its cache has no matching entry, from then on."""

    limit_type: str  # the config it hit, this torch's name: "recompile_limit" (2.6: "cache_size_limit"), or the
    # accumulated one ("accumulated_recompile_limit")
    limit: int | None = None  # its value then
    function: str = ""  # the code object: name, file, first line ("": not read, Dynamo's warning not seen)
    file: str = ""
    line: int = 0
    reason: str = ""  # the last guard that failed (Dynamo's "last reason", its first line)
    # the unit compiled in place whose compiled call was running (the module that could not compile): its name;
    # "" where none of the units the doctor times around their compiled call was
    module: str = ""


class RunConfig(Record, tag="config"):
    """Written once per rank at the first step."""

    world_size: int
    backend: str
    device: str  # "cpu" or "cuda:N"
    device_name: str = ""
    torch_version: str = ""
    optimizer: str | None = None
    optimizer_params: int = 0  # parameter tensors held by the optimizer
    optimizer_foreign_params: int = 0  # of those, tensors that are not the model's parameters
    optimizer_foreign_bytes: int = 0
    # of the optimizer's tensors, another FSDP2 model's parameters (sharded, outside the watched model: a student's,
    # where its frozen teacher is watched with the student's optimizer; a GAN's other network under one optimizer),
    # and their local bytes
    optimizer_other_params: int = 0
    optimizer_other_bytes: int = 0
    optimizer_groups: list[OptimizerGroup] = []  # its parameter groups, in order ([]: not read)
    # per-parameter optimizers stepped inside the backward (torchtune's optimizer_in_bwd), how many; 0: the optimizer
    # steps after the backward. Their state is the optimizer state, their time the optimizer's, out of the backward's
    optimizer_in_backward: int = 0
    # a Hugging Face model's attention implementation ("eager", "sdpa", ...) where the model can switch it
    # (``set_attn_implementation``); None for any other model, or an older transformers without that method
    attn_implementation: str | None = None
    # of "sdpa", "flex_attention", "flash_attention_2", those such a model says it can switch to (its class's
    # _supports_sdpa / _supports_flex_attn / _supports_flash_attn flags: Gemma2, whose attention soft-caps its
    # scores, has no sdpa); None: not such a model, or no flag read (a run recorded before this field)
    attn_implementations: list[str] | None = None
    # a Hugging Face model's _no_split_modules: the class names of its blocks (LlamaDecoderLayer), which
    # accelerate's transformer-based wrap policy shards one by one (what a plugin wrap fix names); None: none
    no_split_modules: list[str] | None = None
    # transformers' layers that checkpoint their own forward (GradientCheckpointingLayer, ``gradient_checkpointing``
    # on), fqns in module order: whole blocks of the model, checkpointed as such however they sit in the units (a
    # unit holding them checkpoints at their granularity). ``gradient_checkpointing_enable()`` switches a Swin's
    # stages and the blocks inside them alike: each block's forward runs three times a step (its forward, its
    # stage's recompute, its own), ac.nested's case; None: not recorded (runs before it)
    checkpoint_layers: list[str] | None = None
    # a Hugging Face config under the model with use_cache on (a decoder that fills its KV cache in a training forward
    # where its own checkpointing is off, which a checkpointing fix then turns off); None: a run recorded before this
    # field
    kv_cache: bool | None = None
    # a Hugging Face vision-language model's vision_feature_layer (its config's, on the watched model: the vision
    # tower's hidden state its projector takes, -2 for Llava's: the layers after it run for no output); None: none,
    # or not one layer
    vision_feature_layer: int | None = None
    # what drove the training loop when not the user's own code: TRAINER_DRIVER (fsdp_doctor.DoctorCallback),
    # TITAN_DRIVER, LIGHTNING_DRIVER, TORCHTUNE_DRIVER
    driver: str | None = None
    # the class of the arguments a Hugging Face Trainer ran with (TRAINER_DRIVER), its package and name:
    # "transformers.TrainingArguments", or a library's Trainer's own ("trl.SFTConfig": TRL's SFTTrainer, whose
    # compute_loss gathers its metrics at every micro-batch); None: no such Trainer, or a run recorded before this field
    trainer_args: str | None = None
    # Lightning's Trainer's accumulate_grad_batches where it drove the run (LIGHTNING_DRIVER): it steps the optimizer
    # on every such batch and on the epoch's last; None: not such a run, or a run recorded before this field
    lightning_accumulate: int | None = None
    # the file of the torchtune recipe that drove the run (TORCHTUNE_DRIVER: its recipe class's source file, the user's
    # copy from `tune cp` or torchtune's own); None: not such a run, or a run recorded before this field
    recipe: str | None = None
    # what its train() all-reduces at each optimizer step (the tensors as written, in order: num_tokens, running_loss)
    # and the one of them its gradient scaling divides by (None: none, or its source not read)
    recipe_reduced: list[str] = []
    recipe_scaled_by: str | None = None
    # whether its setup passes the config's custom_sharded_layers to the _setup_model that builds the watched model
    # (torchtune 0.6.1's knowledge distillation passes it to its teacher's only); None: not read
    recipe_custom_layers: bool | None = None
    # names its train() binds to a forward's returns and never reads (DPO's reference forward's `_`, holding its logits)
    recipe_unread: list[str] = []
    # the watched model's num_output_chunks where above 1 (torchtune's TransformerDecoder, set by its recipes for
    # CEWithChunkedOutputLoss): it calls its output head once per chunk of the sequence, a count that can differ
    # between ranks (a unit of that head's own would issue its collectives per call); None: not chunked, or not read
    output_chunks: int | None = None
    # what sharded the model when not the user's own fully_shard calls: ACCELERATE_SHARDER (accelerator.prepare,
    # whose FSDP2 plugin holds the settings a fix changes: checkpointing, the mixed-precision policy),
    # TORCHTITAN_SHARDER (a torchtitan model: its job config holds them)
    sharded_by: str | None = None
    sharder_version: str | None = None  # that sharder's version (torchtitan's, whose command line changes with it)
    # accelerate's FSDP2 plugin's state_dict_type where it sharded the model: how its save_state and a Trainer's
    # checkpoints save it ("FULL_STATE_DICT": gathered and written whole; "SHARDED_STATE_DICT"); None: not read
    plugin_state_dict_type: str | None = None
    # accelerate's gradient accumulation there (its sync_each_batch, gradient_accumulation_steps); None: not read
    # (not sharded by accelerate, or a run recorded before this field)
    accelerate: AccelerateAccumulation | None = None
    # modules torch.compile compiles as frames of their own (CompiledModule), in module order, and Dynamo's recompile
    # limits then, this torch's names (recompile_limit, accumulated_recompile_limit; 2.6: cache_size_limit, ...) ->
    # value; [] and {}: none compiled, or a run recorded before these fields
    compiled_modules: list[CompiledModule] = []
    compile_limits: dict[str, int] = {}
    units: list[UnitConfig] = []
    # the device mesh of the units' parameters where it has dims beyond FSDP's (tensor, context or expert parallelism
    # beside FSDP) or FSDP's is 2-D (HSDP): each dim's name and size in mesh order, FSDP's first (fsdp_dims of them);
    # {}: a 1-D FSDP mesh only, or not read. A dim without a name is "dim<i>"
    mesh: dict[str, int] = {}
    fsdp_dims: int = 0
    # FSDP's mesh is 1-D and cut from a larger one (``mesh2["shard"]`` of a 2-D ``mesh2``): that mesh's dims, name ->
    # size in mesh order, and the name of FSDP's dim in it; {} and "": not cut from one, or not read
    fsdp_mesh_parent: dict[str, int] = {}
    fsdp_mesh_dim: str = ""
    # the process group's ranks that train the watched model, where its mesh leaves ranks out (this run's rank i is
    # world_ranks[i]; world_size counts them); []: every rank of the process group
    world_ranks: list[int] = []
    unmanaged_param_bytes: int | None = 0  # parameters no FSDP unit manages (None: unknown)
    model_param_count: int = 0
    # a frozen base (fine-tuning): the trainable parameters (weight gradients) and those from the first trainable one
    # on in module order (input gradients flow through them); None: not read (then every parameter, 6 x N x tokens)
    model_trainable_param_count: int | None = None
    model_grad_path_param_count: int | None = None
    experts: Experts | None = None  # a mixture of experts' routed experts (None: none found, or not read)
    capacity_bytes: int | None = None
    # the CUDA caching allocator's settings as this process's environment gave them: each of its variables that is
    # set (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF) -> its value, e.g. "expandable_segments:True"; CUDA runs only
    alloc_conf: dict[str, str] = {}
    tokens_per_step: int | None = None
    peak_tflops: float | None = None
    flops_per_step: float | None = None  # model FLOPs of one (optimizer) step: forward, backward, optimizer
    hardware_flops_per_step: float | None = None  # the same plus activation checkpointing's recompute
    # the elements the counted step's training forwards took (StepRecord.input_elements): the FLOPs above are that
    # batch's; None: not recorded
    flops_input_elements: int | None = None
    profile_schedule: dict[str, int] | None = None
    notes: list[str] = []
    unmanaged_trainable_names: list[str] | None = None  # trainable parameters no unit manages (ignored_params)
    unmanaged_trainable_bytes: int | None = None
    # the sum of those parameters' values (float64), read at the third step's end (written with the config again
    # then): the same on every rank where the loop averages their gradients itself, different where each rank
    # updates its own copy (wrap.unreduced_params compares the ranks'); None: not read
    unmanaged_digest: float | None = None
    # whether the watched module defines a forward() of its own (False: a container of models called one by one, a
    # teacher and its student each its own FSDP root, as they should be); None: not recorded
    model_has_forward: bool | None = None
    # trainable parameters the optimizer does not hold (tensors 0: none; None: no optimizer, or not recorded)
    untrained: Untrained | None = None
    # written again at the third step's end where it has more to say (fsdp_doctor.record.tracker Doctor._late_check):
    # the tensors of state the optimizer holds then (0: no gradient ever reached it; None: not read), and the units
    # whose FSDP gradient sync is off then (set_requires_gradient_sync(False))
    optimizer_state_tensors: int | None = None
    gradient_sync_off: list[str] = []
    # one line each: what this torch's FSDP2 could not tell the doctor (private state it could not read, a
    # failed consistency check, a label or API this release lacks); the report lists them under problems
    unavailable: list[str] = []
    # one line each: how some figures were measured where the doctor's hooks cannot run (units compiled by
    # torch.compile: timed around their compiled call, or inside a compiled frame and not timed): facts of the
    # run, shown as notes, not problems (a compiled run that recorded everything it could exits 0)
    measured_notes: list[str] = []
    # features of FSDP2 this torch release does not have (a record_function label, a private API), e.g.
    # "label FSDP::post_backward_rs_wait": facts about the release, not problems of the run
    torch_lacks: list[str] = []


class UnitStep(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """Host-side timings of one unit within one step (milliseconds).

    fwd_ms brackets FSDP's own forward hooks (pre-forward all-gather wait through post-forward
    reshard); ag_wait_fwd_ms is the part between entering FSDP's pre-forward hook and leaving it
    (the unshard issued and waited for). bwd_ms runs from FSDP's pre-backward to its post-backward
    for the unit; ag_wait_bwd_ms is the wait for its own backward all-gather: in its pre-backward, or in
    the pre-backward of the unit that prefetched it synchronously, whose bwd_ms holds that wait
    (record.hooks.StepTimer._backward_split). recompute_ms is forward time re-run under activation
    checkpointing during backward (measured when the re-run completes; the default non-reentrant
    checkpoint stops its re-run early, and then it is the unit's forward compute time
    fwd_ms - ag_wait_fwd_ms, which is what the re-run repeats). All inclusive of nested units.
    """

    name: str
    fwd_ms: float = 0.0
    ag_wait_fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    ag_wait_bwd_ms: float = 0.0
    recompute_ms: float = 0.0
    fwd_calls: int = 0  # forward calls of the unit's modules (a grouped unit of two modules: 2 per pass)


class MemoryPeak(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The highest sample of a step (device bytes)."""

    bytes: int = 0  # device bytes at the step's highest sampled mark
    t_ms: float = 0.0  # ms from the previous step's end
    unit: str | None = None  # FSDP unit of the mark ("" the root; None: outside every unit)
    phase: str | None = None  # "forward_start", "backward_end", "optimizer_end", ...
    breakdown: dict[str, int] = {}  # category -> bytes; adds up to ``bytes`` (fsdp_doctor.memory_categories)


class MemoryTimeline(msgspec.Struct, kw_only=True):
    """Every sample of a step: ``columns`` are ``["t_ms", "unit", "phase", *categories]`` (bytes)."""

    columns: list[str] = []
    rows: list[list[Any]] = []


class CudaMemory(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Allocator and device figures of a CUDA step (torch.cuda, NVML); every figure in bytes unless a count."""

    allocated: int | None = None  # torch.cuda.memory_allocated
    reserved: int | None = None  # torch.cuda.memory_reserved
    fragmentation: int | None = None  # reserved - allocated
    max_allocated: int | None = None
    inactive_split_bytes: int | None = None  # the allocator's inactive split blocks
    device_free: int | None = None  # torch.cuda.mem_get_info
    device_total: int | None = None
    # the most this process's caching allocator may reserve where torch.cuda.set_per_process_memory_fraction capped
    # it below the device (None: the whole device)
    allocator_limit: int | None = None
    largest_free_block: int | None = None  # largest inactive cached block (memory_snapshot, some steps)
    nvml_process_bytes: int | None = None  # this process's device memory as NVML sees it
    outside_allocator: int | None = None  # nvml_process_bytes - reserved: NCCL, CUDA context, other allocators
    alloc_retries: int | None = None  # count
    ooms: int | None = None  # count
    error: str | None = None  # a torch.cuda call failed (the figures after it are missing)
    snapshot_error: str | None = None

    #: the fields that are bytes (TensorBoard writes each as ``memory/cuda_<name without _bytes>_mib``)
    BYTE_FIELDS: ClassVar[tuple[str, ...]] = (
        "allocated", "reserved", "fragmentation", "max_allocated", "inactive_split_bytes", "device_free",
        "device_total", "allocator_limit", "largest_free_block", "nvml_process_bytes", "outside_allocator")


class CastCopies(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Copies that torch.autocast made of FSDP's unsharded parameters and autograd saved for backward (a full
    step's; part of its ``activations``): the cast of a 32-bit parameter for a 16-bit matmul, held from the
    forward of its unit to that unit's backward, where FSDP resharding frees only the 32-bit original."""

    dtype: str = ""  # the copies' dtype (autocast's: "bfloat16", "float16")
    peak: int = 0  # bytes alive at the step's peak mark
    most: int = 0  # the most alive at any mark of the step
    rows: list[int] = []  # bytes alive at each row of the step's timeline (when the step has one)
    units: dict[str, int] = {}  # unit -> bytes its forward left saved (nested units' included)


class MemoryStep(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Memory by category of one step of one rank (``StepRecord.memory``; see fsdp_doctor.record.memory).

    Files written before this struct existed hold the same fields as a JSON object: they decode into it."""

    v: int = 1  # the memory step's own format (2: ``autocast`` and ``cast_copies`` read)
    device: str = ""  # "cpu" | "cuda:0"
    categories: list[str] = []  # device categories, in the order of the timeline's columns
    sampling: str = "full"  # "full": every figure measured at every mark; "replayed": the last full
    # step's figures, mark by mark (temporaries still measured live on CUDA)
    samples: int = 0  # marks sampled this step
    peak: MemoryPeak | None = None
    end: dict[str, int] = {}  # category -> bytes at the last sample (after the optimizer step)
    offloaded_host: int = 0  # host bytes of offloaded params/grads/optimizer state
    activations: str = "off"  # "exact" | "replayed" | "off"
    activations_note: str | None = None  # why activations are not counted
    transients: str = "off"  # the high-water between marks: "exact" | "replayed" | "off" (record/memory/transients.py)
    transients_note: str | None = None  # why it is off
    comm_note: str | None = None  # why comm_buffers are unknown
    unknown: list[str] = []  # categories not measurable on this torch (their 0 is no figure)
    unit_activations: dict[str, int] | None = None  # exact steps: bytes each unit's forward left saved
    # exact steps: of those, what the units nested in its forward did not save (a nested unit called after the
    # forward returned, as torchtitan's chunked loss calls its last unit, is not nested); None in older runs
    unit_activations_own: dict[str, int] | None = None
    # exact steps: bytes of each unit's forward inputs (their tensors' storages, once each), in the same pass: what
    # checkpointing the unit keeps of its forward; None in older runs
    unit_inputs: dict[str, int] | None = None
    # exact steps: the step's highest saved-for-backward bytes, counted at every save (the marks and the
    # high-water rows only see the moments they sample; 0 in runs recorded before this field)
    activations_high: int = 0
    # activation checkpointing, exact steps with the high-water on: bytes each unit's recomputes saved for backward,
    # i.e. what its forward would keep saved without checkpointing on top of what it keeps now
    unit_recompute_saved: dict[str, int] | None = None
    stale_optimizer_param_tensors: int = 0
    saved_tensors: int = 0  # tensors the pack hook saw this step
    replay_mismatches: int = 0  # marks that did not line up with the last full step
    timeline: MemoryTimeline | None = None  # full steps 0-2, every timeline_every-th, new highs
    cuda: CudaMemory | None = None  # CUDA only
    full_every: int = 1  # current period of full steps
    probe_us: float = 0.0  # the probe's own cost this step (µs)
    probe_pack_us: float = 0.0  # of which in the pack hook (µs)
    # of which at the step's end, after doctor.step() was called: in the next step's wall (its doctor_ms), not this
    # one's (µs; 0 in runs recorded before this field)
    probe_end_us: float = 0.0
    # torch.autocast's dtype where the model's forward started inside an autocast region for the run's device type
    # (full steps; None: no autocast, or not read)
    autocast: str | None = None
    cast_copies: CastCopies | None = None  # exact activation steps where autocast copied FSDP's parameters


class StepRecord(Record, tag="step"):
    """One training step of one rank: from the previous ``doctor.step()`` to this one."""

    step: int
    start_ns: int  # wall clock (time.time_ns) at the step's start
    wall_ms: float
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    outside_ms: float = 0.0  # wall - forward - backward - optimizer - no_grad - doctor: data loading, loss, user code
    gc_ms: float = 0.0
    gc_count: int = 0
    gc_full_ms: float = 0.0  # of gc_ms, the full (generation 2) collections', which traverse every tracked object
    # objects the step's collections freed: reference cycles only the collector frees (None: runs before this field)
    gc_collected: int | None = None
    # of gc_count and gc_ms, the collections that started with the collector disabled (gc.disable()): the loop's
    # explicit gc.collect() calls (0: none, or runs before these fields)
    gc_disabled_count: int = 0
    gc_disabled_ms: float = 0.0
    profiled: bool = False  # inside an active torch.profiler window
    units: list[UnitStep] = []
    memory: MemoryStep | None = None  # memory by category (see fsdp_doctor.record.memory)
    # doctor.step() calls this record covers: one step is one optimizer step, so with gradient accumulation
    # (doctor.step() per micro-batch) the micro-batches of one optimizer step make one record
    micro_batches: int = 1
    # backward passes that reached the model in the step (backward() calls through it): the micro-batches of
    # gradient accumulation, however doctor.step() is called; several forwards feeding one loss are one; where the
    # model is a unit, a call that did not reach it is part of one (torchtitan's chunked loss: one call per chunk
    # through its output unit alone, which earlier records count too). None: records before this field
    backwards: int | None = None
    # of those, the ones that began with FSDP2's gradient sync on (every unit reduce-scattering its gradients):
    # under gradient accumulation all of them where each micro-batch reduce-scatters, the last alone where the loop
    # calls set_requires_gradient_sync(is_last_micro_batch). None: records before this field
    synced_backwards: int | None = None
    # the loop ran a backward and dropped the gradients (zero_grad) with no step of the watched optimizer: an update
    # skipped (a NaN/inf guard, GradScaler's skipped step), recorded as a step of its own, not as a micro-batch of the
    # next (gradient accumulation keeps its gradients to the optimizer step)
    optimizer_skipped: bool = False
    # doctor.step() calls before this step's work, after the previous step's closing call with nothing run since (no
    # forward, backward or optimizer step): the same step's call repeated (doctor.step() twice per optimizer step),
    # not steps; End.repeated_calls: those after the last step
    repeated_calls: int = 0
    # the model's forward passes without gradients in the step (torch.no_grad / inference_mode: evaluation,
    # generation) and their time; kept out of forward_ms, outside_ms and the units' timings
    no_grad_ms: float = 0.0
    no_grad_forwards: int = 0
    # of no_grad_ms, the units' all-gathers there (FSDP's pre-forward hooks, issued and waited for: little where the
    # units are kept gathered); None: no such forward, or not recorded (records before this field)
    no_grad_gather_ms: float | None = None
    # in those forwards, the units entered not gathered (each all-gathers then), and the units entered: as many
    # where the units stay gathered across the forwards, once per forward where each reshards after it; None: no
    # such forward, or records before these fields
    no_grad_gathers: int | None = None
    no_grad_units: int | None = None
    # of those, forwards in eval mode with autograd on that no backward followed (an evaluation that forgot
    # torch.no_grad(): it records the autograd graph and holds its activations until its output is freed)
    autograd_eval_forwards: int = 0
    # the doctor's own work at the previous step's end (this step's wall starts there): writing the records, the
    # memory figures, a profiler trace's export; not in outside_ms
    doctor_ms: float = 0.0
    # of outside_ms, the time between optimizer.step() and the next forward, on the host: this step's start to its
    # first training forward (the doctor's own work left out) plus its last optimizer.step()'s end to its end, less
    # the checkpoint saves and forwards without gradients (evaluation) there; under gradient accumulation, plus
    # each backward's end to the next micro-batch's forward. Data loading lies there; the loss between forward and
    # backward, and clipping or logging between backward and the optimizer, do not. None: not timed (no forward
    # or no optimizer step seen; records before this field)
    between_ms: float | None = None
    # checkpoint saves in the step (torch.distributed.checkpoint's save and async_save, from its log; others with
    # ``with doctor.checkpointing():`` around them; torchtitan's Trainer's under python -m fsdp_doctor.titan; a
    # Hugging Face Trainer's under DoctorCallback) and their time, kept out of outside_ms and between_ms
    checkpoint_ms: float = 0.0
    checkpoints: int = 0
    # of those, torch.distributed.checkpoint.async_save calls: their time is the staging the step waits for (the
    # state copied to host memory), the write goes on in the background
    async_saves: int = 0
    # a backward through the model began after an optimizer.step() that followed a backward, within the step: a second
    # loss through the model after its update (a GAN's generator update through the watched discriminator), not
    # gradient accumulation, whose micro-batches all run backward before the step's optimizer.step()
    backward_after_optimizer: bool = False
    # another FSDP model's forward and backward inside this step, outside the watched model (a teacher's forward, a
    # GAN's other network; FSDP2's labels of param groups not the watched model's): part of outside_ms, not the data
    other_models_ms: float = 0.0
    # graphs torch.compile compiled in the step (Dynamo's frames, recompiles, AOT autograd's lazily compiled
    # backwards: record/compile_time.py) and their time, inside the phases they ran in; the analyses leave such steps
    # out of the statistics as they do the first (0: none, and records before these fields)
    compiles: int = 0
    compile_ms: float = 0.0
    # the graph breaks Dynamo met compiling in the step (its counter, record/compile_time.py), and of them those at a
    # call of torch._dynamo.disable inside the compiled code: FSDP2 wraps each of its hooks in one, so a model compiled
    # whole after sharding breaks at its units' hooks (0: none, and records before these fields)
    graph_breaks: int = 0
    disable_breaks: int = 0
    # Dynamo's recompile limit hit in the step (record/compile_time.py): each frame it gave up compiling, which runs
    # eagerly from then on where its cache has no matching entry ([]: none, and records before this field)
    recompile_limits: list[RecompileLimit] = []
    # frames Dynamo compiled inside each unit's compiled call in the step (the units compiled in place and timed
    # around that call: name -> frames, those that compiled; {}: none, and records before this field)
    unit_compiles: dict[str, int] = {}
    # the elements of the tensors the step's training forwards of the model took (its batches' tokens, pixels; summed
    # over micro-batches): FLOPs counted on one step are scaled by it where it varies (analyze/throughput.py); None:
    # not recorded (records before this field, or no training forward seen)
    input_elements: int | None = None
    # the shape of the first tensor the step's first training forward of the model took (a batch's tokens: batch x
    # sequence, the length a chunked loss splits); None: not recorded (records before this field, or none seen)
    input_shape: list[int] | None = None
    # the tokens this rank trained on in the step, as the loop gave them (doctor.step(tokens=N), summed over its calls
    # in the step): tokens/s from them where they vary (packing, token budgets); None: not given
    tokens: int | None = None
    # set by the reader, never written: another rank compiled in this step, or in the previous one and this rank waited
    # for it in this step's collectives (a rank compiling longer arrives late at the next step's first all-gather)
    others_compiled: bool = False
    # set by the reader, never written: another rank saved a checkpoint in this step (rank 0's torch.save, which the
    # others wait for at their next collective): a save step of the job, left out of the statistics as its own are
    others_saved: bool = False


class GpuTimes(Record, tag="gpu"):
    """Device-side times of one step on CUDA, from events read a step later (see record/gpu_timing.py).

    ``units`` rows are ``[name, fwd_ms, bwd_ms]``: the device time between the same brackets the host
    timings use (inclusive of nested units), on every ``UNIT_EVERY``-th step (record/gpu_timing.py; empty on the
    others, which time the phases only)."""

    step: int
    step_ms: float
    units: list[list[Union[str, float]]] = []
    # the step's phases on the device: first unit forward begun .. last ended, the same for backward, and the
    # optimizer hook pair (0.0 where the phase did not run, and in files written before these fields existed)
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    # the device's time outside the model (None in files written before these fields existed, and where a bracket
    # did not run): from the previous step's end event to this step's start event (None on the first step; the two
    # are recorded before and after the doctor's own bookkeeping at doctor.step(), which the device idles through
    # only when it has no work queued), from this step's start to its first forward (the device waiting for the
    # batch and the loop's code before the model), and from the end of its last phase (the optimizer, else
    # backward) to its end (zero_grad, the loop's code before doctor.step())
    idle_before_ms: float | None = None
    before_forward_ms: float | None = None
    after_model_ms: float | None = None


class ProfileWindow(Record, tag="profile"):
    """A torch.profiler window whose Kineto trace was written, or (``lost``) was not."""

    steps: list[int]
    path: str  # relative to the run directory
    # why the trace was not saved ("[Errno 28] No space left on device"): the window is lost, ``path`` never written
    # (a new-user trial's 80 KiB disk lost its one window, said during training and nowhere in the report)
    lost: str = ""


class DoctorError(Record, tag="error"):
    """The doctor caught an exception in its own hooks and stepped aside; training went on."""

    where: str
    message: str
    step: int | None = None


class End(Record, tag="end"):
    """Written when ``watch`` exits: normally, or on an exception the training loop raised through it
    (``exception``: its type and first line; the run stopped there, Ctrl-C's KeyboardInterrupt included)."""

    steps: int
    ended_ns: int
    exception: str = ""
    # where that exception is torch's "mixed torch.Tensor and DTensor" raised in a module of an FSDP unit that another
    # unit's forward called, outside its own unit's forward (DiT's root calls transformer_blocks[0].norm1.emb): which
    # module, called from where, and the fix (record/units.outside_unit_call); or that a method of a unit's module ran
    # in place of its forward (a VAE's encode(): record/units.method_call); "" otherwise
    exception_hint: str = ""
    # FSDP2 units of other models alive in the process at the exit (a frozen teacher, a GAN's other network): their
    # collectives share the trace's labels with the watched model's, their work lies in its time outside the model
    other_fsdp_units: int = 0
    repeated_calls: int = 0  # doctor.step() calls repeated after the last step (StepRecord.repeated_calls)


AnyRecord = Union[Header, RunConfig, StepRecord, GpuTimes, ProfileWindow, DoctorError, End]


class Manifest(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: str | None = None  # as Header's
    version: int | None = None
    world_size: int = 1
    started_ns: int = 0
    streams: list[str] = []
    profiler_dir: str = PROFILER_DIR
    doctor_version: str = ""
    command: list[str] = []
    run_id: str = ""  # see Header.run_id


record_encoder = msgspec.json.Encoder()
record_decoder = msgspec.json.Decoder(AnyRecord)
manifest_decoder = msgspec.json.Decoder(Manifest)
