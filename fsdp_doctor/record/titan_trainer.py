"""The torchtitan way in: its own Trainer, watched, from the command line that runs it.

    TRAIN_FILE=fsdp_doctor.titan ./run_train.sh --module llama3 --config llama3_8b      # torchtitan's script
    torchrun --nproc_per_node 8 -m fsdp_doctor.titan --module llama3 --config llama3_8b [--doctor.out-dir DIR]

torchtitan's Trainer owns the loop, so ``python -m fsdp_doctor.titan`` is torchtitan's own entry point
(``torchtitan.train``'s ``main``, every flag of it as it is) with the doctor around ``Trainer.train``:
:func:`attach` watches the trainer's model and its ``OptimizersContainer`` once the Trainer has built them, and
calls ``doctor.step()`` after each of its train steps (an optimizer step: its micro-batches of gradient
accumulation are inside it). Arguments ``--doctor.OPTION VALUE`` (``--doctor.out-dir``, ``--doctor.profile
false``, any :func:`fsdp_doctor.watch` option, hyphens or underscores) are the doctor's; torchtitan never sees
them; ``--help`` lists them before torchtitan's own. By default the records go to ``<dump_folder>/fsdp_doctor``
beside torchtitan's own outputs, and the job's tokens per step (its global batch times its sequence length) are
passed, for tokens/s and MFU.

What the Trainer does between two train steps (its checkpoint saves, its validation) lies in the step after
it, before that step's forward; validation runs the model without gradients, which the recorder keeps apart
(``StepRecord.no_grad_ms``), and the time ``checkpointer.save`` takes is recorded as ``StepRecord.checkpoint_ms``
(the doctor wraps the trainer's own ``save`` for it), neither counted as time the step waited for data.

Training never depends on the doctor: a refusal (the out_dir holding another run, pipeline parallelism with its
several model parts, forward and backward captured in a CUDA graph) is one log line and torchtitan trains
unwatched. Nothing of the doctor stays on the Trainer
after ``train()`` (its ``train_step`` and ``checkpointer.save`` are the class's again), nor on the class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import os
import sys

from ..records import TITAN_DRIVER
from .options import WatchOptions
from .tracker import Doctor, WatchError

log = logging.getLogger("fsdp_doctor")

#: the prefix of the doctor's own arguments on torchtitan's command line
DOCTOR_FLAG = "--doctor."
#: where a torchtitan keeps its Trainer class, newest layout first: 0.3 has ``torchtitan.trainer.Trainer`` and a
#: ``torchtitan.train.main()`` that builds it from the config; 0.1 and 0.2 keep the class in ``torchtitan.train``
#: and take it as ``main(trainer_class)`` (read from main's signature)
TRAINER_MODULES = ("torchtitan.trainer", "torchtitan.train")
ENTRY_MODULE = "torchtitan.train"
#: the records' folder under torchtitan's dump folder when --doctor.out-dir is not given
DEFAULT_SUBDIR = "fsdp_doctor"


class TitanArgError(ValueError):
    """A ``--doctor.*`` argument the doctor cannot take; the message is one line for the user."""


def split_args(argv: list[str]) -> tuple[dict, list[str]]:
    """The doctor's options (``--doctor.NAME VALUE`` or ``--doctor.NAME=VALUE``, the value typed as
    :func:`fsdp_doctor.watch` takes it) and the rest of the command line, torchtitan's, in order."""
    fields = {f.name: f for f in dataclasses.fields(WatchOptions)}
    options, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith(DOCTOR_FLAG):
            rest.append(arg)
            i += 1
            continue
        name, eq, value = arg[len(DOCTOR_FLAG):].partition("=")
        name = name.replace("-", "_")
        if name not in fields:
            raise TitanArgError(f"fsdp_doctor.titan: unknown option {arg.partition('=')[0]} (options: "
                                f"{', '.join(DOCTOR_FLAG + n.replace('_', '-') for n in fields)})")
        if not eq:
            if i + 1 >= len(argv):
                raise TitanArgError(f"fsdp_doctor.titan: {arg} needs a value")
            value, i = argv[i + 1], i + 1
        options[name] = _typed(name, value, fields[name].type)
        i += 1
    return options, rest


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
#: byte units a ``--doctor.capacity-bytes`` value may carry ("80GiB", "80GB", "85899345920")
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
#: each option as a flag (``--help``): what its value looks like, and what it does (watch()'s options, said for
#: this command line; tests/test_titan_trainer.py keeps one entry per option)
_FLAG_HELP = {
    "out_dir": ("DIR", f"where the records go (default: <dump_folder>/{DEFAULT_SUBDIR})"),
    "capacity_bytes": ("SIZE", "memory budget per rank for the memory rules (80GiB, 80GB or bytes; default: the "
                               "GPU's memory)"),
    "profile": ("true|false|first=6,active=2,warmup=1,every=1000",
                "torch.profiler windows: on (the default schedule shown), off, or a schedule"),
    "profile_ranks": ("RANK,RANK,...", "the ranks that record those windows' traces (default: every rank)"),
    "tokens_per_step": ("N", "tokens per optimizer step for tokens/s and MFU (default: global batch x seq_len)"),
    "peak_tflops": ("TFLOPS", "the device's peak TFLOP/s for MFU (default: a table of common GPUs)"),
    "count_flops": ("true|false", "count step 1's FLOPs for MFU (default: on, as tokens per step is known)"),
    "memory": ("true|false", "memory by category (default: true)"),
    "tensorboard": ("true|false", "also write TensorBoard scalars live under the records' tb/ (default: false)"),
    "overwrite": ("true|false", "replace a run already recorded in the records' folder (default: false)"),
}


