"""fsdp_doctor: profiling and diagnostics for PyTorch FSDP2 (``fully_shard``) training.

    with fsdp_doctor.watch(model, optimizer, out_dir="traces/run1") as doctor:
        for batch in loader:
            ...
            doctor.step()

or, with a Hugging Face ``Trainer``: ``Trainer(..., callbacks=[fsdp_doctor.DoctorCallback(out_dir="traces/run1")])``;
with torchtitan's Trainer: ``torchrun ... -m fsdp_doctor.titan --module llama3 --config ...`` (fsdp_doctor.titan);
with OLMo-core's Trainer: ``trainer.add_callback("fsdp_doctor", fsdp_doctor.olmo.DoctorCallback(out_dir=...))``.

Data flows one way: record (fsdp_doctor.record) -> store (fsdp_doctor.store) -> analyze
(fsdp_doctor.analyze, fsdp_doctor.trace) -> diagnose (fsdp_doctor.diagnose) -> present (fsdp_doctor.present).

The live side (``watch``) imports torch; the readers and analyses do not, so ``fsdp-doctor analyze``
starts fast. Names are resolved lazily for that reason.
"""

__version__ = "0.1.0"

_LAZY = {
    "watch": ("record", "watch"),
    "Doctor": ("record", "Doctor"),
    "WatchError": ("record", "WatchError"),
    "ProfileSchedule": ("record", "ProfileSchedule"),
    "DoctorCallback": ("record.hf_trainer", "DoctorCallback"),  # Hugging Face Trainer (imports transformers)
    "load_run": ("store", "load_run"),
    "Run": ("store", "Run"),
    "build_report": ("pipeline", "build_report"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{mod}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fsdp_doctor' has no attribute {name!r}")
