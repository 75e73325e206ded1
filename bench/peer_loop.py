"""An independent, minimal PyTorch training loop: the peer ``make bench`` times optbench against.

It shares no code with optbench (it imports only torch and the standard library) and is written
the way a person writes a first training script (nanoGPT style): token embedding, pre-norm blocks
(RMSNorm, causal SDPA attention with rotary position embeddings, a GELU MLP), a final norm, an
untied head, cross-entropy, gradient clipping at 1.0 and torch's AdamW (foreach, weight decay on
matrices only), a warm-up + cosine learning rate, random token batches drawn on the fly.

Each step is timed from before the batch is drawn to after ``loss.item()`` (which waits for the
step's kernels); the first ``--warmup`` steps are left out. Prints one JSON line:
``{"tokens_per_s": median, "step_times_s": [...], ...}``.

    python bench/peer_loop.py --dim 512 --layers 8 --heads 8 --ffn 2048 --vocab 32000 \
        --batch 8 --seq 256 --steps 8 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Rotary(nn.Module):
    def __init__(self, head_dim: int, seq: int, theta: float = 10000.0) -> None:
        super().__init__()
        freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angle = torch.arange(seq, dtype=torch.float64)[:, None] * freqs[None, :]
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, T, D), channel pairs interleaved
        t = x.shape[-2]
        cos, sin = self.cos[:t], self.sin[:t]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, rotary: Rotary) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(self.rotary(q), self.rotary(k), v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, rotary: Rotary) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=1e-5)
        self.attn = SelfAttention(dim, heads, rotary)
        self.norm2 = nn.RMSNorm(dim, eps=1e-5)
        self.fc = nn.Linear(dim, ffn, bias=False)
        self.out = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, *, vocab: int, dim: int, layers: int, heads: int, ffn: int, seq: int) -> None:
        super().__init__()
        rotary = Rotary(dim // heads, seq)
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Layer(dim, heads, ffn, rotary) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = 1 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 1.0
                nn.init.normal_(p, std=0.02 * scale)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("dim", 512), ("layers", 8), ("heads", 8), ("ffn", 2048), ("vocab", 32000),
                          ("batch", 8), ("seq", 256), ("steps", 8), ("warmup", 3)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, ffn=args.ffn, seq=args.seq)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)

    def lr_at(it: int) -> float:
        if it < args.warmup:
            return args.lr * (it + 1) / args.warmup
        progress = (it - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    times, losses = [], []
    for it in range(args.steps):
        t0 = time.perf_counter()
        data = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
        x, y = data[:, :-1], data[:, 1:]
        for group in opt.param_groups:
            group["lr"] = lr_at(it)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        elapsed = time.perf_counter() - t0
        if it >= args.warmup:
            times.append(elapsed)
    tokens = args.batch * args.seq
    print(json.dumps({"tokens_per_s": tokens / statistics.median(times), "step_times_s": times,
                      "tokens_per_step": tokens, "threads": torch.get_num_threads(), "loss": losses[-1]}))


if __name__ == "__main__":
    main()
