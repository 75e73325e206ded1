"""A checkpoint is data, never code: loading one (resume, fusion.base_checkpoint) runs nothing it
holds; bytes overwritten in place are found by the hashes recorded at save; a badly typed or damaged
checkpoint is one line, or a fallback to the intact one before it."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
from pathlib import Path, PosixPath

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from optbench.checkpoint import base, digests, safe
from optbench.checkpoint import store as checkpoint
from optbench.config import to_config
from optbench.errors import ConfigError
from optbench.outputs import read_metrics
from optbench.run.train import train
from tests.helpers import FAST, SAVING, compose_cfg, copy_of


def step(run: Path, n: int) -> Path:
    return run / "checkpoints" / f"step-{n:08d}"


class RunsACommand:
    """What an attacker pickles: unpickling it runs ``touch marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path: Path, marker: Path) -> None:
    """Replace a checkpoint's .metadata by a pickle that runs a command when loaded."""
    (path / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))


def resume_more_steps(run: Path) -> dict:
    result = train(compose_cfg([*SAVING, "train.steps=5"]), run_dir=run)
    assert result.status == "completed", result.error
    return result.summary["applied"]["checkpoint"]


# --------------------------------------------------------------------- S1: no code runs at load
def test_a_crafted_metadata_runs_nothing_and_the_resume_falls_back(finished, tmp_path):
    run, marker = copy_of(finished, tmp_path), tmp_path / "ran"
    plant(step(run, 4), marker)
    ckpt = resume_more_steps(run)
    assert not marker.exists()
    assert ckpt["resumed_step"] == 2
    assert ckpt["skipped"] == [f"step-00000004: .metadata is unreadable (UnsafeCheckpoint: {step(run, 4)}/.metadata "
                               "names posix.system, which is not part of a checkpoint: it could run code, so it is "
                               "not loaded)"]


def test_a_crafted_base_checkpoint_runs_nothing(finished, tmp_path):
    run, marker = copy_of(finished, tmp_path), tmp_path / "ran"
    plant(step(run, 4), marker)
    with pytest.raises(ConfigError, match=r"cannot be loaded: \.metadata is unreadable \(UnsafeCheckpoint: .* names "
                                          r"posix.system"):
        base.resolve_base_checkpoint(step(run, 4))
    assert base.resolve_base_checkpoint(run / "checkpoints") == step(run, 2)  # the newest that is whole
    assert not marker.exists()


def _tiny_objects():
    from optbench.optim.optimizers import build_optimizer, build_scheduler
    from optbench.tasks import build_task
    from optbench.training.build import build_model, materialize

    cfg = to_config(compose_cfg(FAST))
    model = build_model(cfg, build_task(cfg))
    materialize(model, device=torch.device("cpu"), seed=0)
    optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=cfg.train.lr)
    return dict(model=model, optimizer=optimizer, scheduler=build_scheduler(optimizer, cfg=cfg.train), scaler=None)


class _Holds:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_a_checkpoint_pickled_by_python_3_11_2_resumes_exactly(tmp_path, monkeypatch):
    """Early Python 3.11 releases (Debian 12's python3.11 is 3.11.2) pickle an enum member as
    ``getattr(its class, its name)``, so DCP's .metadata names builtins.getattr; 3.11.7 as
    ``its class(its value)``. Found when the suite ran on Debian's interpreter and no checkpoint
    could be resumed. Written either way, whatever Python runs this, a checkpoint resumes to the
    same losses."""
    import enum

    forms = {"by_name": lambda self, proto: (getattr, (type(self), self._name_)),
             "by_value": lambda self, proto: (type(self), (self._value_,))}
    for form, reduce in forms.items():
        monkeypatch.setattr(enum.Enum, "__reduce_ex__", reduce)
        assert train(compose_cfg(SAVING), run_dir=tmp_path / form).status == "completed"
        monkeypatch.undo()
    assert b"getattr" in (step(tmp_path / "by_name", 4) / ".metadata").read_bytes()
    assert b"getattr" not in (step(tmp_path / "by_value", 4) / ".metadata").read_bytes()
    runs = [tmp_path / form for form in forms]
    assert [resume_more_steps(run)["resumed_step"] for run in runs] == [4, 4]
    by_name, by_value = ([r["loss"] for r in read_metrics(run) if r["kind"] == "train"] for run in runs)
    assert len(by_name) == 5 and by_name == by_value


