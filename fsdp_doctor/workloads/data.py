"""Synthetic, learnable token batches: no downloads, deterministic per (seed, rank, step).

Each sequence follows a fixed random "successor" table over the vocabulary (shared by all ranks,
drawn from the seed): the next token is the successor of the current one with probability
1 - NOISE, otherwise a uniformly random token. A model can learn the table, so the loss falls from
about ln(vocab) towards the noise floor; each rank draws different sequences.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from .config import WorkloadConfig

NOISE = 0.1
_MASK63 = (1 << 63) - 1


def successor_table(cfg: WorkloadConfig) -> torch.Tensor:
    """The token -> next-token permutation the data follows (same on every rank)."""
    generator = torch.Generator().manual_seed(_mix(cfg.seed, -1, 0))
    return torch.randperm(cfg.vocab, generator=generator)


def make_batch(cfg: WorkloadConfig, rank: int, step: int,
               table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (tokens, targets) batch of `rank` at `step`: int64 CPU tensors of shape [batch_size, seq_len]."""
    table = successor_table(cfg) if table is None else table
    generator = torch.Generator().manual_seed(_mix(cfg.seed, rank, step))
    b, t = cfg.batch_size, cfg.seq_len + 1
    random_tokens = torch.randint(cfg.vocab, (b, t), generator=generator)
    follow = torch.rand((b, t), generator=generator) >= NOISE
    # the chain in plain Python: a torch op per position cost 6-12 ms of host time per batch at seq_len 512, which
    # a GPU idled through before every forward (the doctor's device clock reported it as data loading, rightly)
    succ, rand, keep = table.tolist(), random_tokens.tolist(), follow.tolist()
    rows = []
    for r, f in zip(rand, keep):
        row = [r[0]]
        for k in range(1, t):
            row.append(succ[row[-1]] if f[k] else r[k])
        rows.append(row)
    seq = torch.tensor(rows, dtype=torch.long)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def batches(cfg: WorkloadConfig, rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless iterator of `make_batch(cfg, rank, step)` for step = 0, 1, ...

    Sleeps `cfg.loader_ms` before yielding each batch (a slow data loader, on every rank).
    """
    table = successor_table(cfg)
    step = 0
    while True:
        batch = make_batch(cfg, rank, step, table)
        if cfg.loader_ms > 0:
            time.sleep(cfg.loader_ms / 1000.0)
        yield batch
        step += 1


def _mix(seed: int, rank: int, step: int) -> int:
    """A deterministic 63-bit generator seed for (seed, rank, step)."""
    return ((seed * 1_000_003 + rank + 7) * 1_000_033 + step) & _MASK63
