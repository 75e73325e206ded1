"""Building a model on the meta device without running its initializers there.

Every model optbench trains is built on the meta device (nothing allocated), wrapped, then
allocated with ``to_empty`` and initialized with its own ``init_weights`` from the run's seed.
The modules' constructors still call their initializers (``reset_parameters``, transformers'
``_init_weights``) on the meta tensors, where they compute nothing: a meta tensor has no values.
They are not free, though: torch runs the meta versions of random initializers (``normal_``,
``uniform_``) through its Python reference implementations, one call per parameter, each through
``torch._disable_dynamo`` (whose first call imports ``torch._dynamo``, 1.2-2.6 s on this project's
CPUs, where nothing else has: a run's estimate imports it anyway for its FakeTensors).
``optbench estimate model=13.1b parallel=fsdp2 estimate.world_size=8`` took 9.3 and 8.7 s with
them skipped against 10.4 and 9.9 s with them run, alternating on this CPU.

``on_meta()`` is ``torch.device("meta")`` plus a torch-function mode that returns an in-place
initializer's meta tensor unchanged. Only meta tensors are skipped, so a module that creates a real
buffer inside its constructor still gets its values, and the result is the same model: its shapes,
dtypes and structure are set by the constructors, its values only later by ``init_weights``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# in-place initializers whose result on a meta tensor is that tensor: torch.nn.init's and the
# Tensor methods they (and transformers' _init_weights) call
_INITIALIZERS = frozenset(
    [getattr(torch.nn.init, name) for name in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
        "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
    ) if hasattr(torch.nn.init, name)]
    + [getattr(torch.Tensor, name) for name in (
        "normal_", "uniform_", "exponential_", "log_normal_", "cauchy_", "geometric_", "bernoulli_", "random_",
    )]
)


class _SkipMetaInit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALIZERS:  # torch.nn.init passes its tensor by keyword
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """``torch.device("meta")`` for building a model, its initializers skipped on meta tensors."""
    with torch.device("meta"), _SkipMetaInit():
        yield
