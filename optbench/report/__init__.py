"""Reviewing what runs measured: reading run directories (``runs``), pooling variants, noise-aware
statistics and verdicts (``stats``, ``drift``, ``analysis``), tables and plots (``format``,
``plots``), ``optbench report`` (``command``) and ``optbench compare``."""
