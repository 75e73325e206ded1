"""Pre-launch compatibility check of the whole config against this machine.

Runs before anything heavy is built. Every rule is a function of (config, machine) returning a
message that names the option that blocks the run and the fix (or a list of them), or None. ``check`` runs them all and
raises one ``IncompatibleError`` naming EVERY blocking option (a phase that inherits two CUDA-only
optimizations says so, rather than revealing the second only after the first is fixed); the run is
recorded with status ``incompatible``. Nothing is ever silently dropped: a run without the
optimization it asked for would report a false speedup.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from optbench.config import (
    Config,
    CPUOffloadOptimizerConfig,
    MuonOptimizerConfig,
    ProfileConfig,
)
from optbench.distributed import Machine, detect_machine, resolve_backend
from optbench.errors import ConfigError, IncompatibleError

Rule = Callable[[Config, Machine], "str | list[str] | None"]


def blocking_reasons(cfg: Config, machine: Machine, *, skip: tuple[Rule, ...] = ()) -> list[str]:
    """The message of every rule the config breaks on this machine, in rule order."""
    reasons: list[str] = []
    for rule in RULES:
        if rule in skip:
            continue
        message = rule(cfg, machine)
        reasons.extend([message] if isinstance(message, str) else message or [])
    return reasons


def gpu_cluster_reasons(cfg: Config, *, world_size: int, gpus_per_node: int = 8) -> list[str]:
    """What would block this config at launch on ``world_size`` CUDA GPUs (``gpus_per_node`` a node,
    one worker each): every rule in ``RULES`` on a described machine, for ``optbench estimate``. The NCCL
    check is left out: it asks this torch build, not the described cluster's."""
    local = min(world_size, gpus_per_node)
    machine = Machine(device=torch.device("cuda", 0), cuda_available=True, cuda_devices=local, cpu_threads=1,
                      world_size=world_size, local_world_size=local)
    return blocking_reasons(cfg, machine, skip=(_backend_available,))


def preflight(cfg: Config, *, seen: Callable[[Machine], None] | None = None) -> Machine:
    """The one preflight of train, compare, validate and sweeps: the typed config, this machine with
    the run's parallel plan (the world of the workers it would launch), then every rule. Returns the
    machine the run will use; raises IncompatibleError naming every blocking option, then
    ConfigError for keys that contradict each other (``check_config``). ``seen`` is
    handed the machine before the rules run (a run records its device even when it is refused)."""
    machine = detect_machine(cfg.train.device, parallel=cfg.parallel)
    if seen is not None:
        seen(machine)
    check(cfg, machine)
    check_config(cfg)
    return machine


def check(cfg: Config, machine: Machine) -> None:
    """Raise IncompatibleError naming every option that blocks this config on this machine."""
    reasons = blocking_reasons(cfg, machine)
    if len(reasons) == 1:
        raise IncompatibleError(reasons[0])
    if reasons:
        listed = "; ".join(f"({i}) {reason}" for i, reason in enumerate(reasons, 1))
        raise IncompatibleError(f"{len(reasons)} options block this run: {listed}")


def _on_cpu(machine: Machine) -> bool:
    return machine.device.type != "cuda"


def _tf32_needs_cuda(cfg: Config, machine: Machine) -> str | None:
    if cfg.precision.tf32 and machine.device.type != "cuda":
        return (
            f"precision={cfg.precision.name} needs CUDA tensor cores; on CPU the matmuls would run in "
            "plain fp32 and the run would be mislabelled: use precision=fp32 on CPU"
        )
    if cfg.precision.tf32 and machine.device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(machine.device)
        if capability < (8, 0):
            return (
                f"precision={cfg.precision.name} needs TF32 tensor cores (compute capability 8.0 or newer); "
                f"{torch.cuda.get_device_name(machine.device)} is {capability[0]}.{capability[1]}, where fp32 "
                "matmuls stay fp32: use precision=fp32 (or precision=fp16) on this GPU"
            )
    return None


# -------------------------------------------------------------------------------------- float8
def _float8_needs_sm89(cfg: Config, machine: Machine) -> str | None:
    recipe = cfg.precision.float8_recipe
    if recipe is None:
        return None
    if _on_cpu(machine):
        return (f"precision={cfg.precision.name} (float8 {recipe}) needs a CUDA GPU of compute capability 8.9 or "
                "newer (H100, H200, L4): there are no float8 matmuls on CPU; use precision=bf16 here")
    if torch.cuda.is_available():  # a described cluster (optbench estimate) has no card to ask
        major, minor = torch.cuda.get_device_capability(machine.device)
        if (major, minor) < (8, 9):
            return (f"precision={cfg.precision.name} (float8 {recipe}) needs compute capability 8.9 or newer "
                    f"(float8 tensor cores); this GPU is {major}.{minor}: use precision=bf16 on it")
    return None


