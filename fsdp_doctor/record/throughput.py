"""FLOPs per step (counted once with FlopCounterMode) and the peak-TFLOP/s table for MFU."""

from __future__ import annotations

from torch.utils.flop_counter import FlopCounterMode

# Dense peak TFLOP/s by device-name fragment and compute dtype (vendor datasheets, no sparsity).
# The first fragment found in torch.cuda.get_device_name() wins, so longer names come first.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0, "tf32": 494.0}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0, "tf32": 378.0}),
    ("H100", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0, "tf32": 494.0}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5, "tf32": 156.0}),
    ("A10G", {"bfloat16": 70.0, "float16": 70.0, "float32": 31.2}),
    ("L40S", {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6}),
    ("L4", {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3}),
    ("V100", {"float16": 125.0, "float32": 15.7}),
    ("MI300X", {"bfloat16": 1307.0, "float16": 1307.0, "float32": 163.4}),
    ("MI250", {"bfloat16": 383.0, "float16": 383.0, "float32": 47.9}),
    ("B200", {"bfloat16": 2250.0, "float16": 2250.0, "float32": 80.0}),
]


def device_peak_tflops(device_name: str, dtype: str) -> float | None:
    for frag, table in PEAK_TFLOPS:
        if frag.lower() in device_name.lower():
            return table.get(dtype)
    return None


class FlopCounter:
    """Counts the FLOPs of one step. The mode is entered at one ``doctor.step()`` and left at the next,
    so it sees exactly one step's forward, backward and optimizer; that step is marked profiled and left
    out of step-time statistics."""

    def __init__(self):
        self.mode = FlopCounterMode(display=False)
        self._on = False

    def start(self) -> None:
        self.mode.__enter__()
        self._on = True

    def finish(self) -> float:
        self.mode.__exit__(None, None, None)
        self._on = False
        return float(self.mode.get_total_flops())

    def abort(self) -> None:
        if self._on:
            self.mode.__exit__(None, None, None)
            self._on = False
