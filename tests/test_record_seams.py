"""The recorder's typed seams: FSDP2's label grammar (one torch-free parser for the hooks and the trace builder),
WatchOptions (watch()'s options in one place) and the optimizer unwrapping."""

from __future__ import annotations

import pytest
import torch

from fsdp_doctor.fsdp_labels import FsdpLabel, parse_label


@pytest.mark.parametrize("name,parsed", [
    ("FSDP::pre_forward (layers.0)", FsdpLabel("pre_forward", "layers.0")),
    ("FSDP::pre_backward ()", FsdpLabel("pre_backward", "")),
    ("FSDP::root_pre_forward", FsdpLabel("root_pre_forward", None)),
    ("FSDP::all_gather (layers.1) [pg=3]", FsdpLabel("all_gather", "layers.1", 3)),
    ("FSDP::post_backward_reduce (norm, lm_head)", FsdpLabel("post_backward_reduce", "norm, lm_head")),
    ("FSDP::backward_prefetch for layers.2", FsdpLabel("backward_prefetch", "layers.2")),
    ("FSDP::forward_prefetch for ", FsdpLabel("forward_prefetch", "")),
    ("aten::mm", None),
    ("FSDP::", None),
])
def test_label_grammar(name, parsed):
    assert parse_label(name) == parsed


def test_the_hooks_and_the_trace_builder_share_the_grammar():
    import fsdp_doctor.fsdp_labels as labels
    import fsdp_doctor.record.hooks as hooks
    import fsdp_doctor.trace.model as model

    assert hooks.parse_label is labels.parse_label and model.parse_label is labels.parse_label
    assert not hasattr(model, "LABEL_RE")  # no second copy of the grammar


def test_watch_options_in_one_place():
    from fsdp_doctor.record.options import WatchOptions

    o = WatchOptions.from_kwargs({"out_dir": "x", "tokens_per_step": 8})
    assert o.counts_flops and not WatchOptions(out_dir="x").counts_flops
    assert not WatchOptions(out_dir="x", peak_tflops=1.0, count_flops=False).counts_flops
    with pytest.raises(TypeError, match="unknown option.*tokens_per_stepp.*options: out_dir"):
        WatchOptions.from_kwargs({"out_dir": "x", "tokens_per_stepp": 8})
    with pytest.raises(TypeError, match="out_dir is required"):
        WatchOptions.from_kwargs({})


def test_optimizer_wrappers_unwrapped_and_misuse_refused_in_one_sentence():
    from fsdp_doctor.record.tracker import WatchError, unwrap_optimizer

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    class Wrapper(torch.optim.Optimizer):  # accelerate's shape: an Optimizer subclass without Optimizer.__init__
        def __init__(self, optimizer):
            self.optimizer = optimizer

    class Plain:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    assert unwrap_optimizer(opt) is opt and unwrap_optimizer(None) is None
    assert unwrap_optimizer(Wrapper(Plain(opt))) is opt
    with pytest.raises(WatchError) as e:
        unwrap_optimizer(object())
    assert "not a torch.optim.Optimizer" in str(e.value) and "\n" not in str(e.value)