@pytest.mark.parametrize(("target", "args", "names"), [
    (PosixPath, ("home",), "the attribute 'home' of PosixPath"),  # a classmethod getattr would hand over
    (torch.Size, ("__class__",), "the attribute '__class__' of Size"),
    (_MEM_FORMAT_ENCODING, ("TORCH_CHANNELS_LAST", None), "the attribute 'TORCH_CHANNELS_LAST' of _MEM_FORMAT"),
])
def test_getattr_in_metadata_gives_an_enum_member_by_name_and_nothing_else(tmp_path, target, args, names):
    class Reaches:
        def __reduce__(self):
            return getattr, (target, *args)

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Reaches()))
    with pytest.raises(safe.UnsafeCheckpoint, match=f"asks for {names}.*it could run code, so it is not loaded"):
        safe.read_metadata(tmp_path)


def test_a_non_tensor_item_that_would_run_code_is_refused(tmp_path):
    """DCP stores non-tensor items with torch.save; optbench reads them with weights_only=True."""
    marker = tmp_path / "ran"
    objects = _tiny_objects()
    evil = dict(objects, scheduler=_Holds({"last_epoch": RunsACommand(marker)}))
    path = checkpoint.save(tmp_path / "ckpt", **evil, progress=checkpoint.Progress(step=1), meta={"model": {}},
                           keep_last=0)
    assert checkpoint.damage(path) is None
    with pytest.raises(checkpoint.checkpoint_exception()) as failure:
        checkpoint.load(path, **dict(objects, scheduler=_Holds({"last_epoch": 0})))
    assert "posix.system" in checkpoint.first_line(failure.value) and not marker.exists()


