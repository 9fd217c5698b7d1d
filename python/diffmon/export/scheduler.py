"""Checks of an export against the training scheduler (``--scheduler``) and of the network's
outputs against the stated parameterization (the consistency warning)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Optional

import torch

from .parameterization import _Converter, _DEFAULT_BETAS, _flow_coefficients


_DIFFUSERS_PREDICTIONS = {"epsilon": "eps", "v_prediction": "v", "sample": "x0"}
_DIFFUSERS_SCHEDULES = {"linear": "linear", "scaled_linear": "scaled_linear", "squaredcos_cap_v2": "cosine"}


# The longest scheduler config read.
MAX_SCHEDULER_BYTES = 1 << 20
# The most training timesteps taken (diffusers' schedulers allocate tables of this length).
MAX_TIMESTEPS = 100_000
# The keys compared, each with the type it must have.
_TYPED_KEYS = {"prediction_type": (str, "a string"), "beta_schedule": (str, "a string"),
               "beta_start": ((int, float), "a number"), "beta_end": ((int, float), "a number"),
               "num_train_timesteps": (int, "an integer")}


def read_scheduler_config(scheduler) -> dict:
    """A diffusers scheduler's config: ``scheduler`` is a dict, a ``scheduler_config.json`` or a
    folder holding one (a pipeline's ``scheduler/``). Read as JSON, never run: a regular file of
    at most 1 MiB (a FIFO or a device is refused without blocking), a ``_class_name`` naming a
    scheduler, and the keys compared of the types diffusers gives them; anything else is a
    ``ValueError`` naming the file and the key."""
    where = "the scheduler config"
    if isinstance(scheduler, dict):
        cfg = scheduler
    else:
        path = Path(scheduler)
        if path.is_dir():
            path = path / "scheduler_config.json"
        where = f"the scheduler config {path}"
        cfg = _read_json(path, where)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("_class_name"), str):
        raise ValueError(f"{where} is not a diffusers scheduler config (no _class_name)")
    name = cfg["_class_name"]
    if not (name.isidentifier() and name.endswith("Scheduler") and len(name) <= 100):
        raise ValueError(f"{where}: _class_name {name[:100]!r} does not name a diffusers scheduler")
    for key, (kind, what) in _TYPED_KEYS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kind) or (
                kind != str and not math.isfinite(value)):
            raise ValueError(f"{where}: {key} is {_shown(value)}, not {what}")
    n = cfg.get("num_train_timesteps")
    if n is not None and not 1 <= n <= MAX_TIMESTEPS:
        raise ValueError(f"{where}: num_train_timesteps {n} is outside 1..{MAX_TIMESTEPS}")
    return cfg


def _read_json(path: Path, where: str):
    """The JSON of a regular file of at most MAX_SCHEDULER_BYTES, opened without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot read {where}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"cannot read {where}: not a regular file")
        if st.st_size > MAX_SCHEDULER_BYTES:
            raise ValueError(f"cannot read {where}: {st.st_size} bytes, more than a scheduler "
                             f"config's {MAX_SCHEDULER_BYTES} at most")
        text = f.read(MAX_SCHEDULER_BYTES + 1)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"cannot read {where}: its JSON is nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"cannot read {where}: {e}") from None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def scheduler_mismatches(cfg: dict, conv: "_Converter", schedule: str, beta_min: Optional[float],
                         beta_max: Optional[float], T: int) -> list:
    """What in the export disagrees with the diffusers scheduler config ``cfg`` (sentences; empty
    when it agrees). A ``FlowMatch*`` scheduler trains a rectified-flow network (its ``shift`` is
    the sampler's and is not compared); DDPM-style schedulers name the prediction, the schedule,
    its betas and the number of timesteps."""
    cls = cfg.get("_class_name", "?")
    p = conv.p
    if cls.startswith("FlowMatch"):
        if p != "rectified_flow":
            return [f"{cls} trains a rectified-flow network (x_t = (1-t) x + t n, predicting n - x): "
                    f"--parameterization rectified_flow, not {p}"]
        return []
    if cls.startswith("EDM"):  # EDMEulerScheduler, EDMDPMSolverMultistepScheduler: Karras et al.'s sigmas
        if conv.row.family != "edm":
            return [f"{cls} trains an EDM network: --parameterization edm or edm_raw, not {p}"]
        return []
    prediction = cfg.get("prediction_type", "epsilon")
    if "beta_schedule" not in cfg and "prediction_type" not in cfg:
        return [f"{cls} is not a scheduler the exporter knows (a FlowMatch* or a DDPM-style scheduler "
                "with prediction_type and beta_schedule)"]
    want = _DIFFUSERS_PREDICTIONS.get(prediction)
    if want is None:
        return [f"{cls} has prediction_type {prediction!r}, which no parameterization matches"]
    if p != want:
        return [f"{cls} with prediction_type {prediction!r} is --parameterization {want}, not {p}"]
    out = []
    sched = _DIFFUSERS_SCHEDULES.get(cfg.get("beta_schedule", "linear"))
    if sched is None:
        out.append(f"{cls} has beta_schedule {cfg.get('beta_schedule')!r}, which no --schedule matches "
                   "(pass its alphas_cumprod table to export(alphas_cumprod=...))")
    elif schedule != sched:
        out.append(f"{cls} has beta_schedule {cfg.get('beta_schedule')!r}: --schedule {sched}, not {schedule}")
    if sched in ("linear", "scaled_linear") and schedule == sched:
        lo, hi = _DEFAULT_BETAS[sched]
        for key, ours, default in (("beta_start", beta_min, lo), ("beta_end", beta_max, hi)):
            theirs = cfg.get(key)
            mine = default if ours is None else ours
            if theirs is not None and not math.isclose(float(theirs), mine, rel_tol=1e-9):
                flag = "--beta-min" if key == "beta_start" else "--beta-max"
                out.append(f"{cls} has {key} {theirs}: {flag} {theirs}, not {mine}")
    n = cfg.get("num_train_timesteps")
    if n is not None and int(n) != T:
        out.append(f"{cls} has num_train_timesteps {n}: --T {n}, not {T}")
    return out