def _float8_dims_divisible_by_16(cfg: Config, machine: Machine) -> str | None:
    if cfg.precision.float8_recipe is None:
        return None
    from optbench.training.float8 import misaligned_dims

    # lm: seq_len tokens per sample (other tasks' token counts depend on their data: not checked here)
    tokens = cfg.train.batch_size * cfg.train.seq_len if cfg.task.name == "lm" else None
    problems = misaligned_dims(dim=cfg.model.dim, ffn_dim=cfg.model.ffn_dim, tokens_per_micro_batch=tokens)
    if problems:
        return (f"precision={cfg.precision.name} needs every float8 matmul dimension divisible by 16; "
                f"not divisible: {'; '.join(problems)}")
    return None


# ------------------------------------------------------------------------------------- compile
def _reduce_overhead_needs_cuda(cfg: Config, machine: Machine) -> str | None:
    if cfg.compile.name == "reduce-overhead" and _on_cpu(machine):
        return (
            "compile=reduce-overhead means CUDA graphs, which do not exist on CPU (torch.compile would "
            "silently run it as mode=default): use compile=default on CPU"
        )
    return None


# ----------------------------------------------------------------------------------- attention
def _flex_backward_needs_cuda(cfg: Config, machine: Machine) -> str | None:
    if cfg.attention.name == "flex" and _on_cpu(machine):
        return (
            f"attention=flex needs CUDA to train: FlexAttention does not support backward on CPU "
            f"(torch {torch.__version__}); use attention=sdpa on CPU"
        )
    return None


# ----------------------------------------------------------------------------------- optimizer
def _cpu_offload(cfg: Config) -> CPUOffloadOptimizerConfig | None:
    return cfg.optimizer if isinstance(cfg.optimizer, CPUOffloadOptimizerConfig) else None


def _cpu_offload_needs_cuda(cfg: Config, machine: Machine) -> str | None:
    if _cpu_offload(cfg) and _on_cpu(machine):
        return (
            "optimizer=cpu_offload needs CUDA: torchao's CPUOffloadOptimizer moves optimizer state from "
            "the GPU to the CPU and supports only CUDA and XPU; on CPU use optimizer=adamw"
        )
    return None


def _cpu_offload_single_gpu(cfg: Config, machine: Machine) -> str | None:
    if _cpu_offload(cfg) and cfg.parallel.name != "single":
        fix = (
            "use FSDP2's own offload instead: phase=7_fsdp2_cpu_offload_policy, or optimizer=adamw "
            "parallel.cpu_offload=true"
            if cfg.parallel.name == "fsdp2"
            else "use parallel=fsdp2 parallel.cpu_offload=true with optimizer=adamw"
        )
        return (
            f"optimizer=cpu_offload cannot run with parallel={cfg.parallel.name}: torchao documents its "
            f"CPUOffloadOptimizer for single-GPU training only; {fix}"
        )
    return None


def _cpu_offload_no_clipping(cfg: Config, machine: Machine) -> str | None:
    if _cpu_offload(cfg) and cfg.train.clip_grad is not None:
        return (
            f"optimizer=cpu_offload does not support gradient clipping (torchao copies each gradient "
            f"to the CPU as backward produces it, before clipping could act): set train.clip_grad=null "
            f"instead of {cfg.train.clip_grad}"
        )
    return None


def _cpu_offload_gradients_vs_accumulation(cfg: Config, machine: Machine) -> str | None:
    offload = _cpu_offload(cfg)
    if offload and offload.offload_gradients and cfg.train.grad_accum > 1:
        return (
            f"optimizer.offload_gradients=true is not compatible with gradient accumulation "
            f"(train.grad_accum={cfg.train.grad_accum}): torchao frees the device gradients after every "
            f"backward; set optimizer.offload_gradients=false or train.grad_accum=1"
        )
    return None


def _cpu_offload_vs_grad_scaler(cfg: Config, machine: Machine) -> str | None:
    if _cpu_offload(cfg) and cfg.precision.grad_scaler:
        return (
            f"optimizer=cpu_offload cannot be combined with precision={cfg.precision.name}'s loss "
            "scaling: GradScaler would unscale the device gradients after torchao has already copied "
            "them to the CPU; use precision=bf16 (no scaling)"
        )
    return None


def _onecycle_needs_one_momentum(cfg: Config, machine: Machine) -> str | None:
    kind = "muon" if isinstance(cfg.optimizer, MuonOptimizerConfig) else "cpu_offload" if _cpu_offload(cfg) else None
    if kind and cfg.train.schedule == "onecycle":
        return (
            f"train.schedule=onecycle cycles the optimizer's momentum, which optimizer={kind} does not "
            f"expose as one setting; use train.schedule=cosine or constant"
        )
    return None


