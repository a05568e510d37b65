"""``fsdp_doctor.olmo.DoctorCallback``: OLMo-core's Trainer watched by fsdp_doctor
(``trainer.add_callback("fsdp_doctor", DoctorCallback(out_dir=...))``); see :mod:`fsdp_doctor.record.olmo_trainer`."""

from .record.olmo_trainer import DoctorCallback

__all__ = ["DoctorCallback"]