def _typed(name: str, value: str, annotation) -> object:
    """A ``--doctor.NAME`` value as its option takes it: booleans (``profile`` and ``memory`` too, their
    command-line forms), integers, floats, a path; a byte size with its unit for ``capacity-bytes`` (80GiB), and
    a profiler schedule for ``profile`` (first=6,active=2: :class:`~fsdp_doctor.record.profiling.ProfileSchedule`'s
    fields, the others at their defaults)."""
    kind = str(annotation)
    low = value.lower()
    flag = "bool" in kind or name in ("profile", "memory")
    if flag and low in _TRUE + _FALSE:
        return low in _TRUE
    if low == "none" and "None" in kind:
        return None
    if name == "profile" and "=" in value:
        return _schedule(value)
    if name == "profile_ranks":  # (0,1,2: watch() checks them)
        parts = [p.strip() for p in value.split(",")]
        if parts and all(p.isdigit() for p in parts):
            return [int(p) for p in parts]
        raise TitanArgError(f"fsdp_doctor.titan: {DOCTOR_FLAG}profile-ranks takes ranks (0,1,8), not {value!r}")
    if name == "capacity_bytes":
        number = low.rstrip("bikmgt ")
        unit = low[len(number):].strip()
        try:
            if unit in _BYTE_UNITS and float(number) > 0:
                return int(float(number) * _BYTE_UNITS[unit])
        except ValueError:
            pass
        raise TitanArgError(f"fsdp_doctor.titan: {DOCTOR_FLAG}capacity-bytes takes a size in bytes (85899345920, "
                            f"80GiB, 80GB), not {value!r}")
    try:
        if "int" in kind:
            return int(value)
        if "float" in kind:
            return float(value)
    except ValueError:
        pass
    else:
        if "str" in kind or "PathLike" in kind:
            return value
    raise TitanArgError(f"fsdp_doctor.titan: {DOCTOR_FLAG}{name.replace('_', '-')} takes "
                        f"{'true or false' if flag else 'a number' if 'int' in kind or 'float' in kind else 'a path'}"
                        f", not {value!r}")


