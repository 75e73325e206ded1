"""A plain Hugging Face transformers training loop: the peer ``make bench``'s HF view times
``optbench train model=hf`` against.

It shares no code with optbench (it imports only torch, transformers and the standard library) and
is written as a person writes a first fine-tuning script: a ``LlamaConfig``,
``AutoModelForCausalLM.from_config`` (fp32, SDPA attention), random token batches drawn on the fly,
``model(input_ids=..., use_cache=False).logits``, cross-entropy on the fp32 logits, gradient clipping
at 1.0, torch's AdamW (foreach; weight decay on matrices only), warm-up + cosine learning rate.

Each step is timed from before the batch is drawn to after ``loss.item()``; the first ``--warmup``
steps are left out. Prints one JSON line: ``{"tokens_per_s": median, "step_times_s": [...], ...}``.

    python bench/hf_peer_loop.py --dim 512 --layers 8 --heads 8 --ffn 2048 --vocab 32000 \
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


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=args.dim, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads or args.heads,
                         vocab_size=args.vocab, max_position_embeddings=max(2048, args.seq),
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in (("dim", 512), ("layers", 8), ("heads", 8), ("kv_heads", 0), ("ffn", 2048),
                          ("vocab", 32000), ("batch", 8), ("seq", 256), ("steps", 8), ("warmup", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    model = build(args)
    model.train()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)

    def lr_at(step: int) -> float:
        if step < 3:
            return (step + 1) / 3
        progress = min(1.0, (step - 3) / max(1, args.steps - 3))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    generator = torch.Generator().manual_seed(0)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss.item()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(json.dumps({"tokens_per_s": args.batch * args.seq / median, "step_times_s": times,
                      "threads": torch.get_num_threads(), "loss": loss.item()}))


if __name__ == "__main__":
    main()
