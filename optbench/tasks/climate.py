"""Task ``climate``: forecast the next step of a climate datacube (``data=netcdf``).

A sample is ``frames`` ``(history + 1, C, lat, lon)``, normalized per channel, NaN where the file
has no value: ``history`` input steps and the target. The (variable x level) channels of the input
steps are cut into ``patch_size`` x ``patch_size`` lat/lon patches (the grid is padded up to a
multiple of the patch with masked points); each patch is one token (a linear patch embedding plus
a learned position embedding), the shared trunk attends bidirectionally, and a linear head maps
each token back to its patch: the change from the last input step (the forecast is last input +
change) and a reconstruction of the last input step (the inverse / decoder-query output).

Losses, all over valid points only (NaN / _FillValue / padding never enter them):
- main: MSE of the normalized forecast;
- on ``loss_freq`` steps (``with_aux``), weighted by ``task.*_weight``: ``inverse``, the MSE of
  the reconstruction at ``loss_freq.num_queries`` grid points sampled per sample, and the physics
  constraints of ``PhysicsConstraints`` (humidity bounds, global-mean mass and energy conservation
  between the last input step and the forecast).
Eval: per variable, NRMSE = sqrt(sum of squared errors / sum of squared deviations from each
channel's eval mean) in physical units — 0 is perfect, 1 is no better than the eval mean — next to
the NRMSE of persistence (the last input step as forecast) and the RMSE in the variable's units.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from optbench.config import ClimateTaskConfig, NetCDFDataConfig
from optbench.errors import ConfigError
from optbench.tasks.base import Batch, Losses, Task

log = logging.getLogger(__name__)

SPECIFIC_HEAT = 1004.0  # J kg-1 K-1, dry air at constant pressure


class PositionEmbedding(nn.Module):
    """A learned vector per token position (a leaf module, so ``init_weights`` resets it)."""

    def __init__(self, num_tokens: int, dim: int, *, std: float) -> None:
        super().__init__()
        self.std = std
        self.weight = nn.Parameter(torch.empty(num_tokens, dim))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight


def _pad_amounts(size: int, patch: int) -> int:
    return -size % patch


class PatchEmbed(nn.Module):
    """``(B, history, C, H, W)`` -> ``(B, tokens, dim)``: patches of all history x channel values
    through one linear layer, plus the position embedding."""

    def __init__(self, *, channels: int, patch: int, grid: tuple[int, int], dim: int, init_std: float) -> None:
        super().__init__()
        self.patch = patch
        self.pad_h, self.pad_w = _pad_amounts(grid[0], patch), _pad_amounts(grid[1], patch)
        rows, cols = (grid[0] + self.pad_h) // patch, (grid[1] + self.pad_w) // patch
        self.proj = nn.Linear(channels * patch * patch, dim)
        self.pos = PositionEmbedding(rows * cols, dim, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1, 2)  # (B, history * C, H, W)
        if self.pad_h or self.pad_w:
            x = F.pad(x, (0, self.pad_w, 0, self.pad_h))
        b, c, h, w = x.shape
        p = self.patch
        patches = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        return self.pos(self.proj(patches))


class PatchHead(nn.Module):
    """``(B, tokens, dim)`` -> ``(B, 2, C, H, W)``: per patch, the forecast change and the
    reconstruction of the last input step, cropped back to the grid."""

    def __init__(self, *, channels: int, patch: int, grid: tuple[int, int], dim: int) -> None:
        super().__init__()
        self.channels, self.patch, self.grid = channels, patch, grid
        self.rows = (grid[0] + _pad_amounts(grid[0], patch)) // patch
        self.cols = (grid[1] + _pad_amounts(grid[1], patch)) // patch
        self.proj = nn.Linear(dim, 2 * channels * patch * patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, p, c = x.shape[0], self.patch, self.channels
        out = self.proj(x).reshape(b, self.rows, self.cols, 2, c, p, p)
        out = out.permute(0, 3, 4, 1, 5, 2, 6).reshape(b, 2, c, self.rows * p, self.cols * p)
        return out[..., : self.grid[0], : self.grid[1]]


class PhysicsConstraints:
    """The one physics-constraint loss, vectorized over batch, channels and grid in a single pass.

    - humidity: mean squared violation of the physical bounds by the forecast (in channel stds);
    - mass: squared change of the area-weighted global mean of each pressure channel between the
      last input step and the forecast (in channel stds);
    - energy: squared change of the global mean of cp*T (mean over temperature channels) plus the
      kinetic energy 0.5*(u^2+v^2) (mean over wind levels), in units of cp times the mean
      temperature std.
    Global means are cos(latitude)-weighted over the points valid in the last input step. Terms
    whose role is absent from the data, or whose weight is 0, are not computed."""

    def __init__(self, *, roles: list[str], mean: np.ndarray, std: np.ndarray, lower: np.ndarray,
                 upper: np.ndarray, lat: np.ndarray, weights: dict[str, float]) -> None:
        def index(*wanted: str) -> torch.Tensor:
            return torch.tensor([i for i, r in enumerate(roles) if r in wanted], dtype=torch.long)

        self.humidity, self.pressure = index("humidity"), index("pressure")
        self.temperature, self.wind = index("temperature"), index("u_wind", "v_wind")
        self.num_wind_levels = max(1, min(len(index("u_wind")), len(index("v_wind"))))
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)
        self.lower, self.upper = torch.tensor(lower, dtype=torch.float32), torch.tensor(upper, dtype=torch.float32)
        self.area = torch.tensor(np.clip(np.cos(np.deg2rad(lat)), 0.0, None), dtype=torch.float32)
        self.weights = {
            "humidity": weights["humidity"] if len(self.humidity) else 0.0,
            "mass": weights["mass"] if len(self.pressure) else 0.0,
            "energy": weights["energy"] if len(self.temperature) else 0.0,
        }
        self._device: torch.device | None = None

    def active(self) -> bool:
        return any(w > 0 for w in self.weights.values())

    def _to(self, device: torch.device) -> None:
        if self._device != device:
            for name in ("humidity", "pressure", "temperature", "wind", "mean", "std", "lower", "upper", "area"):
                setattr(self, name, getattr(self, name).to(device))
            self._device = device

    def __call__(self, forecast: torch.Tensor, last: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """``forecast`` and ``last`` normalized ``(B, C, H, W)`` (last NaN-free), ``valid`` the
        mask of the last input step; returns the weighted terms."""
        self._to(forecast.device)
        c = forecast.shape[1]
        mean, std = self.mean.view(1, c, 1, 1), self.std.view(1, c, 1, 1)
        terms: dict[str, torch.Tensor] = {}
        if self.weights["humidity"] > 0:
            idx = self.humidity
            q = forecast[:, idx] * std[:, idx] + mean[:, idx]
            below = F.relu(self.lower[idx].view(1, -1, 1, 1) - q)
            above = F.relu(q - self.upper[idx].view(1, -1, 1, 1))
            terms["physics_humidity"] = self.weights["humidity"] * ((below + above) / std[:, idx]).square().mean()
        if self.weights["mass"] > 0 or self.weights["energy"] > 0:
            batch = forecast.shape[0]
            both = torch.cat([forecast, last])  # one pass for the forecast and the input
            weight = torch.cat([valid, valid]).float() * self.area.view(1, 1, -1, 1)

            def global_mean(idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:  # -> (2B, len(idx))
                w = weight[:, idx]
                return (values * w).sum(dim=(-2, -1)) / w.sum(dim=(-2, -1)).clamp_min(1e-12)

            if self.weights["mass"] > 0:
                gm = global_mean(self.pressure, both[:, self.pressure])
                terms["physics_mass"] = self.weights["mass"] * (gm[:batch] - gm[batch:]).square().mean()
            if self.weights["energy"] > 0:
                t_idx = self.temperature
                temp = both[:, t_idx] * std[:, t_idx] + mean[:, t_idx]
                energy = SPECIFIC_HEAT * global_mean(t_idx, temp).mean(dim=1)
                if len(self.wind):
                    w_idx = self.wind
                    wind = both[:, w_idx] * std[:, w_idx] + mean[:, w_idx]
                    energy = energy + global_mean(w_idx, 0.5 * wind.square()).sum(dim=1) / self.num_wind_levels
                scale = SPECIFIC_HEAT * std[0, t_idx, 0, 0].mean()
                change = (energy[:batch] - energy[batch:]) / scale
                terms["physics_energy"] = self.weights["energy"] * change.square().mean()
        return terms


class ClimateTask(Task):
    name = "climate"
    causal = False

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        if not isinstance(cfg.data, NetCDFDataConfig):
            raise ConfigError(
                f"task=climate reads NetCDF climate data, not data={cfg.data.name}; use data=netcdf "
                "data.paths=[FILE.nc] (`optbench data synth data.nc` writes one)"
            )
        task_cfg = cfg.task
        assert isinstance(task_cfg, ClimateTaskConfig)
        self.task_cfg = task_cfg
        self.history = cfg.data.history
        from optbench.data.netcdf import build_climate_data

        self.data = build_climate_data(cfg.data)
        layout = self.data.layout
        self.grid = layout.grid
        self.channels = layout.channels
        self.roles = [ch.role for ch in self.channels]
        stats = self.data.stats
        lower = np.full(len(self.channels), -np.inf)
        upper = np.full(len(self.channels), np.inf)
        for i, ch in enumerate(self.channels):
            if ch.variable in layout.humidity_bounds:
                lower[i], upper[i] = layout.humidity_bounds[ch.variable]
        self.physics = PhysicsConstraints(
            roles=self.roles, mean=stats.mean, std=stats.std, lower=lower, upper=upper, lat=layout.out_lat,
            weights={"humidity": task_cfg.humidity_weight, "mass": task_cfg.mass_weight,
                     "energy": task_cfg.energy_weight},
        )
        self.augmenter = None
        if cfg.data.augment.enabled:
            from optbench.data.augment import PhysicsAugment

            self.augmenter = PhysicsAugment(
                cfg.data.augment, roles=self.roles, mean=stats.mean, std=stats.std, lower=lower, upper=upper,
                history=self.history, global_lon=layout.global_lon, seed=cfg.train.seed,
            )
        self._mean = torch.tensor(stats.mean, dtype=torch.float64)
        self._std = torch.tensor(stats.std, dtype=torch.float64)
        # the stream's per-worker share, checked here so that it fails before any worker starts
        self.data.train.per_worker(max(1, cfg.dataloader.num_workers), world_size=cfg.parallel.nproc_per_node)
        p = task_cfg.patch_size
        if p > min(self.grid):
            raise ConfigError(f"task.patch_size={p} is larger than the {self.grid[0]}x{self.grid[1]} grid; lower it")

    # --- model pieces ----------------------------------------------------------------------------
    def tokens_per_sample(self) -> int:
        p = self.task_cfg.patch_size
        rows = (self.grid[0] + _pad_amounts(self.grid[0], p)) // p
        cols = (self.grid[1] + _pad_amounts(self.grid[1], p)) // p
        return rows * cols

    def build_embed(self) -> nn.Module:
        return PatchEmbed(channels=self.history * len(self.channels), patch=self.task_cfg.patch_size,
                          grid=self.grid, dim=self.cfg.model.dim, init_std=self.cfg.model.init_std)

    def build_head(self) -> nn.Module:
        return PatchHead(channels=len(self.channels), patch=self.task_cfg.patch_size, grid=self.grid,
                         dim=self.cfg.model.dim)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        return self.data.train, self.data.eval

    # --- batches -----------------------------------------------------------------------------------
    def augment(self, batch: Batch, *, step: int, micro: int) -> Batch:
        if self.augmenter is None:
            return batch
        return {**batch, "frames": self.augmenter(batch["frames"], step=step, micro=micro)}

    def inputs(self, batch: Batch) -> torch.Tensor:
        return batch["frames"][:, : self.history].nan_to_num(0.0)

    def _split(self, outputs: torch.Tensor, batch: Batch):
        frames = batch["frames"]
        last_raw, target_raw = frames[:, self.history - 1], frames[:, self.history]
        last = last_raw.nan_to_num(0.0)
        forecast = last + outputs[:, 0].float()
        return forecast, last, last_raw.isfinite(), target_raw.nan_to_num(0.0), target_raw.isfinite()

    def losses(self, outputs: torch.Tensor, batch: Batch, *, with_aux: bool) -> Losses:
        forecast, last, last_valid, target, valid = self._split(outputs, batch)
        mask = valid.float()
        main = ((forecast - target).square() * mask).sum() / mask.sum().clamp_min(1.0)
        aux: dict[str, torch.Tensor] = {}
        if with_aux:
            if self.task_cfg.inverse_weight > 0:
                aux["inverse"] = self.task_cfg.inverse_weight * self._inverse_loss(outputs[:, 1].float(), last, last_valid)
            if self.physics.active():
                aux.update(self.physics(forecast, last, last_valid))
        total = main + sum(aux.values()) if aux else main
        return Losses(total=total, main=main, aux=aux)

    def _inverse_loss(self, reconstruction: torch.Tensor, last: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """MSE of the reconstructed last input step at ``loss_freq.num_queries`` points per sample
        (all points when the grid has no more)."""
        b, c, h, w = last.shape
        queries = self.cfg.loss_freq.num_queries
        flat = (reconstruction.reshape(b, c, h * w), last.reshape(b, c, h * w), valid.reshape(b, c, h * w))
        if queries < h * w:
            idx = torch.randint(h * w, (b, 1, queries), device=last.device).expand(b, c, queries)
            flat = tuple(torch.gather(x, -1, idx) for x in flat)
        rec, ref, ok = flat
        mask = ok.float()
        return ((rec - ref).square() * mask).sum() / mask.sum().clamp_min(1.0)

    # --- evaluation --------------------------------------------------------------------------------
    def eval_metrics(self, outputs: torch.Tensor, batch: Batch, *, model: nn.Module) -> dict[str, torch.Tensor]:
        """Per-channel sums over the batch (float64): squared errors of the forecast and of
        persistence, target sum and sum of squares, valid count."""
        forecast, last, _, target, valid = self._split(outputs, batch)
        mean = self._mean.to(forecast.device).view(1, -1, 1, 1)
        std = self._std.to(forecast.device).view(1, -1, 1, 1)
        mask = valid.double()

        def physical(x: torch.Tensor) -> torch.Tensor:
            return x.double() * std + mean

        y = physical(target) * mask
        dims = (0, 2, 3)
        return {
            "sse": ((physical(forecast) * mask - y).square()).sum(dims),
            "sse_persistence": ((physical(last) * mask - y).square()).sum(dims),
            "sum": y.sum(dims),
            "sum_sq": y.square().sum(dims),
            "count": mask.sum(dims),
        }

    def finalize_eval_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """NRMSE and RMSE per variable (channels of a variable pooled), and their mean over variables."""
        if not sums:
            return {}
        s = {k: v.detach().cpu().double() for k, v in sums.items()}
        count = s["count"].clamp_min(1.0)
        deviation = s["sum_sq"] - s["sum"].square() / count  # per channel, about the channel's eval mean
        metrics: dict[str, float] = {}
        nrmses = []
        for variable in dict.fromkeys(ch.variable for ch in self.channels):
            idx = [i for i, ch in enumerate(self.channels) if ch.variable == variable]
            sse, sst = float(s["sse"][idx].sum()), float(deviation[idx].sum())
            n = float(s["count"][idx].sum())
            nrmse = math.sqrt(sse / sst) if sst > 0 else float("nan")
            metrics[f"nrmse/{variable}"] = nrmse
            metrics[f"nrmse_persistence/{variable}"] = (
                math.sqrt(float(s["sse_persistence"][idx].sum()) / sst) if sst > 0 else float("nan"))
            metrics[f"rmse/{variable}"] = math.sqrt(sse / n) if n > 0 else float("nan")
            nrmses.append(nrmse)
        metrics["nrmse/mean"] = float(np.mean(nrmses))
        return metrics
