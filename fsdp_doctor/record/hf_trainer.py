"""The Hugging Face ``Trainer`` way in: one callback that runs :func:`fsdp_doctor.watch` around ``trainer.train()``.

    trainer = Trainer(..., callbacks=[fsdp_doctor.DoctorCallback(out_dir="doctor/run1")])

The Trainer owns the loop, so the callback does what a user of ``watch()`` writes by hand: it starts watching at
``on_train_begin`` (the model is sharded and the optimizer built by then; accelerate's ``AcceleratedOptimizer`` is
unwrapped by ``watch``), calls ``doctor.step()`` after every micro-batch (``on_substep_end``: one without an
optimizer step, which the doctor counts into the step's ``micro_batches``) and at ``on_step_end`` (after the
optimizer, the scheduler and ``zero_grad``), and stops at ``on_train_end``. Evaluation between steps runs the model without
gradients: the recorder keeps those forward passes apart (``StepRecord.no_grad_ms``), so they are neither the
step's forward nor time outside the model. A checkpoint save (``save_strategy``) is timed as
``doctor.checkpointing()`` times one (``StepRecord.checkpoint_ms``): the Trainer calls no callback before a save,
so it is taken to start at the Trainer's last event before its ``on_save`` (the step's end, its log, its
evaluation: ``Trainer._maybe_log_save_evaluate`` runs them in that order, then the save).

Training never depends on the doctor: a refusal (no FSDP2 unit in the model, ``out_dir`` holding another run)
is one log line and training goes on unwatched. A ``train()`` that raised leaves no hook behind either: the next
``on_train_begin`` closes the watch first.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from ..records import TRAINER_DRIVER
from .options import WatchOptions
from .tracker import Doctor, WatchError, _now

log = logging.getLogger("fsdp_doctor")


class DoctorCallback(TrainerCallback):
    """Records a ``Trainer``'s FSDP2 training with fsdp_doctor; ``options`` are :func:`fsdp_doctor.watch`'s
    (``out_dir`` required), checked here so that a misspelt one fails before training starts."""

    def __init__(self, out_dir, **options):
        self.options = WatchOptions.from_kwargs({"out_dir": out_dir, **options})
        self.doctor: Doctor | None = None
        self._last_event = 0  # perf_counter_ns of the Trainer's last event that can come before a save

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._close()
        doctor = Doctor(model, optimizer, self.options)
        doctor.driver = TRAINER_DRIVER
        kind = type(args)
        doctor.trainer_args = f"{kind.__module__.partition('.')[0]}.{kind.__qualname__}"
        try:
            doctor.__enter__()
        except WatchError as e:
            log.warning("%s; training goes on without fsdp_doctor", _trainer_refusal(e, args, model))
            return
        self.doctor = doctor

    def on_substep_end(self, args, state, control, **kwargs):
        if self.doctor is not None:
            self.doctor.step()

    def on_step_end(self, args, state, control, **kwargs):
        self.on_substep_end(args, state, control)
        self._last_event = _now()

    def _event(self, args, state, control, **kwargs):
        self._last_event = _now()

    on_log = on_evaluate = on_epoch_end = _event

    def on_save(self, args, state, control, **kwargs):
        if self.doctor is not None and self._last_event:
            self.doctor.saved_since(self._last_event)

    def on_train_end(self, args, state, control, **kwargs):
        self._close()

    def _close(self) -> None:
        doctor, self.doctor = self.doctor, None
        if doctor is not None:
            doctor.__exit__(None, None, None)


def _trainer_refusal(e: WatchError, args, model) -> str:
    """The refusal as a Trainer's user can act on it: a model with no FSDP2 unit under the Trainer is one the Trainer
    did not shard (the one thing its user sets is TrainingArguments.fsdp), not one to call fully_shard on. A
    new-user trial asked for FSDP2 on CPU: accelerate ran DDP instead and the line said to apply fully_shard."""
    if "has no FSDP2 unit" not in str(e):
        return str(e)
    asked = bool(getattr(args, "fsdp", None)) or bool((getattr(args, "fsdp_config", None) or {}).get("fsdp_version"))
    try:
        from accelerate.state import PartialState

        kind = str(PartialState().distributed_type).split(".")[-1]
    except Exception:  # noqa: BLE001 - no state yet, or no accelerate: the kind is not said
        kind = ""
    ran = f" (accelerate's distributed type: {kind})" if kind else ""
    if asked:
        return (f"fsdp_doctor.watch: the Trainer did not shard {type(model).__name__} with FSDP2{ran}, though "
                "TrainingArguments.fsdp asks for it: accelerate applies FSDP only where its distributed type is FSDP "
                "(on a CPU host it runs DDP); fsdp_doctor reads the FSDP2 units it would make")
    return (f"fsdp_doctor.watch: the Trainer did not shard {type(model).__name__} with FSDP2{ran}: set "
            "TrainingArguments(fsdp=..., fsdp_config={'fsdp_version': 2, ...}) for fsdp_doctor to have FSDP2 units to "
            "read")
