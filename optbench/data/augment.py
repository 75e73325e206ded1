"""Physics-informed augmentation of climate batches (the plan's list, 000), vectorized over the batch.

It works on the normalized ``frames`` of a batch, ``(B, history + 1, C, lat, lon)`` — the inputs
and the target — on whatever device they live, and draws every random number from one generator on
that device seeded by ``(seed, step, micro-batch)``: the same step always gets the same
augmentation, whatever ran before (so a resumed run repeats it exactly). With probability ``prob``
a sample is augmented:

- Gaussian noise on its input steps (never the target), per role: temperature / pressure /
  humidity std in units of each channel's std (winds and other roles get none);
- its anomalies (the normalized values) scaled by one factor from ``scale_factor_range``, inputs
  and target alike;
- with probability ``temporal_shift_prob``, its input history lagged by one step (the latest
  input replaced by the one before, the oldest kept): a late observation; needs history >= 2;
- with probability ``roll_prob``, all its steps rolled by a random number of grid columns in
  longitude (the globe is periodic): null means 0.3 on a global grid and none on a regional one,
  where an explicit roll_prob > 0 is refused;
- humidity clamped to its physical bounds.

NaN (missing) points stay NaN. Samples that are not augmented are returned unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from optbench.config import AugmentConfig
from optbench.errors import ConfigError

DEFAULT_ROLL_PROB = 0.3  # data.augment.roll_prob=null on a global grid


class PhysicsAugment:
    def __init__(
        self,
        cfg: AugmentConfig,
        *,
        roles: list[str],
        mean: np.ndarray,
        std: np.ndarray,
        lower: np.ndarray,
        upper: np.ndarray,
        history: int,
        global_lon: bool,
        seed: int,
    ) -> None:
        """``roles``, ``mean``, ``std``, ``lower`` and ``upper`` are per channel; ``lower``/``upper``
        are physical bounds (-inf/inf where a channel has none)."""
        roll_prob = cfg.roll_prob if cfg.roll_prob is not None else (DEFAULT_ROLL_PROB if global_lon else 0.0)
        if roll_prob > 0 and not global_lon:
            raise ConfigError(
                f"data.augment.roll_prob={cfg.roll_prob} rolls samples in longitude, but the grid is not "
                "global (it does not cover 360 degrees); set data.augment.roll_prob=0 for a regional grid"
            )
        self.cfg = cfg
        self.roll_prob = roll_prob
        self.history = history
        self.seed = seed
        noise_std = {"temperature": cfg.temperature_noise_std, "pressure": cfg.pressure_noise_std,
                     "humidity": cfg.humidity_noise_std}
        self.noise_std = torch.tensor([noise_std.get(role, 0.0) for role in roles], dtype=torch.float32)
        with np.errstate(invalid="ignore"):
            self.lower = torch.tensor((lower - mean) / std, dtype=torch.float32)
            self.upper = torch.tensor((upper - mean) / std, dtype=torch.float32)
        self.bounded = torch.tensor(np.flatnonzero(np.isfinite(lower) | np.isfinite(upper)), dtype=torch.long)
        self._device: torch.device | None = None

    def _to(self, device: torch.device) -> None:
        if self._device != device:
            self.noise_std, self.lower, self.upper, self.bounded = (
                t.to(device) for t in (self.noise_std, self.lower, self.upper, self.bounded))
            self._device = device

    def generator(self, device: torch.device, *, step: int, micro: int) -> torch.Generator:
        state = np.random.SeedSequence([self.seed, step, micro, 0xA06]).generate_state(1, dtype=np.uint64)[0]
        return torch.Generator(device=device).manual_seed(int(state) & (2**63 - 1))

    @torch.no_grad()
    def __call__(self, frames: torch.Tensor, *, step: int, micro: int = 0) -> torch.Tensor:
        """The augmented frames (a new tensor); ``frames`` is left as it was."""
        device = frames.device
        self._to(device)
        cfg, h = self.cfg, self.history
        batch, _, channels, _, width = frames.shape
        g = self.generator(device, step=step, micro=micro)

        def uniform(*shape: int) -> torch.Tensor:
            return torch.rand(shape, generator=g, device=device)

        apply = uniform(batch) < cfg.prob
        noise = torch.randn((batch, h, channels, *frames.shape[-2:]), generator=g, device=device, dtype=frames.dtype)
        low, high = cfg.scale_factor_range
        scale = low + (high - low) * uniform(batch)
        lagged = (uniform(batch) < cfg.temporal_shift_prob) & apply
        rolled = (uniform(batch) < self.roll_prob) & apply
        shifts = torch.randint(width, (batch,), generator=g, device=device)

        view = (batch, 1, 1, 1, 1)
        noise = noise * (self.noise_std.view(1, 1, channels, 1, 1) * apply.view(view))
        out = torch.cat([frames[:, :h] + noise, frames[:, h:]], dim=1)
        out = out * torch.where(apply, scale, 1.0).to(out.dtype).view(view)
        if h >= 2:
            lag = torch.cat([out[:, :1], out[:, : h - 1], out[:, h:]], dim=1)
            out = torch.where(lagged.view(view), lag, out)
        shifts = torch.where(rolled, shifts, 0)
        columns = (torch.arange(width, device=device)[None, :] - shifts[:, None]) % width
        out = torch.gather(out, -1, columns.view(batch, 1, 1, 1, width).expand_as(out))
        if len(self.bounded):  # maximum/minimum keep NaN as NaN
            idx = self.bounded
            part = out[:, :, idx]
            clamped = torch.minimum(torch.maximum(part, self.lower[idx].view(1, 1, -1, 1, 1)),
                                    self.upper[idx].view(1, 1, -1, 1, 1))
            out[:, :, idx] = torch.where(apply.view(view), clamped, part)
        return out
