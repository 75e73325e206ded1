"""Models as ``nn.Module``s: optbench's own transformer (``transformer``), Hugging Face causal LMs
behind the same block interface (``hf``, ``decoder``), the climate-text fusion layers (``fusion``,
``hf_fusion``), pretrained safetensors (``weights``) and parameter counts (``counts``). What a run
does with each kind of model (build, block groups, weights, counts, summary) is its spec in
``optbench.training.kinds``."""
