"""A small GPT-style decoder: the model the reference workload trains.

Module tree (the fully-qualified names matter: they are FSDP unit names):

    tok_emb                 nn.Embedding(vocab, d_model)
    pos_emb                 nn.Embedding(seq_len, d_model)       (when cfg.pos_emb)
    layers.<i>              Block
        attn_norm           nn.LayerNorm(d_model)
        attn                CausalSelfAttention: qkv Linear(d, d + 2·kv·d/h), proj Linear(d, d)
                            (kv = n_kv_heads: grouped-query attention when fewer than n_heads)
        mlp_norm            nn.LayerNorm(d_model)
        mlp                 MLP: fc1 Linear(d, 4d), GELU, fc2 Linear(4d, d)
    norm                    nn.LayerNorm(d_model)
    lm_head                 nn.Linear(d_model, vocab, bias=False)  (not tied to tok_emb)

`block_param_count` and friends give the parameter counts by formula; `analytic_param_counts` in
`sharding.py` uses them to predict what each FSDP unit holds.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import WorkloadConfig

MLP_RATIO = 4
INIT_STD = 0.02


# torch >= 2.5 broadcasts grouped key/value heads inside scaled_dot_product_attention (enable_gqa=True)
SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


class CausalSelfAttention(nn.Module):
    """Causal self-attention with a fused `qkv` projection and an output `proj`. With `n_kv_heads` below
    `n_heads` it is grouped-query attention: `n_kv_heads` key/value heads, each shared by
    `n_heads / n_kv_heads` query heads (SDPA's `enable_gqa=True` where the torch has it, else the key/value
    heads are repeated with `repeat_interleave`, which computes the same)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = d_model // n_heads
        self.kv_dim = self.n_kv_heads * self.head_dim
        self.qkv = nn.Linear(d_model, d_model + 2 * self.kv_dim)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split((d, self.kv_dim, self.kv_dim), dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (z.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2) for z in (k, v))
        if self.n_kv_heads == self.n_heads:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif SDPA_HAS_GQA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = self.n_heads // self.n_kv_heads
            y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                               is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Feed-forward block: `fc1` (d -> 4d), GELU, `fc2` (4d -> d)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, MLP_RATIO * d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(MLP_RATIO * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, n_kv_heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only language model: forward(tokens[B, T]) -> logits[B, T, vocab]."""

    def __init__(self, cfg: WorkloadConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos_emb else None
        self.layers = nn.ModuleList(Block(cfg.d_model, cfg.n_heads, cfg.n_kv_heads) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.pos_emb(positions)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def init_weights(model: GPT, n_layers: int) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases, residual projections scaled down."""
    residual_std = INIT_STD / math.sqrt(2 * n_layers)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            is_residual_out = name.endswith("attn.proj") or name.endswith("mlp.fc2")
            nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual_out else INIT_STD)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def build_model(cfg: WorkloadConfig) -> GPT:
    """The unsharded model on `cfg.device`, initialised from `cfg.seed` (identical on every rank).

    The weights are drawn on the CPU from a private generator state so that the result does not
    depend on the device or on anything that consumed random numbers before.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = GPT(cfg)
        init_weights(model, cfg.n_layers)
    return model.to(cfg.device)


def linear_count(d_in: int, d_out: int, bias: bool = True) -> int:
    """Parameter elements of nn.Linear(d_in, d_out)."""
    return d_in * d_out + (d_out if bias else 0)


def layer_norm_count(d: int) -> int:
    """Parameter elements of nn.LayerNorm(d) (weight and bias)."""
    return 2 * d


def kv_dim(cfg: WorkloadConfig) -> int:
    """Width of the key (and of the value) projection: n_kv_heads x head_dim."""
    return (cfg.n_kv_heads or cfg.n_heads) * (cfg.d_model // cfg.n_heads)


def block_leaf_counts(cfg: WorkloadConfig) -> dict[str, int]:
    """Parameter elements of each parameter-holding leaf of a block, by its path inside the block."""
    d = cfg.d_model
    return {
        "attn_norm": layer_norm_count(d),
        "attn.qkv": linear_count(d, d + 2 * kv_dim(cfg)),
        "attn.proj": linear_count(d, d),
        "mlp_norm": layer_norm_count(d),
        "mlp.fc1": linear_count(d, MLP_RATIO * d),
        "mlp.fc2": linear_count(MLP_RATIO * d, d),
    }


def block_param_count(cfg: WorkloadConfig) -> int:
    """Parameter elements of one block: 12 d^2 + 13 d (multi-head attention; fewer with grouped KV heads)."""
    return sum(block_leaf_counts(cfg).values())


def top_level_counts(cfg: WorkloadConfig) -> dict[str, int]:
    """Parameter elements of the modules outside the blocks, by top-level name."""
    counts = {"tok_emb": cfg.vocab * cfg.d_model}
    if cfg.pos_emb:
        counts["pos_emb"] = cfg.seq_len * cfg.d_model
    counts["norm"] = layer_norm_count(cfg.d_model)
    counts["lm_head"] = linear_count(cfg.d_model, cfg.vocab, bias=False)
    return counts


def total_param_count(cfg: WorkloadConfig) -> int:
    """Parameter elements of the whole model, by formula."""
    return sum(top_level_counts(cfg).values()) + cfg.n_layers * block_param_count(cfg)


def flops_per_step(cfg: WorkloadConfig) -> int:
    """FLOPs of one training step on one rank, by formula, counted as FlopCounterMode counts them: every
    matmul as 2·m·k·n (bias adds, norms, softmax and the optimizer not counted), a Linear's backward twice
    its forward (input and weight gradients), attention over all query heads and not halved for the causal
    mask (forward 2 matmuls, backward 5, each 2·b·h·T²·head_dim)."""
    d, t = cfg.d_model, cfg.seq_len
    tokens = cfg.batch_size * t
    block = d * (d + 2 * kv_dim(cfg)) + d * d + 2 * d * MLP_RATIO * d  # weight elements of the block's Linears
    linear_fwd = 2 * tokens * (cfg.n_layers * block + d * cfg.vocab)
    attn_unit = 2 * cfg.batch_size * cfg.n_heads * t * t * (d // cfg.n_heads)
    return 3 * linear_fwd + cfg.n_layers * (2 + 5) * attn_unit
