"""Each optimization's effect: the same numbers where numerics must not change, different ones
where they must, and summary.json saying exactly what was applied."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optbench.config import to_config
from optbench.data.loader import leave_stop_signals_to
from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.tasks import build_task
from optbench.training.build import build_model, build_train_loader, materialize
from tests.helpers import FAST, compose_cfg


def losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run.run_dir) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    """The reference run every variant below is compared with."""
    return train(compose_cfg([*FAST, "train.eval_batches=0"]), run_dir=tmp_path_factory.mktemp("eager"))


def test_fused_adamw_matches_foreach(tmp_path):
    # 10 steps: since the z-loss shares cross-entropy's pass and RoPE is one complex multiply, the
    # last-bit differences first show at step 7
    # on an AMD EPYC (all 6 of the shared fixture's steps are bit-identical there)
    ten = [*FAST, "train.eval_batches=0", "train.steps=10"]
    fused = train(compose_cfg([*ten, "optimizer=adamw_fused"]), run_dir=tmp_path / "fused")
    eager = train(compose_cfg(ten), run_dir=tmp_path / "foreach")
    assert fused.summary["applied"]["optimizer"]["impl"] == "fused"
    assert eager.summary["applied"]["optimizer"]["impl"] == "foreach"
    # the same update; the fused kernel rounds differently in the last bits (from step 7 on an AMD
    # EPYC): equal before any update, close after, and not identical (an ignored
    # optimizer=adamw_fused would repeat foreach's losses)
    assert losses(fused) == pytest.approx(losses(eager), rel=1e-6)
    assert losses(fused)[0] == losses(eager)[0] and losses(fused) != losses(eager)


def test_bf16_changes_the_numbers_but_not_the_result(eager, tmp_path):
    bf16 = train(compose_cfg([*FAST, "train.eval_batches=0", "precision=bf16"]), run_dir=tmp_path)
    assert bf16.status == "completed", bf16.error
    assert losses(bf16) != losses(eager)
    assert losses(bf16) == pytest.approx(losses(eager), rel=2e-2)


def test_compile_matches_eager_within_1e_5(eager, tmp_path):
    # estimate.predict=false: on a CPU the prediction times one compiled block before the loop, which
    # warms Inductor's cache, and this test reads the run's own compile time
    compiled = train(compose_cfg([*FAST, "train.eval_batches=0", "compile=default", "estimate.predict=false"]),
                     run_dir=tmp_path)
    assert compiled.status == "completed", compiled.error
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-5)
    applied = compiled.summary["applied"]["compile"]
    assert applied["mode"] == "default" and applied["blocks"] == 4
    assert applied["cudagraphs"] is False and applied["cudagraphs_recorded"] == 0  # read back: none on a CPU
    assert applied["graphs"] >= 1 and applied["compile_s_in_timed_steps"] == 0.0
    # really compiled, outside the timed steps: 10 s with a cold Inductor cache here, 0.25-0.5 s in a
    # worker process that compiled before (Inductor imported and warm: tests/estimate compiles a block)
    assert compiled.summary["throughput"]["compile_s"] > 0.1
    assert eager.summary["throughput"]["compile_s"] == 0.0 and eager.summary["applied"]["compile"]["blocks"] == 0


def test_muon_takes_the_trunk_matrices_and_adamw_the_rest(eager, tmp_path):
    muon = train(compose_cfg([*FAST, "train.eval_batches=0", "optimizer=muon", "estimate.in_run=true"]), run_dir=tmp_path)
    assert muon.status == "completed", muon.error
    applied = muon.summary["applied"]["optimizer"]
    layers = 4
    assert applied["muon"]["tensors"] == 6 * layers  # wq wk wv wo w1 w2 per block
    assert applied["muon"]["numel"] == layers * (4 * 128 * 128 + 2 * 128 * 512)
    assert applied["adamw"]["tensors"] == 2 + 2 * layers + 1  # embed, head, two norms per block, final norm
    assert applied["muon"]["numel"] + applied["adamw"]["numel"] == muon.summary["model"]["params"]
    assert losses(muon)[0] == losses(eager)[0] and losses(muon)[1:] != losses(eager)[1:]
    assert losses(muon)[-1] < losses(muon)[0]
    # MemTracker sees AdamW's states through the chain (a ChainMap hid them: the estimate was 2-15% above)
    memory = muon.summary["memory"]
    assert abs(memory["estimate_bytes"] - memory["peak_bytes"]) <= 1e-3 * memory["peak_bytes"], memory


def test_muon_chain_is_scheduled_and_stepped_as_one():
    from optbench.optim.optimizers import build_optimizer, build_scheduler

    cfg = to_config(compose_cfg(["optimizer=muon", "train.warmup_steps=2"]))
    model = build_model(cfg, build_task(cfg))
    materialize(model, device=torch.device("cpu"), seed=0)
    optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=1e-2)
    scheduler = build_scheduler(optimizer, cfg=cfg.train)
    inner_lrs = {name: opt.param_groups[0]["lr"] for name, opt in optimizer.optimizers.items()}
    assert inner_lrs == {"muon": pytest.approx(5e-3), "adamw": pytest.approx(5e-3)}  # warm-up step 1 of 2
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17))
    model(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.optimizers["adamw"].param_groups[0]["lr"] == pytest.approx(1e-2)
    muon_state = optimizer.optimizers["muon"].state
    assert all(p.ndim == 2 for p in muon_state) and len(muon_state) == 24
    assert len(optimizer.state) == 24 + len(optimizer.optimizers["adamw"].state)
    # reading every state through the chain (as MemTracker and a checkpoint's size do) creates nothing
    # in Muon's defaultdict and finds AdamW's two moments and step for each of its tensors
    held = [v for state in optimizer.state.values() for v in state.values()]
    assert len(muon_state) == 24 and len(held) == 24 + 3 * len(optimizer.optimizers["adamw"].state)
    with pytest.raises(KeyError):
        optimizer.state[torch.nn.Parameter(torch.zeros(1))]


def test_tuned_loader_feeds_the_same_batches_with_workers(eager, tmp_path):
    tuned = train(compose_cfg([*FAST, "train.eval_batches=0", "dataloader=tuned"]), run_dir=tmp_path)
    assert tuned.status == "completed", tuned.error
    assert losses(tuned) == losses(eager)  # workers produce exactly the samples the main process would
    applied = tuned.summary["applied"]["dataloader"]  # read from the DataLoader the run built
    assert applied["num_workers"] == 2 and applied["prefetch_factor"] == 2 and applied["persistent_workers"]
    assert applied["pin_memory"] is False and "no CUDA" in applied["pin_memory_note"]  # FAST runs on CPU
    default = eager.summary["applied"]["dataloader"]
    assert default["num_workers"] == 0 and default["prefetch_factor"] is None  # torch's own value without workers
    frac = tuned.summary["throughput"]["data_wait_frac"]
    assert 0.0 <= frac < 1.0
    assert all("data_wait_s" in r for r in read_metrics(tmp_path) if r["kind"] == "train")


class _WithPid(torch.utils.data.Dataset):
    """The training set, each sample tagged with the process that produced it."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        return {**self.inner[index], "pid": torch.tensor(os.getpid())}


