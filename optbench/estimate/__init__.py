"""Before launch: what a config costs. ``api`` is what other packages call (counts, the closed form,
the device, the throughput model, ``estimate``); ``command`` is ``optbench estimate``/``plan`` and
``format`` what they print. Beneath them: the step traced under FakeTensorMode (``tracer``,
``memtrace``), stacked block by block for deep models (``stacking``), the micro-batch search
(``fit``), what CUDA libraries hold beside the tensors (``cuda_libs``), the speed prediction
(``predict``, ``op_timings``, ``roofline``) and the planner (``plan``)."""