def test_rng_states_are_stored_as_tensors_and_restored(tmp_path):
    objects = _tiny_objects()
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.standard_normal()  # numpy's cached Gaussian is part of its state
    path = checkpoint.save(tmp_path / "ckpt", **objects, progress=checkpoint.Progress(step=1), meta={"model": {}},
                           keep_last=0)
    expected = (random.random(), np.random.standard_normal(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    checkpoint.load(path, **objects)
    assert (random.random(), np.random.standard_normal(), torch.rand(1).item()) == expected
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    kinds = {k: type(v).__name__ for k, v in safe.read_metadata(path).state_dict_metadata.items() if "rng" in k}
    assert kinds["rng_rank0.numpy_keys"] == kinds["rng_rank0.python_words"] == "TensorStorageMetadata"
    assert BytesStorageMetadata.__name__ not in (kinds["rng_rank0.torch"],)


def test_a_legacy_pickled_rng_state_is_read_without_running_code(tmp_path):
    random.seed(7)
    state = {"torch": torch.get_rng_state(), "numpy": pickle.dumps(np.random.get_state()),
             "python": pickle.dumps(random.getstate())}
    expected = random.random()
    random.seed(0)
    safe.set_rng_state(state)
    assert random.random() == expected
    state["python"] = pickle.dumps(RunsACommand(tmp_path / "ran"))
    with pytest.raises(safe.UnsafeCheckpoint, match="the python RNG state names posix.system"):
        safe.set_rng_state(state)
    assert not (tmp_path / "ran").exists()


# --------------------------------------------------------------------- 12. content hashes
def test_bytes_overwritten_in_place_are_found_and_the_older_checkpoint_loaded(finished, tmp_path):
    """64 KiB overwritten in the middle of the newest .distcp, its size unchanged: the hash recorded
    at save differs, so the resume falls back to step 2 instead of training on garbage."""
    run = copy_of(finished, tmp_path)
    data = step(run, 4) / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(os.urandom(64 * 1024))
    assert data.stat().st_size == size and checkpoint.damage(step(run, 4)) is None  # looks whole
    ckpt = resume_more_steps(run)
    assert ckpt["resumed_step"] == 2
    assert ckpt["skipped"] == ["step-00000004: DamagedCheckpoint: __0_0.distcp does not match the SHA-256 "
                               "recorded at save (its bytes were changed)"]
    meta = checkpoint.read_meta(step(run, 2))
    assert set(meta["files"]) == {".metadata", "__0_0.distcp"} and meta["format"] == 2


def test_digests_are_verified_and_say_what_differs(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100)
    files = {"a": digests.file_digest(tmp_path / "a")}
    assert files["a"]["bytes"] == 100 and digests.verify(tmp_path, files) is None
    assert digests.verify(tmp_path, None) is None  # saved before hashes were recorded
    (tmp_path / "a").write_bytes(b"x" * 99 + b"y")
    assert "does not match the SHA-256" in digests.verify(tmp_path, files)
    (tmp_path / "a").write_bytes(b"x")
    assert digests.verify(tmp_path, files) == "a holds 1 bytes, not the 100 recorded at save"
    (tmp_path / "a").unlink()
    assert digests.verify(tmp_path, files) == "a is missing"


# --------------------------------------------------------------------- 5. badly typed metadata
@pytest.mark.parametrize(("field", "value", "why"), [
    ("step", "4", 'has step="4", not a count'),
    ("model", "tiny", 'has model="tiny", not the model\'s fields'),
    ("world_size", None, "has world_size=null, not a count"),
    ("step", 6, "says step 6 but its directory is step 4"),
])
def test_badly_typed_metadata_is_damage_and_the_resume_falls_back(finished, tmp_path, field, value, why):
    run = copy_of(finished, tmp_path)
    meta_file = step(run, 4) / "optbench.json"
    meta = json.loads(meta_file.read_text())
    meta[field] = value
    meta_file.write_text(json.dumps(meta))
    assert checkpoint.damage(step(run, 4)) == f"optbench.json {why} (overwritten?)"
    assert resume_more_steps(run)["resumed_step"] == 2


def test_a_base_checkpoint_whose_model_is_a_list_is_one_line(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    meta_file = step(run, 4) / "optbench.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "model": [1, 2]}))
    model = to_config(compose_cfg(FAST)).model
    with pytest.raises(ConfigError, match=r"base_checkpoint=.*step-00000004 cannot be loaded: optbench.json has "
                                          r"model=\[1, 2\], not the model's fields"):
        base.check_base_checkpoint(step(run, 4), model=model)


# --------------------------------------------------------------------- 6. a damaged base checkpoint
def test_a_truncated_base_checkpoint_is_one_line_before_anything_is_built(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    os.truncate(step(run, 4) / "__0_0.distcp", 1000)
    shutil.rmtree(step(run, 2))
    model = to_config(compose_cfg(FAST)).model
    with pytest.raises(ConfigError, match=r"no checkpoint there can be loaded \(step-00000004: __0_0.distcp is truncated \(1,000 of"):
        base.check_base_checkpoint(run / "checkpoints", model=model)


def test_a_base_checkpoint_overwritten_in_place_is_one_line(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    data = step(run, 4) / "__0_0.distcp"
    with open(data, "r+b") as handle:
        handle.seek(4096)
        handle.write(b"\0" * 4096)
    objects = _tiny_objects()
    with pytest.raises(ConfigError, match="__0_0.distcp does not match the SHA-256 recorded at save"):
        base.load_base(objects["model"], step(run, 4))


def test_hashing_costs_one_read(tmp_path):
    """Not a timing assertion: the seconds per GB this machine hashes at, printed for the docs."""
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(32 * 2**20))
    started = time.perf_counter()
    digests.file_digest(blob)
    print(f"sha256: {(time.perf_counter() - started) / (32 / 1024):.2f} s/GiB (page cache hot)")



def test_a_model_read_from_a_checkpoint_checks_its_hashes_then_reads_its_metadata_as_data(finished, tmp_path):
    """How fusion.base_checkpoint, fusion.encoder_checkpoint and optbench generate read model
    tensors (checkpoint.base.verified_metadata): a planted .metadata differs from what was saved;
    in a checkpoint saved before hashes were recorded it is refused by the restricted unpickler."""
    run, marker = copy_of(finished, tmp_path), tmp_path / "ran"
    plant(step(run, 4), marker)
    with pytest.raises(ConfigError, match=r"^encoder cannot be loaded: \.metadata holds \d+ bytes, not the"):
        base.verified_metadata(step(run, 4), what="encoder")
    meta_file = step(run, 4) / "optbench.json"
    meta = json.loads(meta_file.read_text())
    meta.pop("files")
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(safe.UnsafeCheckpoint, match="names posix.system"):
        base.verified_metadata(step(run, 4), what="encoder")
    assert not marker.exists()