def test_tuned_loader_batches_come_from_its_worker_processes():
    """An ignored dataloader.num_workers would make the main process produce every batch."""
    from optbench.data.loader import describe_loader
    from optbench.distributed import detect_machine

    cfg = to_config(compose_cfg([*FAST, "dataloader=tuned"]))
    train_set, _ = build_task(cfg).build_datasets()
    machine = detect_machine("cpu", parallel=cfg.parallel)
    loader = build_train_loader(_WithPid(train_set), cfg=cfg, machine=machine)
    batches = iter(loader)
    pids = {int(pid) for _ in range(4) for pid in next(batches)["pid"]}
    assert os.getpid() not in pids and len(pids) == cfg.dataloader.num_workers == 2
    assert describe_loader(loader, cfg=cfg.dataloader)["num_workers"] == 2
    del batches


def test_a_stop_signal_from_outside_leaves_the_loader_workers_to_the_trainer():
    """A terminal's Ctrl-C and a cluster's SIGTERM reach the loader workers too; the trainer stops at
    a step boundary after a checkpoint, so its workers go on producing batches (a worker ended here
    made torch fail the run: "DataLoader worker (pid N) is killed by signal: Terminated")."""
    from optbench.distributed import detect_machine

    cfg = to_config(compose_cfg([*FAST, "dataloader=tuned"]))
    train_set, _ = build_task(cfg).build_datasets()
    loader = build_train_loader(_WithPid(train_set), cfg=cfg, machine=detect_machine("cpu", parallel=cfg.parallel))
    batches = iter(loader)
    pids = {int(pid) for _ in range(4) for pid in next(batches)["pid"]}
    for sig in ("-TERM", "-INT"):  # from another process, as a terminal's or a cluster's
        subprocess.run(["kill", sig, *map(str, sorted(pids))], check=True)
    time.sleep(0.5)  # a worker the signal ended would be gone (and torch's handler would raise) well within this
    assert {int(pid) for _ in range(8) for pid in next(batches)["pid"]} == pids
    del batches


