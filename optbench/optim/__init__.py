"""Optimizers: AdamW (foreach or fused), Muon on the 2-D hidden weights, torchao's CPU-offload
optimizer, and the weight-decay grouping they share (``build_optimizer``)."""
