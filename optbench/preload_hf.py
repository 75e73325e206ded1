"""Imported by the workers' forkserver (``optbench.forkserver``) when the launching process has imported
transformers' modeling code (a Hugging Face run's launcher has: its preflight built the model on the
meta device): the server imports it once, quietly, and each worker it forks has it, instead of each
worker importing it (and torchao, which it imports) on its own."""

from optbench.logs import quiet_imports

with quiet_imports():
    import transformers.modeling_utils  # noqa: F401
