"""What a GPU window's compute kernels say about how the model runs: how many kernels and how short (a step
bound by launching many small kernels), and how attention is computed (softmax kernels between matmuls where
no fused SDPA/flash kernel runs: eager attention). Summed per rank into ``OverlapSection.kernels``."""

from __future__ import annotations

import re

import numpy as np

# a kernel shorter than this costs about what its launch costs (~5-10 µs of host time per launch in eager mode)
SMALL_KERNEL_US = 10.0
# a kernel that starts within this long of its launch call's start found the device waiting for it (the launch
# call itself takes ~5-20 µs); one queued behind other work starts later: where the host runs ahead of the
# device (the step waits for collectives, copies or long kernels), kernels wait in the queue for milliseconds.
# Measured: HTA's host-bound A100 DDP trace 79% of its compute kernels within 50 µs (V100 all-reduce 62%, MI250
# 93%); the H100 FSDP rows of traces/gpu/, all waiting for loopback collectives, 0-24% (median delay 0.2-19 ms)
LAUNCH_WAIT_US = 50.0
FUSED_ATTENTION_RE = re.compile(r"flash|fmha|efficient_attention|attention_kernel|sdpa|cudnn.*(mha|attn)|"
                                r"scaled_dot_product", re.I)
# forward softmax kernels; log-softmax (the loss) and backward ones aside
SOFTMAX_RE = re.compile(r"softmax", re.I)
_NOT_ATTN_SOFTMAX_RE = re.compile(r"logsoftmax|log_softmax|backward|, true, |<[^>]*\btrue\b", re.I)
GEMM_RE = re.compile(r"gemm|gemv|cutlass|xmma|cublas|matmul|bmm", re.I)

FIELDS = ("count", "busy_us", "small_count", "small_us", "softmax_count", "softmax_us", "fused_attention_count",
          "fused_attention_us", "gemm_count", "gemm_us", "launched_count", "launch_waited_count")


def kernel_stats(names: list[str], name_idx: np.ndarray, dur_us: np.ndarray,
                 delay_us: np.ndarray | None = None) -> dict[str, float]:
    """Counts and µs of a window's compute kernels (``names[name_idx[i]]`` ran ``dur_us[i]``), by class;
    with ``delay_us`` (each kernel's start minus its launch call's start, NaN where the launch is not in the
    trace), how many have a launch (``launched_count``) and how many of those started within LAUNCH_WAIT_US
    of it (``launch_waited_count``: the device was waiting for the host)."""
    out = dict.fromkeys(FIELDS, 0.0)
    if not len(dur_us):
        return out
    if delay_us is not None:
        known = ~np.isnan(delay_us)
        out["launched_count"] = float(known.sum())
        out["launch_waited_count"] = float((delay_us[known] <= LAUNCH_WAIT_US).sum())
    cls = {"softmax": [bool(SOFTMAX_RE.search(n)) and not _NOT_ATTN_SOFTMAX_RE.search(n) for n in names],
           "fused_attention": [bool(FUSED_ATTENTION_RE.search(n)) for n in names],
           "gemm": [bool(GEMM_RE.search(n)) for n in names]}
    out["count"], out["busy_us"] = float(len(dur_us)), float(dur_us.sum())
    small = dur_us < SMALL_KERNEL_US
    out["small_count"], out["small_us"] = float(small.sum()), float(dur_us[small].sum())
    for k, flags in cls.items():
        m = np.array(flags, dtype=bool)[name_idx]
        out[f"{k}_count"], out[f"{k}_us"] = float(m.sum()), float(dur_us[m].sum())
    return out
