"""Configuration of the reference workload and its command-line flags.

`WorkloadConfig` holds every knob: model shape, training length, the FSDP2 wrapping policy and its
settings, and the fault-injection knobs the doctor's scenario tests use. `add_cli_args` exposes each
knob as a flag and `config_from_args` turns the parsed namespace back into a config.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

WRAP_POLICIES = ("block", "whole", "leaf", "blocks_only", "no_root")
DTYPE_NAMES = ("bf16", "fp32", "fp16")
DEVICES = ("cpu", "cuda")

ReshardValue = Union[bool, int]


@dataclass
class WorkloadConfig:
    """Every knob of the reference GPT workload.

    Model and training: `vocab`, `d_model`, `n_layers`, `n_heads`, `n_kv_heads` (key/value heads: None =
    `n_heads`; fewer = grouped-query attention), `seq_len`, `batch_size` (per rank),
    `steps`, `lr`, `seed`, `pos_emb` (learned position embedding as a top-level `pos_emb` module).

    FSDP2: `wrap` (one of `WRAP_POLICIES`), `reshard_after_forward` (None keeps the expert default:
    every non-root unit resharded, the grouped `[norm, lm_head]` unit kept unsharded, the root left to
    FSDP; a bool/int applies to every non-root unit), `reshard_overrides` (unit name -> bool/int, wins
    over everything; "" is the root), `async_unshard`, `forward_prefetch` / `backward_prefetch` (explicit
    prefetch depth over the block units, 0 = FSDP's implicit prefetch), `prefetch_reversed` (deliberate bug:
    explicit lists in the wrong order, each block forward-prefetching the block before it and backward-prefetching
    the one after), `ac` ("none", "block",
    "every:K", "children", "selective": each block under torchtitan's op-level selective
    policy), `param_dtype` / `reduce_dtype` (None or one of `DTYPE_NAMES`),
    `cpu_offload` (+ `offload_pin_memory`), `optimizer_before_shard` (deliberate bug), `autocast` (None or
    one of `DTYPE_NAMES`: the loop runs forward and loss under `torch.autocast(device, dtype)`), `device`,
    `num_threads` (intra-op threads per rank; None leaves torch's default).

    Fault injection (in the training loop, outside the model): `sleep_rank` sleeps `sleep_ms` before
    the forward of the steps in `sleep_steps` (every step when empty); every rank pauses `pause_ms` before
    the forward of every `pause_every`-th step (work done every N steps on every rank: an upload, a save the
    doctor is not told of); `loader_ms` is slept by the data loader before every batch on every rank;
    `gc_garbage` reference cycles are allocated each step; `gc_heap` small objects live for the whole run and a
    quarter of that is made each step and kept for 3 (no cycles: full collections traverse them all).

    Training loop habits: `grad_accum` micro-batches per optimizer step (each of `batch_size` sequences),
    with FSDP's gradient sync off for all but the last (`set_requires_gradient_sync(False)`) only when
    `accum_no_sync`; `zero_grad_to_none=False` calls `optimizer.zero_grad(set_to_none=False)`.
    """

    vocab: int = 512
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    seq_len: int = 64
    batch_size: int = 4
    steps: int = 20
    lr: float = 1e-3
    seed: int = 0
    pos_emb: bool = True

    wrap: str = "block"
    reshard_after_forward: Optional[ReshardValue] = None
    reshard_overrides: dict[str, ReshardValue] = field(default_factory=dict)
    async_unshard: bool = False
    forward_prefetch: int = 0
    backward_prefetch: int = 0
    prefetch_reversed: bool = False
    ac: str = "none"
    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None
    cpu_offload: bool = False
    offload_pin_memory: bool = True
    optimizer_before_shard: bool = False
    autocast: Optional[str] = None
    device: str = "cpu"
    num_threads: Optional[int] = 1

    sleep_rank: Optional[int] = None
    sleep_ms: float = 0.0
    sleep_steps: list[int] = field(default_factory=list)
    loader_ms: float = 0.0
    pause_ms: float = 0.0
    pause_every: int = 0
    gc_garbage: int = 0
    gc_heap: int = 0

    grad_accum: int = 1
    accum_no_sync: bool = False
    zero_grad_to_none: bool = True

    def __post_init__(self) -> None:
        self.reshard_after_forward = parse_reshard_value(self.reshard_after_forward)
        self.reshard_overrides = {
            str(name): _required_reshard_value(name, value) for name, value in self.reshard_overrides.items()
        }
        self.sleep_steps = [int(step) for step in self.sleep_steps]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a one-line message for any knob out of range."""
        _check(self.wrap in WRAP_POLICIES, f"wrap must be one of {WRAP_POLICIES}, got {self.wrap!r}")
        _check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        for name in ("param_dtype", "reduce_dtype", "autocast"):
            value = getattr(self, name)
            _check(value is None or value in DTYPE_NAMES,
                   f"{name} must be None or one of {DTYPE_NAMES}, got {value!r}")
        _check(self.d_model % self.n_heads == 0,
               f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        _check(self.n_kv_heads is None or (1 <= self.n_kv_heads <= self.n_heads
                                           and self.n_heads % self.n_kv_heads == 0),
               f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        for name in ("vocab", "d_model", "n_layers", "n_heads", "seq_len", "batch_size"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _check(self.steps >= 0, f"steps must be >= 0, got {self.steps}")
        _check(self.forward_prefetch >= 0 and self.backward_prefetch >= 0,
               "forward_prefetch and backward_prefetch must be >= 0")
        _check(self.sleep_ms >= 0 and self.loader_ms >= 0 and self.pause_ms >= 0,
               "sleep_ms, loader_ms and pause_ms must be >= 0")
        _check(self.pause_every >= 0, f"pause_every must be >= 0, got {self.pause_every}")
        _check(self.gc_garbage >= 0, f"gc_garbage must be >= 0, got {self.gc_garbage}")
        _check(self.gc_heap >= 0, f"gc_heap must be >= 0, got {self.gc_heap}")
        _check(self.grad_accum >= 1, f"grad_accum must be >= 1, got {self.grad_accum}")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1 or None")
        _check(not self.cpu_offload or self.device == "cuda",
               "cpu_offload needs device='cuda': on the CPU the parameters already live in host memory")
        self.ac_every()  # validates the ac string
        _check(self.reshard_after_forward is None or isinstance(self.reshard_after_forward, (bool, int)),
               f"reshard_after_forward must be None, a bool or an int, got {self.reshard_after_forward!r}")

    def ac_every(self) -> int:
        """Checkpoint period over the blocks: 0 = none, 1 = every block, K = every K-th block.

        "children" and "selective" also return 1 (every block is affected); tell them apart with `ac`.
        """
        if self.ac == "none":
            return 0
        if self.ac in ("block", "children", "selective"):
            return 1
        if self.ac.startswith("every:"):
            try:
                k = int(self.ac.split(":", 1)[1])
            except ValueError:
                k = 0
            _check(k >= 1, f"ac 'every:K' needs an integer K >= 1, got {self.ac!r}")
            return k
        raise ValueError(f"ac must be 'none', 'block', 'every:K', 'children' or 'selective', got {self.ac!r}")

    def tokens_per_step(self, world_size: int) -> int:
        """Tokens consumed by one optimizer step over all ranks."""
        return self.batch_size * self.seq_len * world_size * self.grad_accum

    def replace(self, **changes) -> "WorkloadConfig":
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def parse_reshard_value(text: Union[str, bool, int, None]) -> Optional[ReshardValue]:
    """Parse "true"/"false"/"default"/an integer (CLI spelling) into a reshard_after_forward value."""
    if text is None or isinstance(text, (bool, int)):
        return text
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("default", "none", ""):
        return None
    try:
        return int(lowered)
    except ValueError:
        raise ValueError(
            f"reshard_after_forward must be true, false, default or an integer, got {text!r}") from None


def parse_reshard_unit(text: str) -> tuple[str, ReshardValue]:
    """Parse one `--reshard-unit NAME=VALUE` item, e.g. "layers.3=false" or "=true" for the root."""
    if "=" not in text:
        raise ValueError(f"--reshard-unit expects NAME=VALUE (e.g. layers.3=false), got {text!r}")
    name, value = text.rsplit("=", 1)
    parsed = parse_reshard_value(value)
    if parsed is None:
        raise ValueError(f"--reshard-unit {text!r}: the value must be true, false or an integer")
    return name.strip(), parsed


def _required_reshard_value(name: str, value: Union[str, bool, int]) -> ReshardValue:
    parsed = parse_reshard_value(value)
    if parsed is None:
        raise ValueError(f"reshard_overrides[{name!r}] must be true, false or an integer, got {value!r}")
    return parsed


def _cli_type(parse):
    """Wrap a parser so argparse shows its ValueError message instead of a generic "invalid value"."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


def _dtype_arg(text: str) -> Optional[str]:
    value = None if text.lower() in ("none", "") else text.lower()
    if value is not None and value not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES} or none, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"expected comma-separated step indices, got {text!r}") from None


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per `WorkloadConfig` knob to `parser` (defaults taken from the dataclass)."""
    d = WorkloadConfig()
    model = parser.add_argument_group("workload model and training")
    model.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size")
    model.add_argument("--d-model", type=int, default=d.d_model, help="hidden size")
    model.add_argument("--n-layers", type=int, default=d.n_layers, help="number of decoder blocks")
    model.add_argument("--n-heads", type=int, default=d.n_heads, help="attention heads")
    model.add_argument("--n-kv-heads", type=int, default=d.n_kv_heads,
                       help="key/value heads (fewer than --n-heads: grouped-query attention; default: n_heads)")
    model.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    model.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step")
    model.add_argument("--steps", type=int, default=d.steps, help="training steps")
    model.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    model.add_argument("--seed", type=int, default=d.seed, help="seed for weights and data")
    model.add_argument("--pos-emb", action=argparse.BooleanOptionalAction, default=d.pos_emb,
                       help="learned position embedding module `pos_emb`")
    model.add_argument("--device", choices=DEVICES, default=d.device,
                       help="cpu (gloo) or cuda (nccl)")
    model.add_argument("--num-threads", type=int, default=d.num_threads,
                       help="torch intra-op threads per rank")

    fsdp = parser.add_argument_group("workload FSDP2 settings")
    fsdp.add_argument("--wrap", choices=WRAP_POLICIES, default=d.wrap, help="wrapping policy")
    fsdp.add_argument("--reshard-after-forward", type=_cli_type(parse_reshard_value),
                      default=d.reshard_after_forward, metavar="{true,false,default,N}",
                      help="reshard_after_forward for every non-root unit (default: expert default)")
    fsdp.add_argument("--reshard-unit", type=_cli_type(parse_reshard_unit), action="append", default=[],
                      metavar="NAME=VALUE",
                      help="per-unit reshard_after_forward, e.g. layers.3=false (repeatable; '' = root)")
    fsdp.add_argument("--async-unshard", action=argparse.BooleanOptionalAction, default=d.async_unshard,
                      help="_set_unshard_async_op(True) on every unit")
    fsdp.add_argument("--forward-prefetch", type=int, default=d.forward_prefetch, metavar="N",
                      help="explicit forward prefetch depth over blocks (0 = FSDP default)")
    fsdp.add_argument("--backward-prefetch", type=int, default=d.backward_prefetch, metavar="N",
                      help="explicit backward prefetch depth over blocks (0 = FSDP default)")
    fsdp.add_argument("--prefetch-reversed", action=argparse.BooleanOptionalAction, default=d.prefetch_reversed,
                      help="explicit prefetch lists in the wrong order: each block prefetches the block before it "
                      "in forward, the one after it in backward (a deliberate bug)")
    fsdp.add_argument("--ac", default=d.ac, metavar="{none,block,every:K,children,selective}",
                      help="activation checkpointing policy (selective: torchtitan's op-level policy on each block)")
    fsdp.add_argument("--param-dtype", type=_cli_type(_dtype_arg), default=d.param_dtype,
                      metavar="{bf16,fp32,fp16}", help="MixedPrecisionPolicy param_dtype")
    fsdp.add_argument("--reduce-dtype", type=_cli_type(_dtype_arg), default=d.reduce_dtype,
                      metavar="{bf16,fp32,fp16}", help="MixedPrecisionPolicy reduce_dtype")
    fsdp.add_argument("--autocast", type=_cli_type(_dtype_arg), default=d.autocast, metavar="{bf16,fp16}",
                      help="run forward and loss under torch.autocast in this dtype")
    fsdp.add_argument("--cpu-offload", action=argparse.BooleanOptionalAction, default=d.cpu_offload,
                      help="CPUOffloadPolicy (needs --device cuda)")
    fsdp.add_argument("--optimizer-before-shard", action=argparse.BooleanOptionalAction,
                      default=d.optimizer_before_shard,
                      help="deliberate bug: build AdamW before fully_shard")

    faults = parser.add_argument_group("workload fault injection")
    faults.add_argument("--sleep-rank", type=int, default=d.sleep_rank,
                        help="this rank sleeps inside the step, before forward")
    faults.add_argument("--sleep-ms", type=float, default=d.sleep_ms, help="how long --sleep-rank sleeps")
    faults.add_argument("--sleep-steps", type=_cli_type(_int_list), default=[], metavar="I,J,...",
                        help="steps on which --sleep-rank sleeps (default: every step)")
    faults.add_argument("--pause-ms", type=float, default=d.pause_ms,
                        help="every rank pauses this long before the forward of every --pause-every-th step")
    faults.add_argument("--pause-every", type=int, default=d.pause_every, help="steps between pauses (0: none)")
    faults.add_argument("--loader-ms", type=float, default=d.loader_ms,
                        help="data loader sleep per batch, every rank")
    faults.add_argument("--gc-garbage", type=int, default=d.gc_garbage,
                        help="reference cycles allocated per step (drives the cyclic GC)")
    faults.add_argument("--gc-heap", type=int, default=d.gc_heap,
                        help="small objects kept for the whole run, a quarter of that made each step and kept for 3 "
                             "(drives the GC's full collections)")
    faults.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    faults.add_argument("--accum-no-sync", action=argparse.BooleanOptionalAction, default=d.accum_no_sync,
                        help="set_requires_gradient_sync(False) on all but the last micro-batch")
    faults.add_argument("--zero-grad-to-none", action=argparse.BooleanOptionalAction, default=d.zero_grad_to_none,
                        help="optimizer.zero_grad(set_to_none=...)")
    return parser


def config_from_args(ns: argparse.Namespace) -> WorkloadConfig:
    """Build a validated `WorkloadConfig` from a namespace parsed with `add_cli_args`' flags."""
    values = {}
    for f in dataclasses.fields(WorkloadConfig):
        if hasattr(ns, f.name):
            values[f.name] = getattr(ns, f.name)
    values["reshard_overrides"] = dict(getattr(ns, "reshard_unit", None) or [])
    values["sleep_steps"] = list(getattr(ns, "sleep_steps", None) or [])
    return WorkloadConfig(**values)
