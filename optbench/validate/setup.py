"""What ``optbench validate`` runs here: the two sides' overrides, each phase composed and checked
against this machine (the same preflight as train), the furthest phase that runs, and what each
side's epoch holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from optbench.config.renames import upgrade_and_warn
from optbench.errors import IncompatibleError, ReportError
from optbench.outputs import flatten
from optbench.report.runs import natural_key, num, parse_override


def phase_names() -> list[str]:
    from optbench.config import conf_dir

    return sorted((p.stem for p in (conf_dir() / "phase").glob("*.yaml")), key=natural_key)


def split_overrides(items: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(common, baseline, candidate): ``candidate=X``/``baseline=X`` name one side, the rest both."""
    common, sides = [], {"baseline": [], "candidate": []}
    for item in items:
        key, sep, value = item.partition("=")
        if sep and key in sides:
            if not value:
                raise ReportError(f"{key}= needs a phase or an override, e.g. {key}=phase=6_bf16")
            sides[key].append(value)
        elif parse_override(item)[0] == "phase":
            raise ReportError(f"{item} would set both sides; name the candidate's phase with candidate={item}")
        elif parse_override(item)[0].startswith("hydra."):
            raise ReportError(f"{item}: validate puts every run under --out itself; drop the hydra override")
        else:
            common.append(item)
    return upgrade_and_warn(common), sides["baseline"], sides["candidate"]


def side_overrides(spec: list[str], *, what: str, phases: list[str], default_phase: str) -> list[str]:
    """``6_bf16`` or ``phase=6_bf16`` -> ``phase=6_bf16``; other overrides kept; a side without a
    phase builds on ``default_phase``."""
    out = upgrade_and_warn([f"phase={item}" if "=" not in item else item for item in spec])
    chosen = [parse_override(o)[1] for o in out if parse_override(o)[0] == "phase"]
    if len(chosen) > 1:
        raise ReportError(f"{what} names {len(chosen)} phases ({', '.join(chosen)}); give one")
    for name in chosen:
        if name not in phases:
            raise ReportError(f"unknown {what} phase '{name}'; the phases are: {', '.join(phases)}")
    return out if chosen else [f"phase={default_phase}", *out]


# ------------------------------------------------------------------------------- what runs here
@dataclass
class PhaseState:
    name: str
    reasons: list[str]  # empty: it runs on this machine

    @property
    def runnable(self) -> bool:
        return not self.reasons


@dataclass
class Side:
    key: str  # "A" (baseline), "B" (candidate), or "phase-<name>" (--all-phases)
    role: str  # baseline | candidate | intermediate
    overrides: list[str]
    cfg: Any = None  # the composed DictConfig
    config: Any = None  # the typed Config

    @property
    def phase(self) -> str | None:
        found = [parse_override(o)[1] for o in self.overrides if parse_override(o)[0] == "phase"]
        return found[0] if found else None


@dataclass
class Setup:
    common: list[str]
    sides: list[Side]  # baseline first, candidate last
    states: list[PhaseState]
    samples_per_epoch: int | None
    notes: list[str] = field(default_factory=list)
    picked: bool = False  # the candidate is the furthest phase that runs here (no candidate= given)

    @property
    def baseline(self) -> Side:
        return self.sides[0]

    @property
    def candidate(self) -> Side:
        return self.sides[-1]

    def state(self, name: str | None) -> PhaseState | None:
        return next((s for s in self.states if s.name == name), None)


class Composer:
    """``optbench.config.compose`` (as ``optbench train`` composes), typed, once per override list
    (Hydra's compose takes ~0.3 s; the phases and the sides share configs)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, overrides: list[str], *, what: str):
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        from optbench.config import compose, to_config

        key = tuple(overrides)
        try:
            if key not in self._cache:
                cfg = compose(overrides)
                self._cache[key] = cfg, to_config(cfg)
            return self._cache[key]
        except (HydraException, OmegaConfBaseException, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            error = ReportError(f"{what} overrides {' '.join(overrides) or '(none)'}: {first}")
            error.reason = first  # type: ignore[attr-defined]  (a phase's row shows only this)
            raise error from None


def blocking_reasons(config: Any) -> list[str]:
    """What would refuse this config at launch here: compat's preflight (the one check train and
    compare run), with each of its rules' reasons listed apart for the report."""
    from optbench.training import preflight as compat

    machines: list[Any] = []
    try:
        compat.preflight(config, seen=machines.append)
    except IncompatibleError as exc:
        return (compat.blocking_reasons(config, machines[0]) if machines else []) or [str(exc)]
    return []


def phase_states(compose: Composer, common: list[str], phases: list[str]) -> list[PhaseState]:
    states = []
    for name in phases:
        try:
            _cfg, config = compose([f"phase={name}", *common], what=f"phase {name}")
        except ReportError as exc:
            states.append(PhaseState(name, [getattr(exc, "reason", str(exc))]))
            continue
        states.append(PhaseState(name, blocking_reasons(config)))
    return states


def choose_candidate(states: list[PhaseState], baseline_phase: str) -> str:
    """The furthest phase in the plan's order, after the baseline, that runs on this machine."""
    after = [s for s in states if natural_key(s.name) > natural_key(baseline_phase)]
    runnable = [s for s in after if s.runnable]
    if not runnable:
        blocked = "; ".join(f"{s.name}: {s.reasons[0]}" for s in after) or "there are none"
        raise ReportError(f"no phase after {baseline_phase} runs on this machine ({blocked})")
    return runnable[-1].name


