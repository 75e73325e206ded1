"""The table of model kinds: ``register_model(spec)`` adds one, ``kind_spec(cfg.model)`` finds the
kind a typed model config selects (by its exact class), ``model_spec(cfg)`` the spec a run uses (the
kind's, seen as a fused model when ``cfg.fusion`` names a fusion: ``optbench.training.kinds.fused``)."""

from __future__ import annotations

from typing import Any

from optbench.training.kinds.fused import fused
from optbench.training.kinds.spec import ModelSpec

_BY_CONFIG: dict[type, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` to the table (replacing the kind registered for the same config class or under the
    same name); returns it."""
    for config_type, known in list(_BY_CONFIG.items()):
        if known.kind == spec.kind:
            del _BY_CONFIG[config_type]
    _BY_CONFIG[spec.config_type] = spec
    return spec


def unregister_model(kind: str) -> None:
    """Remove the kind named ``kind`` (a test's own kind, once it is done)."""
    for config_type, known in list(_BY_CONFIG.items()):
        if known.kind == kind:
            del _BY_CONFIG[config_type]


def registered() -> dict[str, ModelSpec]:
    """Every registered kind, by name."""
    return {spec.kind: spec for spec in _BY_CONFIG.values()}


def kind_spec(model_cfg: Any) -> ModelSpec:
    """The kind whose ``config_type`` is ``model_cfg``'s class."""
    spec = _BY_CONFIG.get(type(model_cfg))
    if spec is None:
        known = ", ".join(f"{s.kind} ({t.__name__})" for t, s in _BY_CONFIG.items())
        raise AssertionError(f"no model kind is registered for {type(model_cfg).__name__}; registered: {known} "
                             "(optbench.training.kinds.register_model)")
    return spec


def model_spec(cfg: Any) -> ModelSpec:
    """The spec of the model ``cfg`` (the typed Config) builds."""
    spec = kind_spec(cfg.model)
    return spec if cfg.fusion.name == "none" else fused(spec)
