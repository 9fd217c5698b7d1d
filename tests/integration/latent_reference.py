"""Independent PyTorch/numpy references for ``tests/integration/latent.rs``.

Written from docs/design.md (§2 ICR, §20 latent and conditional models), not from diffmon's code:
the seeded subset, the augmentation and the noise are drawn with PyTorch's CPU generator in the
order the design gives, the network is the *eager* diffusers module called with its condition
(not the exported file), and ICR is solved with scipy's generalized symmetric eigensolver.

- :func:`subset` — ``min(n, N)`` distinct training indices: ``manual_seed(seed)``, ``randperm``,
  first ``n``, sorted.
- :func:`augment` — crop with reflect padding (``round(crop·min(H, W))`` pixels each side, per-image
  offsets drawn as ``randint`` rows then columns), horizontal flip with p = 0.5 (``rand < 0.5``),
  then brightness, contrast, saturation jitter in [0, 1] colour space (one ``rand`` factor in
  ``[1 − s, 1 + s]`` each, in that order; grey = 0.299 R + 0.587 G + 0.114 B, or the channel mean).
- :func:`views` — per batch of ``batch_size // 2`` pairs (pair ``i`` uses subset image
  ``i mod m``): view 1 augmented (and encoded, for a latent model), its noise, view 2, its noise;
  the generator seeded once with ``seed`` before the first batch.
- :func:`icr` — ``Σ_ξ = ½ Cov(u)``, ``Σ_s = Cov(t) − ¼ Cov(u)`` (divisor n − 1) of ``t = (h1+h2)/2``,
  ``u = h1 − h2`` in float64, ridge ``1e-4 · Tr(Σ_ξ)/d`` on Σ_ξ, ``ICR = 1/(1 + mean λ)``.
- :func:`vp_features` — a VP ε-network at EDM noise level σ: input ``x / sqrt(1 + σ²)``, timestep
  the index of DDPM's linear schedule (1e-4..0.02, 1000 steps) whose ``sqrt((1 − ᾱ)/ᾱ)`` is
  nearest σ in log space; the features are the named layer's output (tokens mean-pooled), then
  mean-pooled over space.
"""

from __future__ import annotations

import math

import h5py
import numpy as np
import scipy.linalg
import torch
import torch.nn.functional as F


