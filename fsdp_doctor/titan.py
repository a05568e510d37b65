"""``python -m fsdp_doctor.titan``: torchtitan's own training entry point with fsdp_doctor watching its Trainer
(``TRAIN_FILE=fsdp_doctor.titan ./run_train.sh ...``); see :mod:`fsdp_doctor.record.titan_trainer`."""

from .record.titan_trainer import attach, main

__all__ = ["attach", "main"]

if __name__ == "__main__":
    main()