def scheduler_round_trip(cfg: dict, conv: "_Converter") -> Optional[str]:
    """The noisy input the export hands the network, against the one the diffusers scheduler
    makes from the same image and noise (``add_noise``, or ``scale_noise`` for ``FlowMatch*``), at
    four of its timesteps: a sentence when they differ, None when they agree or when diffusers (or
    the scheduler class) is not importable."""
    try:
        import diffusers
        cls = getattr(diffusers, cfg["_class_name"])
        # Only a scheduler is built from the config: another class of diffusers (a model) would
        # allocate what the file asks for.
        if not (isinstance(cls, type) and issubclass(cls, diffusers.SchedulerMixin)):
            return None
        sched = cls.from_config(cfg)
    except Exception:
        return None
    if conv.row.family == "edm":
        return None  # an EDM network takes sigma itself: nothing to map
    g = torch.Generator().manual_seed(3)
    x0 = torch.rand(1, 2, 4, 4, generator=g, dtype=torch.float64) * 2 - 1
    n = torch.randn(1, 2, 4, 4, generator=g, dtype=torch.float64)
    worst = 0.0
    with torch.no_grad():
        if conv.row.family == "flow" and hasattr(sched, "scale_noise"):
            n_steps = len(sched.timesteps)  # index 0 is t = 1, all noise: sigma infinite
            steps = sched.timesteps[[n_steps * k // 8 for k in (1, 3, 5, 7)]]
            for tau in steps:
                s = float(tau) / float(sched.config.num_train_timesteps)  # the scheduler's t
                theirs = sched.scale_noise(x0, tau.reshape(1), n)
                sigma = torch.tensor([s / (1 - s)], dtype=torch.float64)
                t, a, _, _, _ = _flow_coefficients(conv.row.path, sigma)
                worst = max(worst, float((a * (x0 + sigma * n) - theirs).abs().max()), abs(float(t) - s))
        elif conv.log_sigmas is not None and hasattr(sched, "add_noise") and hasattr(sched, "alphas_cumprod"):
            ab = sched.alphas_cumprod.to(torch.float64)
            for k in torch.linspace(0, len(ab) - 1, 4).long():
                theirs = sched.add_noise(x0, n, k.reshape(1))
                sigma = torch.sqrt((1 - ab[k]) / ab[k]).reshape(1)
                ours = (x0 + sigma * n) / torch.sqrt(1 + sigma * sigma)
                step = float(conv.time(sigma.to(torch.float32)))
                worst = max(worst, float((ours - theirs).abs().max()), abs(step - float(k)))
        else:
            return (f"the export's {conv.row.family} conversion cannot be compared with a "
                    f"{cfg['_class_name']}: the family differs")
    if worst > 1e-3:
        return (f"the network input the export makes differs from the {cfg['_class_name']}'s own noising "
                f"by {worst:.3g}: the schedule or the timesteps do not match")
    return None


def consistency_warning(denoise, shape, device="cpu", sigma_max: float = 80.0) -> Optional[str]:
    """A warning when the denoiser ``denoise(x, sigma) -> (denoised, features)`` does not behave
    as a trained denoiser at high noise: from pure noise (a zero image plus noise) at two high
    noise levels, ``s`` = min(80, 0.9 ``sigma_max``) and ``s / 4`` (``sigma_max``: the highest
    level the network was trained at, a discrete VP schedule's last), a trained denoiser returns
    about the mean of its data at both (a root mean square of the order of the data's), while a
    network converted with the wrong parameterization returns values that grow with sigma.
    Meaningful for a trained network only (an untrained one grows too); None when nothing is
    wrong that this can see."""
    c, h, w = shape
    n = torch.randn(4, c, h, w, generator=torch.Generator().manual_seed(2)).to(device)
    hi = min(80.0, 0.9 * float(sigma_max))
    levels = (hi / 4, hi)
    rms = []
    with torch.no_grad():
        for s in levels:
            d = denoise(s * n, torch.full((4,), s, device=device))[0]
            rms.append(float(d.double().pow(2).mean().sqrt()))
    if rms[1] > 4.0 and rms[1] > 2.0 * rms[0]:
        return (f"the denoised output from pure noise has root mean square {rms[0]:.3g} at sigma {levels[0]:.3g} "
                f"and {rms[1]:.3g} at sigma {levels[1]:.3g}; a trained denoiser's stays near its data's mean at "
                "both. If the "
                "network is trained, its parameterization is probably not the one stated (a flow-matching "
                "network exported as eps/v/x0, or the other way round): name its training scheduler "
                "(--scheduler) to check")
    return None


# The TracerWarnings a trace filters, as (module, message) regular expressions matched from the
# start of the warning's module name and message (module docstring, "Tracer warnings").
