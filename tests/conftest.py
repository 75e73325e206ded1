"""Fixtures and hooks only; the helpers tests share are in tests/helpers.py."""

from __future__ import annotations

import gc

import pytest

from optbench.collector import imports_held


def pytest_configure(config):
    """What nearly every test of a worker imports, imported once with the collector held off and frozen
    (optbench.collector: about 2.4 of 6.8 CPU-s of these imports are the collector's passes over them),
    in each process that runs tests: a pytest-xdist worker, or pytest without ``-n``. The controller of
    ``-n N`` runs none: the imports there only put off the workers' start by their time. transformers'
    modeling code among them, as a Hugging Face run's launcher has it: the workers' forkserver a test
    starts then imports it once (optbench.forkserver.PRELOAD_IF_IMPORTED), not each worker it forks."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    from optbench.logs import quiet_imports

    with imports_held(), quiet_imports():
        import hydra  # noqa: F401
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401
        import transformers.modeling_utils  # noqa: F401
        import xarray  # noqa: F401

        import optbench.estimate.tracer  # noqa: F401
        import optbench.run.train  # noqa: F401


# the collector's first threshold in a pytest-xdist worker: 10,000 allocations where Python's default is
# 700, so a full collection comes every ~1,000,000 allocations, not every ~70,000 (composed configs are
# cycles of parent links, and a worker holds torch, transformers and Inductor). On 4 test files, 2 workers:
# 9.7 of 140 CPU-s went to the collector, 5.0 with it (collection callbacks timed; peak RSS 604-770 MB
# either way). Only this process: the commands and workers the tests start are fresh interpreters.
gc.set_threshold(10_000, 10, 10)

# The slowest tests, slowest first (each tens of seconds on 2 cores: distributed runs, subprocesses,
# Inductor). `make test` runs them first: ``--dist loadgroup`` hands pytest-xdist's workers one test
# at a time in this order (``--dist load`` would hand each a block of ~100 consecutive tests), so the
# last tests of the suite are short ones and neither worker waits on the other at the end. (Its
# ``xdist_group`` marks do nothing with pytest 9: xdist 3.8 renames ``item._nodeid``, which pytest 9
# no longer reads; runs that tests on both workers share go through ``tests.helpers.once_per_session``.)
# A test missing here only starts later; rank a new slow test by its time in ``pytest --durations=30``.
# The four Inductor tests are kept apart: with an empty cache the first builds Inductor's precompiled
# header and vector-ISA checks (about 14 s of g++), and another starting meanwhile waits on their locks.
# The first goes second, beside the DDP test that trains the session's torchrun run (the next DDP tests
# wait for that run). Their four times together, two full runs each: 94.2 and 88.0 s listed by time
# (the energy-flow one started beside the first, 29.0-31.8 s), 73.9 and 79.8 s spread (14.2-14.9 s).
SLOW_FIRST = (
    "tests/training/test_parallel.py::test_sigterm_to_the_whole_group_then_resume_equals_an_uninterrupted_ddp_run",
    "tests/estimate/test_predict.py::test_a_compiled_block_is_compiled_and_timed_for_real_on_this_cpu",
    "tests/training/test_parallel.py::test_fsdp2_interrupted_then_resumed_is_exact_and_matches_ddp",
    "tests/training/test_parallel.py::test_ddp_over_two_ranks_reproduces_the_single_process_curve",
    "tests/test_docs.py::test_documented_overrides_compose_and_type_check",
    "tests/model/test_hf_fusion.py::test_fsdp2_over_two_workers_trains_the_fusion_and_leaves_the_pretrained_",
    "tests/model/test_energy_groups.py::test_the_vectorized_flows_compile_and_match_eager",
    "tests/validate/test_validate.py::test_make_validate_on_a_cpu_picks_phase_4_runs_both_sides_reports_",
    "tests/estimate/test_hf_accuracy.py::test_the_estimate_of_an_unnamed_architecture_is_its_measured_peak",
    "tests/model/test_hf.py::test_fsdp2_trains_from_sharded_weights_and_resumes_exactly",
    "tests/model/test_energy_flow.py::test_a_sweep_of_the_plans_phases_reports_each_claim_beside_its_measured_",
    "tests/run/test_tracking.py::test_a_sweep_is_grouped_in_mlflow_and_wandb_with_config_scalars_figures_and_",
    "tests/model/test_hf.py::test_a_compiled_checkpointed_llama_is_estimated_within_2_percent_of_its_measured_",
    "tests/report/test_report_runs.py::test_compare_runs_a_and_b_with_the_same_seed_and_reports",
    "tests/test_wheel.py::test_the_installed_wheel_trains_estimates_and_reports_outside_the_checkout",
    "tests/estimate/test_stacking.py::test_the_same_estimate_whatever_the_hash_seed",
    "tests/model/test_fusion.py::test_fsdp2_over_two_workers_trains_the_fusion_and_leaves_the_frozen_base_",
    "tests/model/test_hf.py::test_ddp_equals_single_process",
    "tests/estimate/test_estimate.py::test_a_compiled_checkpointed_run_is_estimated_within_2_percent_of_its_",
    "tests/estimate/test_predict.py::test_a_plan_candidate_traced_on_its_configurations_shared_model_is_its_",
    "tests/training/test_parallel.py::test_bf16_fsdp2_from_the_command_line",
    "tests/model/test_energy_flow.py::test_the_estimate_is_the_measured_cpu_peak_for_every_form",
    "tests/bench/test_gpu_check_predict.py::test_the_predict_mode_tabulates_predicted_beside_measured",
    "tests/model/test_energy_groups.py::test_ddp_over_two_ranks_reproduces_the_single_process_curve",
    "tests/test_docs.py::test_runnable_commands_run_at_tiny_sizes",
    "tests/estimate/test_predict.py::test_the_planner_ranks_what_fits_by_predicted_speed",
    "tests/estimate/test_stacking.py::test_the_stacked_step_equals_the_whole_trace",
    "tests/estimate/test_stacking.py::test_every_micro_batch_of_a_search_is_stacked_alike",
    "tests/estimate/test_estimate.py::test_fsdp2_run_on_two_ranks_records_its_estimate_and_trains_after_it",
    "tests/run/test_run_control.py::test_sigterm_during_a_stuck_step_ends_within_the_bound",
    "tests/config/test_config.py::test_every_preset_composes_and_converts",
    "tests/model/test_hf_fusion.py::test_the_estimate_says_what_fits_on_one_two_and_four_gpus",
    "tests/data/test_climate_loader.py::test_the_gpu_data_check_runs_at_a_tiny_size_on_the_cpu",
    "tests/tasks/test_climate.py::test_synth_inspect_train_from_the_command_line",
    "tests/model/test_hf_fusion.py::test_activation_checkpointing_recomputes_the_fusion_with_the_same_climate",
    "tests/estimate/test_predict.py::test_a_compiled_block_saves_what_the_partitioner_chooses",
    "tests/estimate/test_hf_accuracy.py::test_the_estimate_of_an_hf_model_is_the_first_thing_on_the_screen",
    "tests/estimate/test_predict.py::test_the_planner_refuses_what_it_cannot_search_in_one_line",
    "tests/run/test_tracking.py::test_a_run_failing_in_the_loop_is_marked_failed",
    "tests/estimate/test_estimate.py::test_ddp_adds_a_second_copy_of_the_gradients_and_cpu_offload_moves_",
    "tests/training/test_optimizations.py::test_compile_matches_eager_within_1e_5",
    "tests/config/test_config.py::test_full_error_shows_the_traceback",
    "tests/test_structure.py::test_the_traced_estimate_is_pinned",
    "tests/training/test_parallel.py::test_sigkill_during_a_checkpoint_write_then_exact_resume_and_keep_last",
    "tests/run/test_run_control.py::test_time_budget_stops_with_a_checkpoint_and_resumes_exactly",
    "tests/model/test_energy_groups.py::test_checkpointing_the_flow_processor_gives_the_identical_loss_and_",
    "tests/run/test_train.py::test_cli_run_writes_every_output",
    "tests/config/test_renames.py::test_a_sweep_over_an_old_group_name_trains_each_option",
    "tests/run/test_run_control.py::test_a_config_larger_than_the_device_is_refused_naming_what_fits",
)


def _slow_rank(item) -> int:
    return next((i for i, prefix in enumerate(SLOW_FIRST) if item.nodeid.startswith(prefix)), len(SLOW_FIRST))


def pytest_collection_modifyitems(config, items):
    """The known-slow tests first (``SLOW_FIRST``), the rest in their own order.
    ``@pytest.mark.cuda`` tests need a CUDA device, ``@pytest.mark.multi_gpu`` ones two: without
    them they are skipped with the reason (select them on a GPU machine with ``-m "cuda or multi_gpu"``)."""
    items.sort(key=_slow_rank)  # stable: the same order in every pytest-xdist worker
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("multi_gpu") and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, this machine has {gpus}"))
        elif item.get_closest_marker("cuda") and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session", autouse=True)
def _presets_merged_once_per_session(tmp_path_factory):
    """optbench.config.compose's table of merged presets, shared by the session's workers
    (``tests.helpers.SharedPresets``)."""
    import optbench.config as config
    from tests.helpers import SharedPresets, shared_directory

    directory = shared_directory(tmp_path_factory) / "presets"
    directory.mkdir(exist_ok=True)
    own = config._COMPOSED
    config._COMPOSED = SharedPresets(directory, own)
    yield
    config._COMPOSED = own


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """The CPU peak cache is per machine; tests share one measured value per session."""
    cache = tmp_path_factory.getbasetemp() / "optbench-cache"
    monkeypatch.setenv("OPTBENCH_CACHE_DIR", str(cache))
    # the report's tables take the terminal's width: every test sees the width of a non-terminal
    # (120) unless it sets its own, whatever an earlier in-process command left behind
    monkeypatch.setenv("COLUMNS", "120")


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
    """A completed 4-step run with checkpoints at steps 2 and 4 (``tests.helpers.SAVING``), trained
    once per worker; a test that changes it works on ``tests.helpers.copy_of`` it."""
    from optbench.run.train import train
    from tests.helpers import SAVING, compose_cfg

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = train(compose_cfg(SAVING), run_dir=run_dir)
    assert result.status == "completed", result.error
    return run_dir


@pytest.fixture(scope="session")
def fast_run(tmp_path_factory):
    """A completed run of ``tests.helpers.FAST`` as it stands (the default config at the tiny size),
    trained once per worker: the reference the tests that compare one change against the defaults
    share (read it, never write into its directory)."""
    from optbench.run.train import train
    from tests.helpers import FAST, compose_cfg

    result = train(compose_cfg(FAST), run_dir=tmp_path_factory.mktemp("fast") / "run")
    assert result.status == "completed", result.error
    return result


@pytest.fixture(scope="session")
def bf16_fsdp2_cli(tmp_path_factory):
    """The headline command on a CPU, ``optbench train precision=bf16 parallel=fsdp2`` over two gloo
    workers as a user types it (its own process): (run directory, its stdout). Two ranks cost tens
    of seconds to start, so the tests of the command line and of the workers' estimate share it,
    once per session whichever pytest-xdist worker runs them."""
    from tests.helpers import once_per_session, run_cli

    def make(directory):
        done = run_cli("train", "precision=bf16", "parallel=fsdp2", "parallel.nproc_per_node=2", "model=tiny",
                       "train.device=cpu", "train.steps=4", "train.batch_size=2", "train.seq_len=32",
                       "measure.warmup_steps=1", "train.eval_batches=1", "log.progress=log",
                       # no per-op benchmark before the loop: the torchrun DDP run of
                       # tests/training/test_parallel.py checks the two-rank prediction
                       "estimate.predict=false", f"hydra.run.dir={directory / 'run'}", timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    directory, stdout = once_per_session(tmp_path_factory, "bf16_fsdp2", make)
    return directory / "run", stdout