def _a_worker_waiting(trainer: int, ready) -> None:
    leave_stop_signals_to(trainer, lambda worker_id: ready.set(), 0)
    while True:
        time.sleep(1)


def test_a_loader_worker_still_ends_when_the_trainer_ends_it():
    """torch ends a worker that did not stop with SIGTERM (Process.terminate), as multiprocessing does
    with its daemon processes at exit: the trainer's own signal still ends it, anyone else's does not."""
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    worker = context.Process(target=_a_worker_waiting, args=(os.getpid(), ready), daemon=True)
    worker.start()
    try:
        assert ready.wait(30)
        subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)
        worker.join(0.5)
        assert worker.is_alive()
        worker.terminate()  # from this process: the trainer's
        worker.join(30)
        assert worker.exitcode == 128 + signal.SIGTERM
    finally:
        if worker.is_alive():
            worker.kill()


class _Ops(TorchDispatchMode):
    """The ATen ops a forward really dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernel", ["sdpa", "math"])
def test_the_attention_kernel_is_the_one_the_blocks_run(kernel):
    """applied.attention is read from the blocks; the ops a forward dispatches show the kernel ran:
    SDPA's fused op, or the explicit softmax(QK^T)V and no fused op."""
    from optbench.training.attention import describe_attention

    cfg = to_config(compose_cfg(["model=tiny", f"attention={kernel}"]))
    model = build_model(cfg, build_task(cfg))
    materialize(model, device=torch.device("cpu"), seed=0)
    assert describe_attention(model) == kernel
    with _Ops() as ops:
        model(torch.randint(0, cfg.model.vocab_size, (2, 16)))
    fused = {name for name in ops.names if "scaled_dot_product" in name}
    if kernel == "sdpa":
        assert fused and "aten._softmax" not in ops.names
    else:
        assert not fused and {"aten._softmax", "aten.bmm"} <= ops.names


def test_z_loss_sees_exactly_num_queries_positions():
    cfg = to_config(compose_cfg(["loss_freq=every_4", "loss_freq.num_queries=37", "train.batch_size=2",
                                 "train.seq_len=32"]))
    task = build_task(cfg)
    batch = {"tokens": torch.randint(0, cfg.model.vocab_size, (2, 33))}
    logits = torch.randn(2, 32, cfg.model.vocab_size, requires_grad=True)
    task.losses(logits, batch, with_aux=True).aux["z_loss"].backward()
    touched = (logits.grad.abs().sum(-1) > 0).sum().item()
    assert touched == 37
    assert task.describe_aux() == {"aux_loss": "z_loss", "positions_per_micro_batch": 37, "of_positions": 64}
    every = to_config(compose_cfg(["loss_freq=every_step", "train.batch_size=2", "train.seq_len=32"]))
    assert build_task(every).describe_aux()["positions_per_micro_batch"] == 64  # 2048 > 64: all of them


def test_every_4_computes_the_aux_loss_on_steps_0_and_4(tmp_path):
    run = train(compose_cfg([*FAST, "train.eval_batches=0", "loss_freq=every_4"]), run_dir=tmp_path)
    records = [r for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in records if r["aux_computed"]] == [0, 4]
    assert all(("z_loss" in r["aux"]) == r["aux_computed"] for r in records)
    assert run.summary["applied"]["loss_freq"]["every"] == 4
    assert run.summary["applied"]["loss_freq"]["num_queries"] == 1024
    # the CPU memory peak is taken on an aux-loss step (step 4), which is then not timed
    assert "step 4" in run.summary["memory"]["peak_source"]
    assert [r["step"] for r in records if r["timed"]] == [2, 3, 5]


def test_tf32_is_refused_on_a_gpu_without_tf32_units(monkeypatch):
    """TF32 needs compute capability 8.0: on an older GPU the flag changes nothing, so such a run
    would be mislabelled (and measured against a TF32 peak): refused, naming the fix."""
    from optbench.distributed import Machine
    from optbench.errors import IncompatibleError
    from optbench.training import preflight as compat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    gpu = Machine(device=torch.device("cuda", 0), cuda_available=True, cuda_devices=1, cpu_threads=2)
    with pytest.raises(IncompatibleError, match=r"compute capability 8\.0.*V100.* is 7\.0.*precision=fp32"):
        compat.check(to_config(compose_cfg(["precision=tf32"])), gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    compat.check(to_config(compose_cfg(["precision=tf32"])), gpu)  # an H100 runs it