# ------------------------------------------------------------------------------------ parallel
def _fsdp_cpu_offload_needs_cuda(cfg: Config, machine: Machine) -> str | None:
    if cfg.parallel.cpu_offload and _on_cpu(machine):
        return (
            "parallel.cpu_offload=true offloads FSDP2's shards from the GPU to the CPU; on a CPU run "
            "everything already lives there, so it would measure nothing: set parallel.cpu_offload=false "
            "on CPU"
        )
    return None


# --------------------------------------------------------------------------------- distributed
def _fsdp2_needs_ranks(cfg: Config, machine: Machine) -> str | None:
    if cfg.parallel.name == "fsdp2" and machine.world_size < 2:
        return (
            "parallel=fsdp2 with world size 1 has nothing to shard (every parameter would stay whole on "
            "one rank); set parallel.nproc_per_node=2 or more (or torchrun --nproc-per-node), or use "
            "parallel=single"
        )
    return None


def _single_is_one_process(cfg: Config, machine: Machine) -> str | None:
    if cfg.parallel.name == "single" and machine.world_size > 1:
        return (
            f"parallel=single but torchrun started {machine.world_size} processes, which would each train "
            "alone; use parallel=ddp or parallel=fsdp2 under torchrun"
        )
    return None


def _workers_fit_gpus(cfg: Config, machine: Machine) -> str | None:
    if machine.device.type == "cuda" and machine.local_world_size > machine.cuda_devices:
        nodes = max(machine.world_size // max(machine.local_world_size, 1), 1)
        if cfg.parallel.name == "fsdp2" and nodes * machine.cuda_devices < 2:
            return (  # one worker per GPU would leave FSDP2 a single rank, which _fsdp2_needs_ranks refuses
                f"parallel=fsdp2 shards over 2 or more GPUs but torch sees {machine.cuda_devices} on this "
                f"{'node' if nodes > 1 else 'machine'}; run it where {machine.local_world_size} GPUs are "
                "visible (or on more nodes), or use parallel=single"
            )
        return (
            f"{machine.local_world_size} workers per node need {machine.local_world_size} GPUs but torch sees "
            f"{machine.cuda_devices}; set parallel.nproc_per_node={machine.cuda_devices} (one worker per GPU)"
        )
    return None


def _backend_available(cfg: Config, machine: Machine) -> str | None:
    if cfg.parallel.name == "single":
        return None
    try:
        resolve_backend(cfg.parallel.backend, device=machine.device)
    except IncompatibleError as exc:
        return str(exc)
    return None


# -------------------------------------------------------------------------------------- fusion
def _fusion_needs_climate_text(cfg: Config, machine: Machine) -> str | None:
    fusion = cfg.fusion
    others = {"fusion.base_checkpoint": fusion.base_checkpoint is not None,
              "fusion.encoder_checkpoint": fusion.encoder_checkpoint is not None,
              "fusion.freeze_encoder": fusion.freeze_encoder}
    if cfg.task.name != "climate_text" and (fusion.name != "none" or any(others.values())):
        option = f"fusion={fusion.name}" if fusion.name != "none" else next(k for k, v in others.items() if v)
        return (
            f"{option} fuses climate into a language model, which only task=climate_text provides (task="
            f"{cfg.task.name} has no climate context); use task=climate_text, or fusion=none"
        )
    return None


def _climate_text_needs_fusion(cfg: Config, machine: Machine) -> str | None:
    if cfg.task.name == "climate_text" and cfg.fusion.name == "none":
        return ("task=climate_text with fusion=none would never read the climate; use fusion=add, "
                "fusion=cross_attention, fusion=gated or fusion=prefix")
    return None


def _freeze_base_leaves_something(cfg: Config, machine: Machine) -> str | None:
    if cfg.fusion.freeze_base and cfg.fusion.name == "none":
        return ("fusion.freeze_base=true with fusion=none freezes the whole model: nothing is left to train; "
                "set fusion.freeze_base=false, or add fusion layers (fusion=add|cross_attention|gated|prefix)")
    return None


def _base_checkpoint_fits(cfg: Config, machine: Machine) -> str | None:
    if cfg.fusion.base_checkpoint is None or cfg.fusion.name == "none":
        return None
    from optbench.checkpoint.base import check_base_checkpoint

    try:
        check_base_checkpoint(cfg.fusion.base_checkpoint, model=cfg.model)
    except ConfigError as exc:
        return str(exc)
    return None


def _encoder_checkpoint_fits(cfg: Config, machine: Machine) -> str | None:
    if cfg.fusion.encoder_checkpoint is None or cfg.task.name != "climate_text":
        return None
    from optbench.training.climate_encoder import check_encoder_checkpoint

    try:
        check_encoder_checkpoint(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


# ----------------------------------------------------------------------------------- run control
def _memory_snapshot_needs_cuda(cfg: Config, machine: Machine) -> str | None:
    if cfg.profile.memory_snapshot and machine.device.type != "cuda":
        return ("profile.memory_snapshot records the CUDA caching allocator; this run is on "
                f"{machine.device.type}: use profile.memory_snapshot=false (profile.profile_memory records the "
                "operators' memory on any device)")
    return None


def profile_window(cfg: ProfileConfig, *, start: int) -> range:
    """The steps the profiler records (its warm-up and active steps) in a run that starts after
    ``start`` steps; they are left out of the timing."""
    first = start + cfg.skip_first + cfg.wait
    return range(first, first + cfg.warmup + cfg.active)


def profile_window_error(cfg: ProfileConfig, *, start: int, steps: int, warmup_steps: int) -> str | None:
    """Why the profiler's window does not fit a run of steps ``start``..``steps - 1`` (0-based, as
    every step number optbench prints) that times the steps after ``warmup_steps``: it goes past the
    last step, or it takes every step that would be timed."""
    window = profile_window(cfg, start=start)
    if not cfg.enabled:
        return None
    if window.stop > steps:
        return (f"profile: the recorded steps {window.start}..{window.stop - 1} go past the last step, {steps - 1} "
                f"(train.steps={steps}); raise train.steps or lower profile.skip_first/wait/warmup/active")
    timed = [s for s in range(start + warmup_steps, steps) if s not in window]
    if not timed:
        return (f"profile: the recorded steps {window.start}..{window.stop - 1} take every step timed after "
                f"measure.warmup_steps={warmup_steps} (train.steps={steps}), so no step would be timed; raise "
                "train.steps or lower profile.active/warmup")
    return None


def _early_stopping_needs_evaluations(cfg: Config) -> str | None:
    if cfg.stopping.patience and not cfg.train.eval_every:
        return (f"stopping.patience={cfg.stopping.patience} watches the evaluation, but train.eval_every=0 "
                "evaluates only after the last step; set train.eval_every (e.g. 10)")
    return None


def check_config(cfg: Config) -> None:
    """ConfigError for keys that contradict each other (each schema checks its own keys alone); a
    resumed run's profile window is checked again where its first step is known (the profiler)."""
    for message in (_early_stopping_needs_evaluations(cfg),
                    profile_window_error(cfg.profile, start=0, steps=cfg.train.steps,
                                         warmup_steps=cfg.measure.warmup_steps)):
        if message:
            raise ConfigError(message)
# --------------------------------------------------------------------------------- the model kind
def _model_fits_the_run(cfg: Config, machine: Machine) -> list[str]:
    """The model kind's own rules (``ModelSpec.preflight``: a Hugging Face model built on the meta
    device as the run would build it, its weights checked against it; a user's module on task=lm)."""
    from optbench.training.kinds import model_spec

    return model_spec(cfg).preflight(cfg)


ENERGY_DATA = ("embeddings", "energy_synthetic")


def _energy_flow_needs_its_model_and_data(cfg: Config, machine: Machine) -> list[str]:
    """task=energy_flow trains the energy-flow kind on teacher embeddings, and only it reads them (the
    kind's own rules, ``optbench.training.kinds.energy_flow``, refuse what else cannot apply)."""
    from optbench.training.kinds import model_spec

    energy_task, energy_data = cfg.task.name == "energy_flow", cfg.data.name in ENERGY_DATA
    if energy_task and model_spec(cfg).kind != "energy_flow":
        return [f"task=energy_flow trains the energy-flow model, not model={cfg.model.name}: use "
                "model=energy_tiny, energy_cpu, energy_experiment or energy_rtx5090"]
    if energy_data and not energy_task:
        return [f"data={cfg.data.name} is the energy-flow pipeline's teacher embeddings; use task=energy_flow with it, "
                "or other data"]
    return []


RULES: list[Rule] = [
    _tf32_needs_cuda,
    _float8_needs_sm89,
    _float8_dims_divisible_by_16,
    _reduce_overhead_needs_cuda,
    _flex_backward_needs_cuda,
    _cpu_offload_needs_cuda,
    _cpu_offload_single_gpu,
    _cpu_offload_no_clipping,
    _cpu_offload_gradients_vs_accumulation,
    _cpu_offload_vs_grad_scaler,
    _onecycle_needs_one_momentum,
    _fsdp_cpu_offload_needs_cuda,
    _single_is_one_process,
    _fsdp2_needs_ranks,
    _workers_fit_gpus,
    _backend_available,
    _fusion_needs_climate_text,
    _climate_text_needs_fusion,
    _freeze_base_leaves_something,
    _base_checkpoint_fits,
    _encoder_checkpoint_fits,
    _memory_snapshot_needs_cuda,
    _energy_flow_needs_its_model_and_data,
    _model_fits_the_run,
]
