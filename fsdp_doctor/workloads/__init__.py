"""The reference workload: a GPT-style decoder trained with real FSDP2 on synthetic tokens.

It is what the doctor's demo, tests, benchmarks and scenario suite run. Typical use::

    from fsdp_doctor.workloads import WorkloadConfig, launch
    losses = launch(WorkloadConfig(wrap="block", steps=20), nproc=2)   # gloo ranks on CPU

Every FSDP2 knob the doctor diagnoses is a `WorkloadConfig` field and a CLI flag (`add_cli_args`),
including deliberate misconfigurations (wrap="no_root", ac="children", optimizer_before_shard) and
fault injection (a sleeping rank, a slow loader, GC pressure).
"""

from .config import (
    DTYPE_NAMES,
    WRAP_POLICIES,
    WorkloadConfig,
    add_cli_args,
    config_from_args,
    parse_reshard_unit,
    parse_reshard_value,
)
from .data import batches, make_batch
from .gpt import GPT, build_model, total_param_count
from .launch import GpuPlan, WorkloadError, WorkloadTimeout, free_port, gpu_plan, launch
from .sharding import (
    UnitSpec,
    analytic_param_counts,
    apply_activation_checkpointing,
    apply_fsdp,
    fsdp_units,
)
from .train import make_optimizer, running_under_torchrun, train, train_from_env

__all__ = [
    "DTYPE_NAMES",
    "GPT",
    "GpuPlan",
    "UnitSpec",
    "WRAP_POLICIES",
    "WorkloadConfig",
    "WorkloadError",
    "WorkloadTimeout",
    "add_cli_args",
    "analytic_param_counts",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "batches",
    "build_model",
    "config_from_args",
    "free_port",
    "fsdp_units",
    "gpu_plan",
    "launch",
    "make_batch",
    "make_optimizer",
    "parse_reshard_unit",
    "parse_reshard_value",
    "running_under_torchrun",
    "total_param_count",
    "train",
    "train_from_env",
]
