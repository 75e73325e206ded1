"""Autoregressive decoding of a climate_text model: greedy (``temperature=0``) or sampled
(softmax at ``temperature``, over the ``top_k`` most likely tokens when ``top_k > 0``), a batch of
samples at once, each after the same prompt, until its end-of-text token or ``max_new`` tokens.
Each new token runs through the model once (the kind's ``ModelSpec.decode_step``: a key/value cache); the
climate is the same at every step."""

from __future__ import annotations

from collections.abc import Callable

import torch


def pick(logits: torch.Tensor, *, temperature: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """The next token of each row of ``logits`` ``(B, vocab)``."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


@torch.no_grad()
def decode(step: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, *, max_new: int, end: int,
           temperature: float, top_k: int, generator: torch.Generator) -> list[list[int]]:
    """The tokens written after ``prompt`` ``(B, P)``, each row up to (not including) ``end``;
    ``step`` (``ModelSpec.decode_step``: new token ids ``(B, n)`` -> their logits
    ``(B, n, vocab)``, the climate bound in, earlier positions cached) is given the prompt, then
    each new token."""
    done = torch.zeros(prompt.shape[0], dtype=torch.bool)
    out: list[list[int]] = [[] for _ in range(prompt.shape[0])]
    logits = step(prompt)
    for i in range(max_new):
        nxt = pick(logits[:, -1].float(), temperature=temperature, top_k=top_k, generator=generator).cpu()
        for row, token in enumerate(nxt.tolist()):
            if done[row]:
                continue
            if token == end:
                done[row] = True
            else:
                out[row].append(token)
        if bool(done.all()) or i == max_new - 1:
            break
        logits = step(nxt[:, None].to(prompt.device))
    return out


def text_of(codec, ids: list[int]) -> str:
    """The text of token ids (bytes: UTF-8, a broken sequence replaced rather than refused)."""
    if codec.tokenizer is None:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
    return codec.tokenizer.decode(ids)


def prompt_ids(codec, prompt: str) -> list[int]:
    """What a text starts with: the codec's beginning-of-text id, then the prompt's tokens."""
    return [codec.bos, *codec.ids(prompt).tolist()] if prompt else [codec.bos]
