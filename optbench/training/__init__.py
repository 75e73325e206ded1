"""How a model is made ready and stepped: the shared builders (``build``), the one forward/backward
body (``step``), the one order of optimizations (``parallelize``: precision, float8, attention,
activation checkpointing, compile, DDP/FSDP2 — one ``apply_<concern>`` module each) and the one
compatibility table checked before anything is built (``preflight``)."""
