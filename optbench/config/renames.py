"""Config names that changed, and how an old one is read: every old command-line override still runs,
with one line saying the new name (``checkpointing=full`` -> "checkpointing= is now ac=; ran with
ac=full"), sweeps included (``-m checkpointing=none,full``); the resolved config that old summaries
and checkpoints recorded is read under the new names (``upgrade_config``). docs/renames.md lists them all.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from optbench.errors import ConfigError

GROUPS = {"checkpointing": "ac"}  # old group -> new group
OPTIONS = {  # (group, old option) -> new option (a preset renamed inside its group)
    ("model", "base"): "134m",
    ("compile", "off"): "none",
    ("profile", "off"): "none",
    ("phase", "2_checkpointing"): "2_ac",
    ("ablation", "2_checkpointing"): "2_ac",
}
KEYS = {  # old key -> new key
    "checkpointing.mode": "ac.name",
    "compile.mode": "compile.name",
    "attention.kernel": "attention.name",
    "parallel.mode": "parallel.name",
    "fusion.kind": "fusion.name",
    "profile.enabled": "profile.name",
    "train.save_every": "checkpoint.every",
    "train.keep_last": "checkpoint.keep_last",
    "train.resume": "checkpoint.resume",
    "train.checkpoint_dir": "checkpoint.dir",
    "train.log_every": "log.every",
    "train.log_level": "log.level",
    "train.progress": "log.progress",
    "train.timing_warmup": "measure.warmup_steps",
    "train.track_memory": "measure.track_memory",
    "train.max_minutes": "run.time_limit_s",
    "train.stop_timeout_s": "run.stop_timeout_s",
    "train.check_memory": "run.check_memory",
}
VALUES = {"profile.enabled": {"true": "trace", "false": "none"}}  # old key -> {old value: new value}
# keys added since the renames -> the value that reproduces what runs without the key did; a recorded
# config lacking one reads as having it, so today's runs of that config pool with the old ones
ADDED = {"estimate.fits_on": None, "run.overwrite": False, "fusion.encoder_checkpoint": None,
         "fusion.freeze_encoder": False,
         # the frozen base's stored dtype: runs recorded before it stored the base in fp32
         "fusion.base_dtype": "fp32",
         # the prediction made before a run's loop changes nothing it trains or measures (tested): a
         # run recorded before it pools with today's runs of the same config, which predict
         "estimate.predict": True, "estimate.link_gbps": None, "estimate.global_batch": None, "estimate.top": 5,
         # as the prediction: the run's own trace before its loop changes nothing it trains or measures
         "estimate.in_run": True,
         # where a run is tracked and the peak given by hand: runs recorded before them had TensorBoard and
         # the datasheet's or measured peak
         "log.trackers": ["tensorboard"], "log.mlflow.tracking_uri": None, "log.mlflow.experiment": "optbench",
         "log.wandb.project": "optbench", "log.wandb.entity": None, "log.wandb.mode": "auto", "log.wandb.dir": None,
         "measure.peak_tflops": None,
         # how local workers start changes nothing they train (tested: losses bit-identical): runs
         # recorded before it (spawned) pool with today's runs of the same config, which fork
         "parallel.start_method": "forkserver"}
MINUTES = {"train.max_minutes"}  # old keys in minutes whose new key is in seconds

# an override: an optional prefix (+, ++, ~), a key or group, an optional @package, then =value
_OVERRIDE = re.compile(r"^(?P<prefix>~|\+\+|\+)?(?P<key>[A-Za-z_][\w.\-/]*)(?P<package>@[\w.\-:]*)?(?P<rest>=.*)?$",
                       re.DOTALL)
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?(?![\w.])")


def new_option(group: str, option: Any) -> Any:
    """The current name of ``group``'s preset ``option`` (unchanged when it was not renamed)."""
    return OPTIONS.get((GROUPS.get(group, group), option), option) if isinstance(option, str) else option


def new_key(key: str) -> str:
    """The current name of a group or a dotted key (unchanged when it was not renamed)."""
    if key in KEYS:
        return KEYS[key]
    group, dot, rest = key.partition(".")
    return GROUPS.get(group, group) + dot + rest


def _group_of(key: str) -> str | None:
    """The group whose option a value names: ``model`` for ``model=...`` and ``model.name=...``."""
    group, _, rest = key.partition(".")
    return group if rest in ("", "name") else None


def _new_value(old_key: str, key: str, value: str) -> tuple[str, list[tuple[str, str]]]:
    """(the value under the new names, the (old, new) values renamed in it)."""
    if old_key in MINUTES:
        if re.search(r"\b(range|interval)\(", value):
            raise ConfigError(f"{old_key}= (minutes) is now {key}= (seconds); write the sweep in seconds, "
                              f"e.g. {key}=600,1200")
        return _NUMBER.sub(lambda m: _seconds(m.group()), value), []
    table = {old: new for (group, old), new in OPTIONS.items() if group == _group_of(key)}
    table.update(VALUES.get(old_key, {}))
    flags = re.IGNORECASE if old_key in VALUES else 0
    renamed = []
    for old, new in table.items():
        pattern = rf"(?<![\w.\-]){re.escape(old)}(?![\w.\-])"
        if re.search(pattern, value, flags=flags):
            value = re.sub(pattern, new, value, flags=flags)
            renamed.append((old, new))
    return value, renamed


def _seconds(minutes: str) -> str:
    seconds = float(minutes) * 60
    return str(int(seconds)) if math.isfinite(seconds) and seconds == int(seconds) else repr(seconds)


