"""The parameterizations (one table, :data:`PARAMETERIZATION_TABLE`) and the conversion of each
to the model contract's EDM denoiser ``D(x; sigma)`` (the package docstring has the formulas)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from .errors import ExportError


class Parameterization(NamedTuple):
    """One row of :data:`PARAMETERIZATION_TABLE`: what the network computes and on which path.

    ``family`` is ``"edm"``, ``"vp"`` (DDPM-style, a VP noise schedule) or ``"flow"`` (flow
    matching); ``path`` names a flow path (``None`` otherwise); ``prediction`` is what the network
    returns; ``help`` is the one line ``diffmon-export --help`` prints."""
    name: str
    family: str
    path: Optional[str]
    prediction: str
    help: str


# The parameterizations, in one table: the converter, the note and --help all read it.
PARAMETERIZATION_TABLE = (
    Parameterization("edm", "edm", None, "denoiser",
                     "module(x, sigma) already returns the EDM denoiser D(x; sigma)"),
    Parameterization("edm_raw", "edm", None, "raw",
                     "module(c_in x, ln(sigma)/4) returns EDM's raw F: D = c_skip x + c_out F (--sigma-data)"),
    Parameterization("eps", "vp", None, "eps",
                     "DDPM-style: module(x_t, t) predicts the noise on a VP schedule (--schedule)"),
    Parameterization("v", "vp", None, "v",
                     "DDPM-style: module(x_t, t) predicts v = alpha n - s x0 on a VP schedule"),
    Parameterization("x0", "vp", None, "x0",
                     "DDPM-style: module(x_t, t) predicts the clean image x0 on a VP schedule"),
    Parameterization("rectified_flow", "flow", "rectified_flow", "velocity",
                     "flow matching, x_t = (1-t) x + t n (SD3, Flux, FlowMatch* schedulers); predicts n - x"),
    Parameterization("cosine_flow", "flow", "cosine", "velocity",
                     "flow matching, x_t = cos(pi t/2) x + sin(pi t/2) n (REPA's cosine path); predicts dx_t/dt"),
    Parameterization("sit_linear_velocity", "flow", "sit_linear", "velocity",
                     "SiT Linear, data at t = 1 (SiT's code): x_t = t x + (1-t) n; predicts x - n"),
    Parameterization("sit_linear_score", "flow", "sit_linear", "score",
                     "SiT Linear: predicts the score -n / (1-t)"),
    Parameterization("sit_linear_noise", "flow", "sit_linear", "noise",
                     "SiT Linear: predicts the noise n"),
    Parameterization("sit_gvp_velocity", "flow", "sit_gvp", "velocity",
                     "SiT GVP, data at t = 1: x_t = sin(pi t/2) x + cos(pi t/2) n; predicts dx_t/dt"),
    Parameterization("sit_gvp_score", "flow", "sit_gvp", "score",
                     "SiT GVP: predicts the score -n / cos(pi t/2)"),
    Parameterization("sit_gvp_noise", "flow", "sit_gvp", "noise",
                     "SiT GVP: predicts the noise n"),
)
_BY_NAME = {p.name: p for p in PARAMETERIZATION_TABLE}
PARAMETERIZATIONS = tuple(_BY_NAME)
# The flow paths: how each is written in the note and what check-config calls it.
FLOW_PATHS = {
    "rectified_flow": "rectified flow, x_t = (1-t) x + t n, data at t = 0",
    "cosine": "cosine, x_t = cos(pi t/2) x + sin(pi t/2) n, data at t = 0",
    "sit_linear": "SiT Linear, x_t = t x + (1-t) n, data at t = 1 (SiT's code)",
    "sit_gvp": "SiT GVP, x_t = sin(pi t/2) x + cos(pi t/2) n, data at t = 1 (SiT's code)",
}
SCHEDULES = ("linear", "scaled_linear", "cosine", "continuous")

_DEFAULT_BETAS = {
    "linear": (1e-4, 0.02),
    "scaled_linear": (0.00085, 0.012),
    "continuous": (0.1, 20.0),
}



def vp_alphas_cumprod(schedule: str = "linear", beta_min: Optional[float] = None,
                      beta_max: Optional[float] = None, T: int = 1000) -> Tensor:
    """alphabar_t, t = 0..T-1, of a discrete VP schedule (float64)."""
    if T < 2:
        raise ValueError(f"T must be >= 2, got {T}")
    if schedule == "cosine":
        s = 0.008

        def f(u: Tensor) -> Tensor:
            return torch.cos((u + s) / (1 + s) * math.pi / 2) ** 2

        i = torch.arange(T, dtype=torch.float64)
        betas = (1 - f((i + 1) / T) / f(i / T)).clamp(max=0.999)
    elif schedule in ("linear", "scaled_linear"):
        lo, hi = _DEFAULT_BETAS[schedule]
        lo = lo if beta_min is None else float(beta_min)
        hi = hi if beta_max is None else float(beta_max)
        if not (0 < lo <= hi < 1):
            raise ValueError(f"need 0 < beta_min <= beta_max < 1, got {lo}, {hi}")
        if schedule == "linear":
            betas = torch.linspace(lo, hi, T, dtype=torch.float64)
        else:
            betas = torch.linspace(math.sqrt(lo), math.sqrt(hi), T, dtype=torch.float64) ** 2
    else:
        raise ValueError(f"unknown discrete schedule {schedule!r}")
    return torch.cumprod(1 - betas, dim=0)


def edm_sampling_sigmas(n: int = 18, sigma_min: float = 0.002, sigma_max: float = 80.0,
                        rho: float = 7.0) -> Tensor:
    """The EDM sampling noise levels t_0 > ... > t_{n-1} (float64, docs/design.md §3)."""
    i = torch.arange(n, dtype=torch.float64)
    return (sigma_max ** (1 / rho) + i / (n - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho


def flow_time(path: str, sigma):
    """The time ``t`` on a flow path (:data:`FLOW_PATHS`) that holds the EDM noise level
    ``sigma`` (a float or a tensor), as the network takes it before any ``t_scale``:

    * ``rectified_flow`` (data at t = 0): ``t = sigma / (1 + sigma)``;
    * ``cosine`` (data at t = 0): ``t = (2/pi) atan(sigma)``;
    * ``sit_linear`` (data at t = 1, SiT's code): ``t = 1 / (1 + sigma)``;
    * ``sit_gvp`` (data at t = 1): ``t = (2/pi) atan(1/sigma)``.

    In the SiT paper's convention (data at t = 0) a SiT time is ``1 - t``."""
    s = sigma.to(torch.float64) if isinstance(sigma, Tensor) else torch.tensor(float(sigma), dtype=torch.float64)
    if path == "rectified_flow":
        t = s / (1 + s)
    elif path == "cosine":
        t = (2 / math.pi) * torch.atan(s)
    elif path == "sit_linear":
        t = 1 / (1 + s)
    elif path == "sit_gvp":
        t = (2 / math.pi) * torch.atan2(torch.ones_like(s), s)
    else:
        raise ValueError(f"unknown flow path {path!r}; one of {tuple(FLOW_PATHS)}")
    return float(t) if t.dim() == 0 and not isinstance(sigma, Tensor) else t


def _flow_coefficients(path: str, s: Tensor):
    """``(t, alpha, sigma_t, d_alpha, d_sigma_t)`` at EDM noise level ``s`` (float64 [B]): the
    path writes ``x_t = alpha x + sigma_t n`` with ``sigma_t / alpha = s``; the derivatives are
    with respect to the path's own ``t`` (module docstring, "Flow matching")."""
    t = flow_time(path, s)
    one = torch.ones_like(s)
    if path == "rectified_flow":
        return t, 1 / (1 + s), s / (1 + s), -one, one
    if path == "sit_linear":
        return t, 1 / (1 + s), s / (1 + s), one, -one
    # sit_gvp: alpha = sin(pi t/2) = 1/sqrt(1+s^2), sigma_t = cos(pi t/2) = s/sqrt(1+s^2);
    # cosine: alpha = cos(pi t/2), sigma_t = sin(pi t/2), the same values at the same s.
    r = torch.sqrt(1 + s * s)
    a, st = 1 / r, s / r
    if path == "cosine":
        return t, a, st, -(math.pi / 2) * st, (math.pi / 2) * a
    if path == "sit_gvp":
        return t, a, st, (math.pi / 2) * st, -(math.pi / 2) * a
    # A path flow_time knows and this function does not: never another path's coefficients.
    raise ValueError(f"no coefficients for the flow path {path!r}")


class _Converter:
    """The EDM <-> network conversion, written with torch ops so it traces."""

    def __init__(self, parameterization: str, sigma_data: float, schedule: str,
                 beta_min: Optional[float], beta_max: Optional[float], T: int,
                 alphas_cumprod: Any, timestep: str, t_scale: Optional[float],
                 timestep_dtype: Optional[torch.dtype], device: torch.device):
        if parameterization not in _BY_NAME:
            raise ValueError(f"parameterization must be one of {PARAMETERIZATIONS}, got {parameterization!r}")
        self.p = parameterization
        self.row = _BY_NAME[parameterization]
        self.sigma_data = float(sigma_data)
        if self.sigma_data <= 0:
            raise ValueError(f"sigma_data must be > 0, got {sigma_data}")
        self.continuous = False
        self.log_sigmas: Optional[Tensor] = None
        self.t_scale: Optional[float] = None
        self.schedule = "alphas_cumprod" if alphas_cumprod is not None else schedule
        if self.row.family == "flow":
            given = [name for name, differs in (
                ("schedule", schedule != "linear"), ("beta_min", beta_min is not None),
                ("beta_max", beta_max is not None), ("T", T != 1000),
                ("alphas_cumprod", alphas_cumprod is not None), ("timestep", timestep != "nearest")) if differs]
            if given:
                raise ValueError(f"{', '.join(given)}: a VP schedule's options, not used by the flow-matching "
                                 f"parameterization {parameterization!r} (its path fixes the noise levels)")
            default_scale = 1000.0 if self.row.path == "rectified_flow" else 1.0
            self.t_scale = default_scale if t_scale is None else float(t_scale)
            if not (math.isfinite(self.t_scale) and self.t_scale > 0):
                raise ValueError(f"t_scale must be > 0, got {t_scale}")
            self.t_dtype = timestep_dtype or torch.float32
            return
        if self.row.family != "vp":
            return
        if timestep not in ("nearest", "interp"):
            raise ValueError(f"timestep must be 'nearest' or 'interp', got {timestep!r}")
        self.timestep = timestep
        if alphas_cumprod is not None:
            ab = torch.as_tensor(alphas_cumprod, dtype=torch.float64).flatten().cpu()
            if ab.numel() < 2 or not bool(((ab > 0) & (ab < 1)).all()) or not bool((ab[1:] < ab[:-1]).all()):
                raise ValueError("alphas_cumprod must be a strictly decreasing table of values in (0, 1)")
        elif schedule == "continuous":
            lo, hi = _DEFAULT_BETAS["continuous"]
            self.beta_min = lo if beta_min is None else float(beta_min)
            self.beta_d = (hi if beta_max is None else float(beta_max)) - self.beta_min
            if self.beta_min < 0 or self.beta_d <= 0:
                raise ValueError(f"need 0 <= beta_min < beta_max, got {beta_min}, {beta_max}")
            self.continuous = True
            self.t_scale = 999.0 if t_scale is None else float(t_scale)
            self.t_dtype = timestep_dtype or torch.float32
            return
        elif schedule in SCHEDULES:
            ab = vp_alphas_cumprod(schedule, beta_min, beta_max, T)
        else:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if t_scale is not None:
            raise ValueError("t_scale applies to schedule='continuous' and to the flow-matching "
                             "parameterizations only")
        self.alphas_cumprod = ab
        self.log_sigmas = (0.5 * torch.log((1 - ab) / ab)).to(device)  # ascending
        default_dtype = torch.int64 if timestep == "nearest" else torch.float32
        self.t_dtype = timestep_dtype or default_dtype

    # -- sigma -> network time -------------------------------------------------------------------
    def time(self, sigma: Tensor) -> Tensor:
        """sigma [B] float32 -> the time argument the VP network expects, [B]."""
        s = sigma.to(torch.float64)
        if self.continuous:
            t = (torch.sqrt(self.beta_min ** 2 + 2 * self.beta_d * torch.log1p(s * s)) - self.beta_min) / self.beta_d
            return (t * self.t_scale).to(self.t_dtype)
        ls = torch.log(s)
        # A graph constant: it follows the load device (torch.jit.load(map_location=...) /
        # tch CModule::load_on_device), not a later module.to(device).
        table = self.log_sigmas
        assert table is not None
        if self.timestep == "nearest":
            idx = torch.argmin(torch.abs(ls.unsqueeze(1) - table.unsqueeze(0)), dim=1)
            return idx.to(self.t_dtype)
        n = table.shape[0]
        hi = torch.searchsorted(table, ls.contiguous()).clamp(1, n - 1)
        lo = hi - 1
        w = (ls - table[lo]) / (table[hi] - table[lo])
        t = (lo.to(torch.float64) + w).clamp(0, n - 1)
        return t.to(self.t_dtype)

    def note(self) -> dict:
        """What the file's note records of the conversion: family, path, prediction, time scale,
        a discrete schedule's highest sigma."""
        row = self.row
        out: dict = {"family": row.family, "path": row.path, "prediction": row.prediction}
        if row.family == "vp":
            out["schedule"] = self.schedule
        if row.family == "flow" or self.continuous:
            out["t_scale"] = self.t_scale
        if self.log_sigmas is not None:
            # The highest noise level of a discrete schedule: the daemon's parameterization
            # check stays below it (src/engine/model/consistency.rs).
            out["sigma_max"] = float(self.log_sigmas[-1].exp())
        return out

    # -- the whole conversion --------------------------------------------------------------------
    def denoise(self, net_call, x: Tensor, sigma: Tensor) -> Tensor:
        sig = sigma.to(x.dtype).reshape(-1)
        s4 = sig.reshape(-1, 1, 1, 1)
        row = self.row
        if self.p == "edm":
            return _as_tensor(net_call(x, sig))
        if self.p == "edm_raw":
            sd = self.sigma_data
            c_skip = sd * sd / (s4 * s4 + sd * sd)
            c_out = s4 * sd / torch.sqrt(s4 * s4 + sd * sd)
            c_in = 1 / torch.sqrt(s4 * s4 + sd * sd)
            c_noise = torch.log(sig) / 4
            return c_skip * x + c_out * _as_tensor(net_call(c_in * x, c_noise))
        if row.family == "flow":
            # x_t = alpha (x + sigma n) with sigma_t = alpha sigma (module docstring, "Flow matching").
            assert row.path is not None and self.t_scale is not None
            t, a, st, da, dst = (c.reshape(-1, 1, 1, 1) for c in _flow_coefficients(row.path, sig.to(torch.float64)))
            x_net = x * a.to(x.dtype)
            out = _as_tensor(net_call(x_net, (t.reshape(-1) * self.t_scale).to(self.t_dtype)))
            if row.prediction == "velocity":
                # u = da x + dst n and x_t = a x + st n give x = (st u - dst x_t) / (da st - a dst).
                det = da * st - a * dst
                return (-dst * a / det).to(x.dtype) * x + (st / det).to(x.dtype) * out
            if row.prediction == "noise":
                return x - s4 * out
            if row.prediction == "score":  # score = -n / sigma_t, so n = -sigma_t * score
                return x + (s4 * st.to(x.dtype)) * out
            raise ExportError(f"no conversion for the flow prediction {row.prediction!r}")
        x_vp = x / torch.sqrt(1 + s4 * s4)
        out = _as_tensor(net_call(x_vp, self.time(sig)))
        if self.p == "eps":
            return x - s4 * out
        if self.p == "v":
            return x / (1 + s4 * s4) - s4 / torch.sqrt(1 + s4 * s4) * out
        if self.p == "x0":
            return out
        raise ExportError(f"no conversion for the parameterization {self.p!r}")


def _as_tensor(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    sample = getattr(out, "sample", None)
    if isinstance(sample, Tensor):
        return sample
    raise ExportError(f"the network returned {type(out).__name__}; expected a Tensor, a tuple whose "
                      "first item is a Tensor, or an object with a .sample Tensor")
