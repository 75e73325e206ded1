"""Reviewing what runs measured: reading run directories (``runs``), pooling variants, noise-aware
statistics and verdicts (``stats``, ``drift``, ``analysis``), tables and plots (``format``,
``plots``), ``optbench report`` and ``optbench compare`` (``command``, with the options they share with validate
in ``options``), the A/B runner (``compare``) and the end-of-sweep callback (``sweep_report``)."""