def upgrade_override(override: str) -> tuple[str, str | None]:
    """(the override under the new names, the one line that says what changed, or None)."""
    match = _OVERRIDE.match(override)
    if match is None:
        return override, None
    prefix, key, package, rest = (match.group(g) or "" for g in ("prefix", "key", "package", "rest"))
    renamed = new_key(key)
    value, values = _new_value(key, renamed, rest[1:]) if rest else ("", [])
    if renamed == key and not values:
        return override, None
    upgraded = f"{prefix}{renamed}{package}" + (f"={value}" if rest else "")
    if key in MINUTES:
        said = [f"{key}= (minutes) is now {renamed}= (seconds)"]
    elif renamed != key:  # "checkpointing= is now ac=", "compile.mode= is now compile.name=; off is now none"
        said = [f"{key}= is now {renamed}=", *(f"{old} is now {new}" for old, new in values)]
    else:  # an option renamed: "model=base is now model=134m"
        said = [f"{key}={old} is now {key}={new}" for old, new in values]
    return upgraded, f"{'; '.join(said)}; ran with {upgraded}"


def upgrade_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the overrides under the new names, one line per override that was renamed)."""
    pairs = [upgrade_override(str(o)) for o in overrides]
    return [new for new, _ in pairs], [said for _, said in pairs if said]


def upgrade_and_warn(overrides: Sequence[str]) -> list[str]:
    """``upgrade_overrides``, printing its lines on stderr (``optbench: warning: ...``)."""
    upgraded, said = upgrade_overrides(overrides)
    for line in said:
        print(f"optbench: warning: {line}", file=sys.stderr, flush=True)
    return upgraded


# ---------------------------------------------------------------------------- recorded configs
KeyPath = tuple[str, ...]  # a key's path in a nested config (keys may hold dots: data.roles' variables)


def _flat(tree: dict[str, Any], prefix: KeyPath = ()) -> dict[KeyPath, Any]:
    out: dict[KeyPath, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, (*prefix, str(key))))
        else:
            out[(*prefix, str(key))] = value
    return out


def _nested(flat: dict[KeyPath, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for (*parents, leaf), value in flat.items():
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return out


def _new_path(path: KeyPath) -> KeyPath:
    renamed = new_key(".".join(path[:2]))  # every renamed key is a group or group.key
    return (*renamed.split("."), *path[2:]) if len(path) >= 2 else path


def _recorded_value(old: KeyPath, new: KeyPath, value: Any) -> Any:
    old_key, key = ".".join(old), ".".join(new)
    if old_key in MINUTES:
        return value * 60 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if old_key in VALUES and isinstance(value, bool):
        return VALUES[old_key][str(value).lower()]
    group = _group_of(key)
    return new_option(group, value) if group else value


_KEYS_OF: dict[str, set[str]] = {}  # group -> its keys that were renamed (train: save_every, ...)
for _dotted in KEYS:
    _KEYS_OF.setdefault(_dotted.partition(".")[0], set()).add(_dotted.partition(".")[2])
_ADDED_PATHS = [tuple(key.split(".")) for key in ADDED]


def _string_keys(tree: dict[Any, Any]) -> bool:
    stack = [tree]
    while stack:
        for key, value in stack.pop().items():
            if not isinstance(key, str):
                return False
            if isinstance(value, dict):
                stack.append(value)
    return True


def _leaf_recorded(tree: dict[str, Any], path: KeyPath) -> bool:
    """Whether ``path`` is one of ``tree``'s leaves (a value that is not a non-empty mapping)."""
    node: Any = tree
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return not (isinstance(node, dict) and node)


def _section_is_current(group: str, section: Any) -> bool:
    if not isinstance(section, dict) or not section:  # a leaf: a group's option (model: tiny)
        return _recorded_value((group,), (group,), section) == section
    if group.partition(".")[0] in GROUPS or not _KEYS_OF.get(group, set()).isdisjoint(section):
        return False
    return all(new_option(group, section[key]) == section[key] for key in ("", "name") if key in section)


def config_is_current(config: Any) -> bool:
    """True when ``upgrade_config(config)`` would give back ``config`` unchanged (equal), told without
    rebuilding it: every key a string, no renamed group, key or option, every added key recorded.
    A report reads thousands of configs written under today's names; this is its quick look, and
    False only means "upgrade it"."""
    if not isinstance(config, dict):
        return True
    return (_string_keys(config) and all(_section_is_current(group, section) for group, section in config.items())
            and all(_leaf_recorded(config, path) for path in _ADDED_PATHS if path[0] in config))


def upgrade_config(config: Any) -> Any:
    """A resolved config as a summary or checkpoint recorded it (a nested dict), under the new
    names: a config written under the new names comes back equal; anything else is returned as is.
    Where an old key's new name is also present (``fusion.kind`` beside ``fusion.name``), the new
    one is kept. A key added since (``ADDED``) that the record lacks reads as its old behaviour."""
    if not isinstance(config, dict):
        return config
    flat = _flat(config)
    out = {path: _recorded_value(path, path, v) for path, v in flat.items() if _new_path(path) == path}
    for path, value in flat.items():
        renamed = _new_path(path)
        if renamed != path and renamed not in out:
            out[renamed] = _recorded_value(path, renamed, value)
    for key, value in ADDED.items():
        path = tuple(key.split("."))
        if path not in out and any(p[0] == path[0] for p in out):  # its node recorded (perhaps renamed into)
            out[path] = value
    return _nested(out)
