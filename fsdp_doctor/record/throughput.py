"""FLOPs per step (counted once, by observing step 1's operators) and the peak-TFLOP/s table for MFU.

The count never changes the user's computation: :class:`FlopCounter` is a dispatch mode that runs every
operator exactly as called (the same kernel, the same arguments) and only reads its shapes afterwards.
torch's ``FlopCounterMode`` is not used because it *decomposes* operators missing from its table
(``silu_backward`` into its math formula, for one), which changes the gradients of every SiLU/SwiGLU model.

Two counts: *model* FLOPs (what the step needs: forward, backward, optimizer) and *hardware* FLOPs (model
FLOPs plus activation checkpointing's recompute: forward operators that run again inside backward, i.e. with
grad mode on while autograd's engine runs a backward; the engine itself runs backward kernels with grad mode
off). MFU divides the first by the step time, HFU the second.

Counting never breaks training: every exception inside it (a formula that rejects an operator's shapes, entering
or leaving the mode) is caught after the operator has run, logged once, and the count is reported as unknown
(``finish()`` returns None), so the report falls back to the analytic estimate (``analyze.throughput``: 6 x
parameters x tokens, over the parameters a token runs: a frozen base's backward and a mixture of experts'
unrouted experts left out). Attention is counted by our own formulas, which count grouped-query attention (fewer
key/value heads than query heads) as the same matmuls with the query head count, on every torch version, and
include the CPU kernels torch's table leaves out.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .phase import in_recompute

log = logging.getLogger("fsdp_doctor")

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


def sdpa_flops(query_shape, key_shape, value_shape) -> int:
    """Forward FLOPs of scaled-dot-product attention, grouped-query attention included: QK^T and AV are
    computed for every query head (the kernel broadcasts each key/value head to its group), so the count is
    that of multi-head attention with the query head count. Not halved for causal masks (torch's convention)."""
    b, h_q, s_q, d_q = query_shape
    s_k = key_shape[-2]
    d_v = value_shape[-1]
    return 2 * b * h_q * s_q * s_k * d_q + 2 * b * h_q * s_q * s_k * d_v


def sdpa_backward_flops(query_shape, key_shape, value_shape) -> int:
    """Backward FLOPs: QK^T recomputed, then dO·V^T, P^T·dO, dS·K and dS^T·Q (torch's five matmuls), every
    one over the query heads (the key/value gradients of a group are summed from its query heads)."""
    b, h_q, s_q, d_q = query_shape
    s_k = key_shape[-2]
    d_v = value_shape[-1]
    return 2 * b * h_q * s_q * s_k * (d_q + d_v + d_v + d_q + d_q)


def _fwd_formula(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flops(query_shape, key_shape, value_shape)


def _bwd_formula(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flops(query_shape, key_shape, value_shape)


# SDPA operators whose first tensors are (query, key, value), resp. (grad_out, query, key, value); the
# ones this torch lacks are skipped. The CPU kernels are missing from torch's own table (counted as 0).
_SDPA_FWD = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
_SDPA_BWD = tuple(n + "_backward" for n in _SDPA_FWD)


def attention_formulas() -> dict:
    """Our attention formulas (taking shapes) for every SDPA operator this torch has."""
    aten = torch.ops.aten
    out = {}
    for names, fn in ((_SDPA_FWD, _fwd_formula), (_SDPA_BWD, _bwd_formula)):
        for n in names:
            op = getattr(aten, n, None)
            if op is not None:
                out[op] = fn
    return out


def grouped_mm_flops(a_shape, b_shape, out_shape) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)``, the mixture-of-experts matmul (Hugging Face's default experts
    implementation, torchtitan's MoE): every routed token through its own expert only. 2-D x 2-D groups the
    contracted dimension (a weight gradient: out (groups, m, n), 2·m·k_total·n); the other layouts contract
    ``a``'s last dimension for every output element, 2·out·k. Missing from torch's table (counted as 0)."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    n_out = 1
    for d in out_shape:
        n_out *= d
    return 2 * n_out * a_shape[-1]


def _grouped_mm_formula(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return grouped_mm_flops(a_shape, b_shape, out_shape)


def _rnn_tokens(input_shape) -> int:
    """Time steps x sequences of an RNN's input (``(T, B, in)``, ``(B, T, in)`` or packed ``(sum of lengths, in)``)."""
    return math.prod(input_shape[:-1])


def _rnn_layer_formula(input_shape, w_ih_shape, w_hh_shape, *args, out_shape=None, **kwargs) -> int:
    """One LSTM layer and direction on the CPU (``aten.mkldnn_rnn_layer``, as nn.LSTM runs there): each time step
    multiplies its input by w_ih (gates x in) and its hidden state by w_hh (gates x hidden); the gates' elementwise
    work aside, as for every layer here. nn.LSTM's FLOPs read 0 without it (a new-user trial's LSTM model: MFU from
    its output Linear alone, about 4x too low)."""
    return 2 * _rnn_tokens(input_shape) * (math.prod(w_ih_shape) + math.prod(w_hh_shape))


def _rnn_layer_backward_formula(input_shape, w_ih_shape, w_hh_shape, *args, out_shape=None, **kwargs) -> int:
    """``aten.mkldnn_rnn_layer_backward``: the input's and the weights' gradients, twice the forward's matmuls."""
    return 2 * _rnn_layer_formula(input_shape, w_ih_shape, w_hh_shape)


def _cudnn_rnn_formula(input_shape, weight_shapes, *args, out_shape=None, **kwargs) -> int:
    """Every layer and direction of an RNN on cuDNN (``aten._cudnn_rnn``: its weight matrices in one list, biases
    aside): each time step multiplies by each matrix once. A layer past the first reads the previous one's output of
    as many time steps, so one count of the input's time steps serves them all."""
    return 2 * _rnn_tokens(input_shape) * sum(math.prod(w) for w in weight_shapes if len(w) == 2)


def _cudnn_rnn_backward_formula(input_shape, weight_shapes, *args, out_shape=None, **kwargs) -> int:
    return 2 * _cudnn_rnn_formula(input_shape, weight_shapes)


def flop_formulas() -> dict:
    """Operator packet -> formula called as ``f(*args, out_val=out, **kwargs)``: torch's table
    (torch.utils.flop_counter.flop_registry) with our attention and grouped-matmul formulas over it."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    table = dict(flop_registry)
    table.update({op: shape_wrapper(f) for op, f in attention_formulas().items()})
    for name in ("_grouped_mm", "grouped_mm"):  # the MoE experts' matmul, where this torch has it
        if (op := getattr(torch.ops.aten, name, None)) is not None and op not in table:
            table[op] = shape_wrapper(_grouped_mm_formula)
    for name, f in (("mkldnn_rnn_layer", _rnn_layer_formula),
                    ("mkldnn_rnn_layer_backward", _rnn_layer_backward_formula),
                    ("_cudnn_rnn", _cudnn_rnn_formula), ("_cudnn_rnn_backward", _cudnn_rnn_backward_formula)):
        if (op := getattr(torch.ops.aten, name, None)) is not None and op not in table:  # RNNs run as one operator
            table[op] = shape_wrapper(f)
    return table


class StepFlops(NamedTuple):
    model: float  # forward + backward + optimizer
    hardware: float  # model + activation checkpointing's recompute


class _Observer(TorchDispatchMode):
    """Runs each operator unchanged, then hands (op, result, args) to ``count`` (which never raises).
    Higher-order operators (flex_attention, control flow) run unchanged too, their inner operators uncounted."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """(as the memory high-water mode's, record/memory/transients.py: a frame the user compiles is compiled)"""
        return True

    def __init__(self, count):
        super().__init__()
        self._count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(t is not torch.Tensor for t in types):
            # a tensor subclass's operator (a DTensor's: tensor parallelism's) is counted on its local tensors, the
            # work this rank does (a new-user trial's column- and row-wise linears on a tp 2 mesh counted their
            # global shapes, 1.7x the rank's FLOPs: 3,768,320 for 2,195,456). The mode sees the subclass's operator
            # alone, not the local ones it runs
            self._count(func, *tree_map(_local, (out, args, kwargs)))
        else:
            self._count(func, out, args, kwargs)
        return out  # (the operator's own result, whatever was counted)


def _local(x):
    """A DTensor's local tensor (its shard on this rank); anything else as it is."""
    return getattr(x, "_local_tensor", x) if isinstance(x, torch.Tensor) else x


class FlopCounter:
    """Counts the FLOPs of one step. It observes from one ``doctor.step()`` to the next, so it sees exactly one
    step's forward, backward and optimizer; that step is marked profiled and left out of step-time statistics.

    Never raises: a failure while counting is caught after the operator has run, so the step's results are
    untouched; the count is then abandoned (``error`` says why, ``finish()`` returns None) with one warning."""

    def __init__(self):
        self.error: str | None = None
        self._on = False
        self.model = self.recompute = 0
        self.mode = None
        try:
            self.formulas = flop_formulas()
            self.mode = _Observer(self._count)
        except Exception as e:  # noqa: BLE001
            self._failed("creating the FLOP counter", e)

    def _count(self, func, out, args, kwargs) -> None:
        if self.error is not None:
            return
        formula = self.formulas.get(getattr(func, "_overloadpacket", None))
        if formula is None:
            return
        try:
            n = int(formula(*args, **kwargs, out_val=out))
        except Exception as e:  # noqa: BLE001
            self._failed(f"counting {func._overloadpacket}", e)
            return
        if in_recompute():
            self.recompute += n
        else:
            self.model += n

    def _failed(self, where: str, exc: BaseException) -> None:
        if self.error is not None:
            return
        self.error = f"{where}: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        log.warning("fsdp_doctor: FLOP counting failed (%s); training continues, the report uses the analytic "
                    "6 x (active) parameters x tokens estimate where it can, else MFU is unknown", self.error)

    def start(self) -> None:
        if self.mode is None or self.error is not None:
            return
        try:
            self.mode.__enter__()
            self._on = True
        except Exception as e:  # noqa: BLE001
            self._failed("starting the FLOP counter", e)

    def finish(self) -> StepFlops | None:
        """The step's model and hardware FLOPs, or None when counting failed."""
        self.abort()
        if self.error is not None or self.mode is None:
            return None
        return StepFlops(float(self.model), float(self.model + self.recompute))

    def abort(self) -> None:
        if self._on:
            self._on = False
            try:
                self.mode.__exit__(None, None, None)
            except Exception as e:  # noqa: BLE001
                self._failed("stopping the FLOP counter", e)
