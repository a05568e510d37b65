"""OLMo-core's Trainer way in: one callback that runs :func:`fsdp_doctor.watch` around ``trainer.fit()``.

    trainer.add_callback("fsdp_doctor", DoctorCallback(out_dir="doctor/run1"))
    # or: TrainerConfig(...).with_callback("fsdp_doctor", DoctorCallback(out_dir="doctor/run1"))

OLMo-core owns the loop and shards the model itself (its train module's ``Transformer.apply_fsdp``, from
``TransformerDataParallelConfig``), so the callback does what a user of ``watch()`` writes by hand: it watches the
train module's model and optimizer from ``pre_train`` (both built and sharded by then), calls ``doctor.step()`` at
``post_step`` (once per optimizer step: the train module runs the micro-batches inside it) and stops at
``post_train``, ``on_error`` or ``close``. Its priority is the lowest of the Trainer's callbacks, so a step ends
after theirs (the garbage collector's scheduled collection, the speed monitor); the checkpointer's save before the
first step is made before the watch starts, its last one (at ``post_train``) after the last step. The Trainer's
checkpoint saves are timed as ``doctor.checkpointing()`` times one (an asynchronous one: the staging the step waits
for), by wrapping this Trainer's ``save_checkpoint`` and ``save_checkpoint_async`` while it watches; nothing of it
remains on the Trainer after.

Training never depends on the doctor: a refusal (no FSDP2 unit in the model, ``out_dir`` holding another run,
pipeline parallelism) is one log line and training goes on unwatched.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import ClassVar

from ..records import OLMO_DRIVER
from .options import WatchOptions
from .tracker import Doctor, WatchError

try:
    from olmo_core.train.callbacks import Callback
except ImportError as e:  # (the module imports without OLMo-core; the callback says what it needs when built)
    Callback, _MISSING = object, e
else:
    _MISSING = None

log = logging.getLogger("fsdp_doctor")
#: the Trainer's methods that save a checkpoint (the asynchronous one returns once the state is staged)
SAVES = ("save_checkpoint", "save_checkpoint_async")


def tokens_per_step(trainer) -> int | None:
    """The job's tokens per optimizer step, each counted once: OLMo-core's data loader's global batch, in tokens."""
    try:
        return int(trainer.data_loader.global_batch_size) or None
    except Exception:  # noqa: BLE001  (another data loader: the throughput is left out, not the run)
        return None


def stays_out(module) -> str | None:
    """Why the doctor cannot watch this train module (None: it can): pipeline parallelism, whose train module holds
    a model part per stage and an optimizer per part (``model_parts``, ``optimizers``) and runs the schedule's
    micro-batches across ranks; the doctor watches one FSDP model and its loop."""
    parts = getattr(module, "model_parts", None)
    if getattr(module, "pp_enabled", False) or (parts is not None and len(parts) != 1) \
            or (not hasattr(module, "optim") and hasattr(module, "optimizers")):
        count = "" if parts is None else f", {len(parts)} model part{'s' * (len(parts) != 1)} on this rank"
        return (f"this OLMo-core job runs pipeline parallelism ({type(module).__name__}{count}), and the doctor "
                "watches one FSDP model and its loop")
    return None


class DoctorCallback(Callback):
    """Records an OLMo-core ``Trainer``'s FSDP2 training with fsdp_doctor; ``options`` are
    :func:`fsdp_doctor.watch`'s (``out_dir`` required; ``tokens_per_step`` defaults to the data loader's global
    batch), checked here so that a misspelt one fails before training starts."""

    priority: ClassVar[int] = -1000  # (the Trainer runs its callbacks highest priority first: this one last)

    def __init__(self, out_dir, **options):
        if _MISSING is not None:
            raise ImportError(f"fsdp_doctor.olmo.DoctorCallback is OLMo-core's Trainer callback: olmo_core does not "
                              f"import here ({_MISSING})")
        self.options = WatchOptions.from_kwargs({"out_dir": out_dir, **options})
        self.doctor: Doctor | None = None

    def pre_train(self):
        self._close()
        trainer = self.trainer
        module = trainer.train_module
        options = self.options
        if options.tokens_per_step is None and (tokens := tokens_per_step(trainer)):
            options = dataclasses.replace(options, tokens_per_step=tokens)
        if (why := stays_out(module)) is not None:
            log.warning("fsdp_doctor: %s; OLMo-core trains without fsdp_doctor", why)
            return
        try:
            doctor = Doctor(module.model, module.optim, options)
            doctor.driver = OLMO_DRIVER
            doctor.__enter__()
        except Exception as e:  # noqa: BLE001  (WatchError: its sentence; anything else: the doctor's own failure)
            log.warning("%s; OLMo-core trains without fsdp_doctor",
                        str(e) if isinstance(e, WatchError) else f"fsdp_doctor: {type(e).__name__}: {e}")
            return
        self.doctor = doctor
        for name in SAVES:
            inner = getattr(trainer, name, None)
            if inner is not None:
                setattr(trainer, name, self._timed(inner))

    def _timed(self, inner):
        @functools.wraps(inner)
        def save(*args, **kwargs):
            if self.doctor is None:
                return inner(*args, **kwargs)
            with self.doctor.checkpointing():
                return inner(*args, **kwargs)
        return save

    def post_step(self):
        if self.doctor is not None:
            self.doctor.step()

    def post_train(self):
        self._close()

    def on_error(self, exc: BaseException):
        self._close(exc)

    def close(self):
        self._close()

    def _close(self, exc: BaseException | None = None) -> None:
        doctor, self.doctor = self.doctor, None
        trainer = self._trainer
        if trainer is not None:
            for name in SAVES:
                trainer.__dict__.pop(name, None)  # (the class's method again)
        if doctor is not None:
            if exc is None:
                doctor.__exit__(None, None, None)
            else:
                doctor.__exit__(type(exc), exc, exc.__traceback__)


__all__ = ["DoctorCallback", "stays_out", "tokens_per_step"]