def phase_settings(phase: str) -> dict[str, str]:
    """What a phase preset sets, its chain of earlier phases included, read from conf/phase/: group
    choices (``override /compile: default`` -> compile=default) and values (train.batch_size=16)."""
    import yaml

    from optbench.config import conf_dir

    text = (conf_dir() / "phase" / f"{phase}.yaml").read_text()
    node = yaml.safe_load(text) or {}
    settings: dict[str, str] = {}
    for entry in node.pop("defaults", []) or []:
        if isinstance(entry, str) and entry.startswith("/phase/"):
            settings.update(phase_settings(entry.removeprefix("/phase/")))
        elif isinstance(entry, dict):
            for key, value in entry.items():
                settings[key.removeprefix("override ").lstrip("/")] = str(value)

    settings.update({key: str(value) for key, value in flatten(node).items()})
    return settings


def overridden_phase_settings(common: list[str], phase: str, baseline_phase: str) -> list[str]:
    """Overrides given for both sides that replace what ``phase`` itself changes (``parallel=ddp``
    turns phase 7's FSDP2 into DDP): said, so that nobody reads the row as the plan's phase."""
    own, base = phase_settings(phase), phase_settings(baseline_phase)
    notes = []
    for item in common:
        key, value = parse_override(item)
        if key in own and own[key] != base.get(key):
            notes.append(f"{key}={value} is given for both sides, so phase {phase}'s own change of {key} "
                         f"({base.get(key, '-')} -> {own[key]}) is not measured")
    return notes


def epoch_samples(config: Any) -> int | None:
    """Training samples in one epoch of the configured data (the task's own train dataset)."""
    from optbench.tasks import build_task

    train, _eval = build_task(config).build_datasets()
    try:
        return len(train)
    except TypeError:  # a streaming dataset (data=netcdf) knows its split
        return num(getattr(getattr(train, "split", None), "num_samples", None))


def prepare(argv_overrides: list[str], *, all_phases: bool) -> Setup:
    """Everything that can be refused is refused here, before anything trains."""
    from optbench.report.compare import check_same_experiment

    common, base_spec, cand_spec = split_overrides(argv_overrides)
    phases = phase_names()
    base_overrides = side_overrides(base_spec, what="baseline", phases=phases, default_phase="0_baseline")
    base_phase = Side("A", "baseline", base_overrides).phase
    cand_known = side_overrides(cand_spec, what="candidate", phases=phases, default_phase=base_phase) if cand_spec else None
    compose = Composer()
    baseline = Side("A", "baseline", [*base_overrides, *common])
    baseline.cfg, baseline.config = compose(baseline.overrides, what="baseline")
    if reasons := blocking_reasons(baseline.config):
        raise ReportError(f"the baseline ({' '.join(base_overrides)}) cannot run on this machine: {reasons[0]}")
    states = None
    if cand_known is None:  # the furthest phase that runs here
        states = phase_states(compose, common, phases)
        cand_known = [f"phase={choose_candidate(states, base_phase)}"]
    candidate = Side("B", "candidate", [*cand_known, *common])
    candidate.cfg, candidate.config = compose(candidate.overrides, what="candidate")
    _refuse_identical(baseline, candidate)
    if reasons := blocking_reasons(candidate.config):
        raise ReportError(f"candidate {' '.join(cand_known)} cannot run on this machine, so it cannot be "
                          f"validated here: {'; '.join(reasons)} (without candidate=, optbench validate "
                          "picks the furthest phase that runs here)")
    check_same_experiment(baseline.cfg, candidate.cfg)
    states = states or phase_states(compose, common, phases)
    sides = [baseline]
    if all_phases:
        sides += intermediate_sides(compose, common, states, base_phase, candidate)
    sides.append(candidate)
    notes = []
    for side in sides[1:]:
        if side.phase and side.phase != base_phase:
            notes += overridden_phase_settings(common, side.phase, base_phase)
    return Setup(common, sides, states, epoch_samples(baseline.config), notes, picked=not cand_spec)


def _refuse_identical(baseline: Side, candidate: Side) -> None:
    from omegaconf import OmegaConf

    a = OmegaConf.to_container(baseline.cfg, resolve=True)
    b = OmegaConf.to_container(candidate.cfg, resolve=True)
    if a == b:
        raise ReportError(
            f"the candidate ({' '.join(candidate.overrides)}) resolves to the same config as the baseline "
            f"({' '.join(baseline.overrides)}): nothing to validate; name another candidate=PHASE"
        )


def intermediate_sides(compose: Composer, common: list[str], states: list[PhaseState], base_phase: str,
                       candidate: Side) -> list[Side]:
    if candidate.phase is None or candidate.phase == base_phase:
        raise ReportError("--all-phases needs a candidate phase after the baseline's (candidate=PHASE)")
    low, high = natural_key(base_phase), natural_key(candidate.phase)
    sides = []
    for state in states:
        if state.runnable and low < natural_key(state.name) < high:
            side = Side(f"phase-{state.name}", "intermediate", [f"phase={state.name}", *common])
            side.cfg, side.config = compose(side.overrides, what=f"phase {state.name}")
            sides.append(side)
    return sides
