"""Memory by category (``StepRecord.memory``): the :class:`MemoryProbe` (``probe.py``) and its collaborators,
``sizes`` (FSDP byte sizes through the adapter), ``activations`` (the saved-tensor counter), ``transients``
(the exact high-water mark between marks on sampled steps), ``sampler`` (full vs replayed steps, the budget) and
``device`` (CUDA/NVML)."""

from .probe import CATEGORIES, HOST_CATEGORIES, MEMORY_FORMAT, MemoryProbe

__all__ = ["CATEGORIES", "HOST_CATEGORIES", "MEMORY_FORMAT", "MemoryProbe"]
