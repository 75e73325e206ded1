"""``optbench estimate``: the step traced under FakeTensorMode (``tracer``, ``memtrace``), stacked
block by block for deep models (``stacking``), the micro-batch search (``fit``), and what CUDA
libraries hold beside the tensors (``cuda_libs``)."""