def subset(n_total: int, n: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randperm(n_total)[: min(n, n_total)].sort().values


def augment(x: torch.Tensor, crop: float = 0.125, flip: bool = True, jitter: float = 0.4) -> torch.Tensor:
    b, c, h, w = x.shape
    y = x
    pad = int(math.floor(crop * min(h, w) + 0.5))
    if pad > 0:
        padded = F.pad(y, (pad, pad, pad, pad), mode="reflect")
        oy = torch.randint(0, 2 * pad + 1, (b, 1))
        ox = torch.randint(0, 2 * pad + 1, (b, 1))
        y = torch.stack([padded[i][:, int(oy[i]):int(oy[i]) + h, int(ox[i]):int(ox[i]) + w]
                         for i in range(b)])
    if flip:
        flipped = torch.rand(b, 1, 1, 1) < 0.5
        y = torch.where(flipped, y.flip(3), y)
    if jitter > 0:
        def factor():
            return torch.rand(b, 1, 1, 1) * (2 * jitter) + (1 - jitter)

        def grey(z):
            if c == 3:
                return (z * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)
            return z.mean(1, keepdim=True)

        z = ((y + 1) * 0.5 * factor()).clamp(0, 1)
        mean = grey(z).mean((1, 2, 3), keepdim=True)
        z = ((z - mean) * factor() + mean).clamp(0, 1)
        if c == 3:
            g = grey(z)
            z = ((z - g) * factor() + g).clamp(0, 1)
        y = z * 2 - 1
    return y


def views(images: torch.Tensor, samples: int, seed: int, batch_size: int, encode=None, **aug):
    """Clean views and unit noise ``(v1, n1, v2, n2)``, ``[samples, ...]`` each."""
    torch.manual_seed(seed)
    m = images.shape[0]
    pairs = max(batch_size // 2, 1)
    out = ([], [], [], [])
    done = 0
    while done < samples:
        b = min(pairs, samples - done)
        x0 = images[torch.arange(done, done + b) % m]
        for k in (0, 2):
            v = augment(x0, **aug)
            if encode is not None:
                v = encode(v)
            out[k].append(v)
            out[k + 1].append(torch.randn(v.shape))
        done += b
    return tuple(torch.cat(t) for t in out)


def icr(h1: torch.Tensor, h2: torch.Tensor, ridge: float = 1e-4) -> float:
    h1, h2 = h1.double().numpy(), h2.double().numpy()
    t, u = (h1 + h2) / 2, h1 - h2
    cov_t, cov_u = np.cov(t, rowvar=False), np.cov(u, rowvar=False)
    s_s, s_xi = cov_t - cov_u / 4, cov_u / 2
    d = s_xi.shape[0]
    tau = ridge * np.trace(s_xi) / d
    lam = scipy.linalg.eigh(s_s, s_xi + tau * np.eye(d), eigvals_only=True)
    return float(1 / (1 + lam.mean()))


def nearest_timestep(sigma: float, T: int = 1000, beta_min: float = 1e-4, beta_max: float = 0.02) -> int:
    betas = np.linspace(beta_min, beta_max, T, dtype=np.float64)
    alphabar = np.cumprod(1 - betas)
    log_sigmas = 0.5 * np.log((1 - alphabar) / alphabar)
    return int(np.argmin(np.abs(np.log(sigma) - log_sigmas)))


def vp_features(net, layer: str, x: torch.Tensor, sigma: float, batch: int, **condition) -> torch.Tensor:
    """Pooled features of the eager network ``net`` at EDM noise level ``sigma``, ``[B, d]``."""
    captured = []
    handle = net.get_submodule(layer).register_forward_hook(lambda _m, _i, out: captured.append(out))
    t = nearest_timestep(sigma)
    feats = []
    try:
        with torch.no_grad():
            for start in range(0, x.shape[0], batch):
                xb = x[start:start + batch]
                n = xb.shape[0]
                kwargs = {k: (v(n) if callable(v) else v) for k, v in condition.items()}
                captured.clear()
                s = torch.tensor(sigma, dtype=torch.float32)  # the contract's sigma is float32
                net(xb / torch.sqrt(1 + s * s), torch.full((n,), t, dtype=torch.int64), **kwargs)
                f = captured[0]
                if f.dim() == 3:
                    f = f.mean(1)
                if f.dim() == 4:
                    f = f.mean((2, 3))
                feats.append(f.float())
    finally:
        handle.remove()
    return torch.cat(feats)


def icr_of(net, layer: str, images: torch.Tensor, *, samples: int, seed: int, sigma: float,
           batch_size: int, encode=None, **condition) -> float:
    """The whole ICR protocol on ``images`` (the training set, ``[N, C, H, W]``)."""
    idx = subset(images.shape[0], samples, seed)
    v1, n1, v2, n2 = views(images[idx], samples, seed, batch_size, encode)
    x1, x2 = v1 + n1 * sigma, v2 + n2 * sigma
    # Both views of a batch go through the network together, as pairs of batch_size // 2.
    pairs = max(batch_size // 2, 1)
    h1, h2 = [], []
    for start in range(0, samples, pairs):
        x = torch.cat([x1[start:start + pairs], x2[start:start + pairs]])
        h = vp_features(net, layer, x, sigma, 2 * pairs, **condition)
        b = h.shape[0] // 2
        h1.append(h[:b])
        h2.append(h[b:])
    return icr(torch.cat(h1), torch.cat(h2))


# ------------------------------------------------------------------------------ fixtures


def smooth_images(n: int, c: int, size: int, seed: int) -> torch.Tensor:
    """``n`` smooth ``[c, size, size]`` images in [-1, 1] (blurred noise through tanh)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, size, size, generator=g)
    k = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
    k = (k[:, None] * k[None, :] / 256.0).expand(c, 1, 5, 5)
    x = F.conv2d(F.pad(x, (2, 2, 2, 2), mode="reflect"), k, groups=c)
    return torch.tanh(2.5 * x / x.std())


def write_images(path, images: torch.Tensor) -> None:
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=images.numpy().astype(np.float32))


def perturbed_state(net, seed: int) -> dict:
    """``net``'s state dict with every float tensor moved by 5 % of its spread (a checkpoint
    that is not the exported file's own weights)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in net.state_dict().items():
        if v.is_floating_point() and v.numel() > 1:
            v = v + 0.05 * v.std() * torch.randn(v.shape, generator=g)
        state[k] = v.clone().contiguous()
    return state