def _schedule(value: str):
    """``--doctor.profile first=6,active=2,...``: the profiler's windows as a ProfileSchedule."""
    from .profiling import ProfileSchedule

    fields = [f.name for f in dataclasses.fields(ProfileSchedule)]
    kw = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        key, _, number = part.partition("=")
        if key.strip() not in fields or not number.strip().isdigit():
            raise TitanArgError(f"fsdp_doctor.titan: {DOCTOR_FLAG}profile takes true, false or a schedule "
                                f"({'=N,'.join(fields)}=N), not {value!r}")
        kw[key.strip()] = int(number)
    if kw.get("active", 1) < 1:
        raise TitanArgError(f"fsdp_doctor.titan: {DOCTOR_FLAG}profile's active must be at least 1, not {value!r}")
    return ProfileSchedule(**kw)


def help_text() -> str:
    """The doctor's own options, printed before torchtitan's ``--help``."""
    lines = ["fsdp_doctor.titan: torchtitan's training with fsdp_doctor watching its Trainer.",
             "The doctor's options (torchtitan's follow):"]
    for f in dataclasses.fields(WatchOptions):
        metavar, text = _FLAG_HELP[f.name]
        lines.append(f"  {DOCTOR_FLAG}{f.name.replace('_', '-')} {metavar}\n      {text}")
    return "\n".join(lines) + "\n"


def tokens_per_step(trainer) -> int | None:
    """The job's tokens per optimizer step, each counted once: its global batch (the local batch times the
    batch mesh's degree when not set) times its sequence length."""
    try:
        training = trainer.config.training
        batch = training.global_batch_size
        if batch is None or batch < 0:
            dims = trainer.parallel_dims
            degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
            batch = training.local_batch_size * degree
        return int(batch) * int(training.seq_len)
    except Exception:  # noqa: BLE001  (another torchtitan's config: the throughput is left out, not the run)
        return None


@contextlib.contextmanager
def attach(trainer, **options):
    """Watches a built torchtitan ``Trainer`` while the block runs: its model and optimizers, ``doctor.step()``
    after each of its train steps. ``options`` are :func:`fsdp_doctor.watch`'s; ``out_dir`` defaults to
    ``<dump_folder>/fsdp_doctor`` and ``tokens_per_step`` to the job's. Yields the Doctor, or None where the
    doctor stayed out (one log line: training goes on unwatched)."""
    reason = stays_out(trainer)
    if reason is not None:
        log.warning("fsdp_doctor: %s; torchtitan trains without fsdp_doctor", reason)
        yield None
        return
    parts = trainer.model_parts
    defaults = {"out_dir": os.path.join(str(trainer.config.dump_folder), DEFAULT_SUBDIR)}
    tokens = tokens_per_step(trainer)
    if tokens:
        defaults["tokens_per_step"] = tokens
    try:
        doctor = Doctor(parts[0], trainer.optimizers, WatchOptions.from_kwargs({**defaults, **options}))
        doctor.driver = TITAN_DRIVER
        doctor.__enter__()
    except Exception as e:  # noqa: BLE001  (WatchError: its sentence; anything else: the doctor's own failure)
        log.warning("%s; torchtitan trains without fsdp_doctor",
                    str(e) if isinstance(e, WatchError) else f"fsdp_doctor: {type(e).__name__}: {e}")
        yield None
        return
    inner_step = trainer.train_step
    saver = getattr(trainer, "checkpointer", None)
    inner_save = getattr(saver, "save", None)

    @functools.wraps(inner_step)
    def train_step(*args, **kwargs):
        out = inner_step(*args, **kwargs)
        doctor.step()
        return out

    def save(*args, **kwargs):
        with doctor.checkpointing() as mark:
            out = inner_save(*args, **kwargs)
            mark.saved = bool(out)  # (False: not a step that saves)
        return out

    trainer.train_step = train_step
    if inner_save is not None:
        saver.save = functools.wraps(inner_save)(save)
    try:
        yield doctor
    except BaseException:
        doctor.__exit__(*sys.exc_info())
        raise
    else:
        doctor.__exit__(None, None, None)
    finally:
        trainer.__dict__.pop("train_step", None)  # (the class's method again)
        if inner_save is not None:
            saver.__dict__.pop("save", None)


