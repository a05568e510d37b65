"""jitter.data_wait tells the DataLoader's time from the loop's own: the profiled steps' ``enumerate(DataLoader)#...``
labels time the loader's next batch (``OverlapRank.dataloader_ms_per_step``). A Lightning Trainer's run read 16% of
its step "outside the model (data loading or user code)" with a num_workers fix, where its DataLoader took 0.5 ms of
the 24.5 ms a step: more workers would not have shortened it (and the recorder had not timed the window between
optimizer.step() and the next forward there, so the loss and Lightning's optimizer closure were in it). Two real runs
on one gloo rank, 30 ms of each step outside the model: a loop that sleeps after optimizer.step() (its logging) over
a fast loader, and a loader whose batches take 30 ms to load; and the Trainer's run recorded again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import fsdp_doctor
from fsdp_doctor.diagnose.rules.jitter import LOADER_PART_MIN

LIGHTNING = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "lightning_trainer_accumulate"


class _SlowBatches(torch.utils.data.Dataset):
    """Whole batches (``batch_size=None``), each ``delay`` seconds to load."""

    def __init__(self, delay: float):
        self.delay = delay

    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(i))


def _run(out: Path, load_s: float, loop_s: float):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_SlowBatches(load_s), batch_size=None)
    sched = fsdp_doctor.ProfileSchedule(first=4, active=2, warmup=1, every=0)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=sched, memory=False) as doc:
        for i, x in enumerate(loader):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(loop_s)  # the loop's own work between the steps (its logging)
            doc.step()
            if i == 9:
                break
    rep = fsdp_doctor.build_report(fsdp_doctor.load_run(out))
    return rep, next((f for f in rep.findings if f.code == "jitter.data_wait"), None)


def test_the_loops_own_time_is_not_sent_to_the_data_loader(tmp_path, gloo_one_rank):
    rep, f = _run(tmp_path / "loop", load_s=0.0, loop_s=0.03)
    loader = rep.overlap.per_rank["0"].dataloader_ms_per_step
    assert loader is not None and loader < 5.0, loader
    assert f is not None and f.evidence["outside_ms_p50"] >= 30.0, f
    assert f.evidence["dataloader_ms_per_step"] == pytest.approx(loader, abs=1e-3)
    assert f"(the loop's own code: the DataLoader took " in f.title, f.title
    text = f.recommendation.text
    assert "more loader workers would not shorten it" in text and "num_workers" not in text, text
    assert "your loop's code between the steps" in text, text


def test_a_slow_loader_keeps_its_workers_fix(tmp_path, gloo_one_rank):
    rep, f = _run(tmp_path / "loader", load_s=0.03, loop_s=0.0)
    loader = rep.overlap.per_rank["0"].dataloader_ms_per_step
    assert loader is not None and loader >= 30.0, loader
    assert f is not None and loader >= LOADER_PART_MIN * f.evidence["outside_ms_p50"], (loader, f.evidence)
    assert f.title.endswith("(data loading or user code)"), f.title
    text = f.recommendation.text
    assert "num_workers=4, prefetch_factor=4" in text and "the DataLoader's next batch took" in text, text


def test_a_lightning_trainers_time_between_batches_is_measured():
    """The recorded Trainer (accumulate_grad_batches=2, its training_step calling self.model inside the watched
    LightningModule): the records time the window between optimizer.step() and the next forward, and between the
    micro-batches (between_ms, None before), which leaves out the loss and the optimizer closure's code; its
    DataLoader took 0.28 ms a step of it; data_wait stays quiet below its 15%."""
    run = fsdp_doctor.load_run(LIGHTNING)
    for rd in run.ranks.values():
        steady = rd.steps[1:-1]  # (the last: the epoch's end, a lone micro-batch)
        assert all(s.between_ms is not None and 0 < s.between_ms < s.outside_ms for s in steady), [
            (s.between_ms, s.outside_ms) for s in steady]
    rep = fsdp_doctor.build_report(run)
    assert {r: p.dataloader_ms_per_step for r, p in rep.overlap.per_rank.items()} == {"0": 0.2817, "1": 0.2696}
    s = next(s for s in rep.rules if s.code == "jitter.data_wait")
    assert s.status == "quiet" and s.reason.startswith(
        "time between optimizer.step() and the next forward and between micro-batches is at most 4% of the step"), s