def stays_out(trainer) -> str | None:
    """Why the doctor cannot watch this built Trainer (None: it can): pipeline parallelism (its model parts, the
    schedule's micro-batches), or forward and backward captured in a CUDA graph (torchtitan 0.3's default on
    NVIDIA GPUs: a replay runs no Python hook, and the doctor's hooks recording CUDA events during the capture
    would break it)."""
    parts = getattr(trainer, "model_parts", None) or []
    if len(parts) != 1 or getattr(getattr(trainer, "parallel_dims", None), "pp_enabled", False):
        return (f"this torchtitan job runs pipeline parallelism ({len(parts)} model part(s) on this rank), and the "
                "doctor watches one FSDP model and its loop")
    body = getattr(type(trainer), "_forward_backward_body", None)
    step = getattr(trainer, "fwd_bwd_fn", None)
    if body is not None and step is not None and getattr(step, "__func__", None) is not body:
        return ("torchtitan captures forward and backward in a CUDA graph (--training.disable-cuda-graphs is not "
                "set), whose replays run none of the doctor's hooks; add --training.disable-cuda-graphs to watch")
    return None


def _trainer_class():
    for name in TRAINER_MODULES:
        try:
            cls = getattr(importlib.import_module(name), "Trainer", None)
        except ImportError:
            continue
        if isinstance(cls, type) and hasattr(cls, "train"):
            return cls
    return None


def main(argv: list[str] | None = None) -> None:
    """``python -m fsdp_doctor.titan``: torchtitan's own ``torchtitan.train`` main with the doctor around every
    ``Trainer.train()`` of this process; ``--doctor.*`` arguments are the doctor's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options, rest = split_args(argv)
        WatchOptions.from_kwargs({"out_dir": ".", **options})  # (an option it refuses: before torchtitan starts)
    except (TitanArgError, TypeError, ValueError) as e:  # (ValueError: "--doctor.tokens-per-step -3" printed a
        # traceback where the other refused values print one line, a new-user trial)
        sys.exit(str(e))
    if "-h" in rest or "--help" in rest:  # the doctor's options first; torchtitan's help follows
        print(help_text(), flush=True)
    try:
        entry = importlib.import_module(ENTRY_MODULE).main
    except ImportError as e:
        sys.exit(f"fsdp_doctor.titan: torchtitan does not import here ({e})")
    trainer_cls = _trainer_class()
    if trainer_cls is None:
        version = getattr(sys.modules.get("torchtitan"), "__version__", "?")
        sys.exit(f"fsdp_doctor.titan: torchtitan {version} keeps no Trainer class in {' or '.join(TRAINER_MODULES)}")
    own = "train" in trainer_cls.__dict__
    train = trainer_cls.train

    @functools.wraps(train)
    def watched_train(self, *args, **kwargs):
        with attach(self, **options):
            return train(self, *args, **kwargs)

    trainer_cls.train = watched_train
    sys.argv = [sys.argv[0], *rest]  # (torchtitan's ConfigManager reads sys.argv)
    try:
        entry(trainer_cls) if inspect.signature(entry).parameters else entry()
    except ValueError as e:  # torchtitan's own refusal of its command line, one line (a traceback after the
        # doctor's --help without --module: a new-user trial; torchtitan.train alone does the same)
        if "--module" not in str(e):
            raise
        sys.exit(f"fsdp_doctor.titan: torchtitan: {e}")
    finally:
        if own:
            trainer_cls.train = train
        else:
            del trainer_cls.train
