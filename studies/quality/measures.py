"""The quality benchmark's own instruments, independent of diffmon (studies/quality/benchmark.py).

Nothing here reads a diffmon record: these are what the benchmark scores the rules with.

- `heun_sample`: EDM's deterministic Heun sampler (Karras et al. 2022, Algorithm 1 without
  churn), batched; the study's samples and the teacher's flow come from it.
- `Classifier` / `train_classifier`: a small MNIST CNN whose penultimate layer (128 ReLU units)
  is the feature space of KID and the Fréchet distance.
- `KidReference.kid`: KID (Bińkowski et al. 2018), the unbiased squared MMD with the cubic
  polynomial kernel k(x, y) = (x·y/d + 1)^3, with a standard error from disjoint blocks.
- `frechet`: the Fréchet distance between Gaussians fitted to two feature sets.
- `nearest_two`, `copies`: the two copy criteria (the nearest/second-nearest ratio < 1/3 of
  Bonnaire et al., arXiv 2505.17638, and a distance threshold calibrated on fresh images'
  own nearest-neighbour distances).
- `clopper_pearson`, `normalized_regret`, `stratified_bootstrap`: the statistics.
"""

from __future__ import annotations

import math

import numpy as np

SIGMA_MIN, SIGMA_MAX, RHO, HEUN_STEPS = 0.002, 80.0, 7.0, 18
COPY_RATIO = 1 / 3
CALIBRATION_QUANTILE = 0.005  # a fresh image counts as a copy with this probability
FEATURES = 128


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------

def heun_sigmas(steps: int = HEUN_STEPS):
    """sigma_i = (smax^(1/rho) + i/(N-1) (smin^(1/rho) - smax^(1/rho)))^rho, i < N, then 0."""
    import torch

    i = torch.arange(steps, dtype=torch.float64)
    sig = (SIGMA_MAX ** (1 / RHO) + i / (steps - 1)
           * (SIGMA_MIN ** (1 / RHO) - SIGMA_MAX ** (1 / RHO))) ** RHO
    return torch.cat([sig, torch.zeros(1, dtype=torch.float64)])


def heun_sample(net, latents, batch: int = 256, steps: int = HEUN_STEPS):
    """The flow of `net` (a denoiser D(x, sigma)) from standard-normal `latents`: x = z * sigma_0,
    then Heun steps (the last one Euler, to sigma = 0); float64 state, float32 network calls."""
    import torch

    sig = heun_sigmas(steps)
    out = []
    with torch.no_grad():
        for start in range(0, len(latents), batch):
            x = latents[start:start + batch].double() * sig[0]
            for k in range(steps):
                s, s_next = sig[k], sig[k + 1]
                d = (x - net(x.float(), s.float().expand(len(x))).double()) / s
                x_next = x + (s_next - s) * d
                if s_next > 0:
                    d2 = (x_next - net(x_next.float(), s_next.float().expand(len(x))).double()) / s_next
                    x_next = x + (s_next - s) * (d + d2) / 2
                x = x_next
            out.append(x.float())
    return torch.cat(out) if out else latents[:0].float()


# ---------------------------------------------------------------------------------------------
# The classifier and its features
# ---------------------------------------------------------------------------------------------

def classifier_class():
    import torch.nn.functional as F
    from torch import nn

    class Classifier(nn.Module):
        """conv(1→32, 3) → ReLU → max-pool 2 → conv(32→64, 3) → ReLU → max-pool 2 → linear(64·7·7
        → 128) → ReLU (the features) → linear(128 → 10). Input: [B,1,28,28] in [-1, 1]."""

        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
            self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
            self.fc1 = nn.Linear(64 * 7 * 7, FEATURES)
            self.fc2 = nn.Linear(FEATURES, 10)

        def features(self, x):
            h = F.max_pool2d(F.relu(self.conv1(x)), 2)
            h = F.max_pool2d(F.relu(self.conv2(h)), 2)
            return F.relu(self.fc1(h.flatten(1)))

        def forward(self, x):
            return self.fc2(self.features(x))

    return Classifier


def train_classifier(images, labels, epochs: int = 3, batch: int = 128, seed: int = 0):
    """The classifier trained with Adam (lr 1e-3) on `images` [N,1,28,28] in [-1, 1]."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    net = classifier_class()()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.as_tensor(labels, dtype=torch.long)
    net.train()
    for _ in range(epochs):
        perm = torch.randperm(len(images), generator=gen)
        for i in range(0, len(images), batch):
            idx = perm[i:i + batch]
            loss = F.cross_entropy(net(images[idx]), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return net.eval()


def features(net, images, batch: int = 1000) -> np.ndarray:
    """The classifier's penultimate features of `images`, float64 [N, 128]."""
    import torch

    with torch.no_grad():
        out = [net.features(images[i:i + batch].float()).double() for i in range(0, len(images), batch)]
    return torch.cat(out).numpy() if out else np.zeros((0, FEATURES))


def accuracy(net, images, labels, batch: int = 1000) -> float:
    import torch

    with torch.no_grad():
        pred = torch.cat([net(images[i:i + batch]).argmax(1) for i in range(0, len(images), batch)])
    return float((pred.numpy() == np.asarray(labels)).mean())


# ---------------------------------------------------------------------------------------------
# KID and the Fréchet distance
# ---------------------------------------------------------------------------------------------

def _kernel_sum(a: np.ndarray, b: np.ndarray, chunk: int = 2048) -> float:
    """Σ_ij (a_i·b_j/d + 1)^3 over all pairs, in chunks of rows (bounded memory)."""
    d = a.shape[1]
    return float(sum((((a[i:i + chunk] @ b.T) / d + 1.0) ** 3).sum() for i in range(0, len(a), chunk)))


def _self_sum(a: np.ndarray) -> float:
    """Σ_{i≠j} k(a_i, a_j)."""
    d = a.shape[1]
    diag = ((np.einsum("ij,ij->i", a, a) / d + 1.0) ** 3).sum()
    return _kernel_sum(a, a) - float(diag)


class KidReference:
    """The reference set's part of KID, computed once: Σ_{i≠j} k(y_i, y_j) over the n reference
    features y."""

    def __init__(self, y: np.ndarray):
        self.y = np.asarray(y, dtype=np.float64)
        n = len(self.y)
        self.yy = _self_sum(self.y) / (n * (n - 1))

    def mmd2(self, x: np.ndarray) -> float:
        """The unbiased squared MMD of `x` [m, d] against the reference:
        Σ_{i≠j} k(x_i,x_j)/(m(m-1)) + Σ_{i≠j} k(y_i,y_j)/(n(n-1)) − 2 Σ_ij k(x_i,y_j)/(mn)."""
        x = np.asarray(x, dtype=np.float64)
        m, n = len(x), len(self.y)
        return _self_sum(x) / (m * (m - 1)) + self.yy - 2 * _kernel_sum(x, self.y) / (m * n)

    def kid(self, x: np.ndarray, blocks: int = 8) -> tuple[float, float]:
        """(KID of all of `x`, its standard error): the spread of the estimate over `blocks`
        disjoint blocks of `x` divided by sqrt(blocks) (approximate: the whole set's estimate
        also has the cross-block pairs)."""
        per = [self.mmd2(b) for b in np.array_split(np.asarray(x), blocks) if len(b) >= 2]
        se = float(np.std(per, ddof=1) / math.sqrt(len(per))) if len(per) > 1 else float("nan")
        return self.mmd2(x), se


def frechet(x: np.ndarray, y: np.ndarray) -> float:
    """‖μx − μy‖² + Tr(Σx + Σy − 2 (Σx Σy)^½): the Fréchet distance of Gaussians fitted to x, y."""
    import warnings

    from scipy import linalg

    mx, my = x.mean(0), y.mean(0)
    cx, cy = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    with warnings.catch_warnings():  # a singular product (fewer samples than features) is fine
        warnings.simplefilter("ignore")
        root = linalg.sqrtm(cx @ cy)
    root = root.real if np.iscomplexobj(root) else root
    return float(((mx - my) ** 2).sum() + np.trace(cx + cy - 2 * root))


# ---------------------------------------------------------------------------------------------
# Copies
# ---------------------------------------------------------------------------------------------

def nearest_two(samples, train) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's Euclidean pixel distance to its nearest and second-nearest training image
    (float64; the second is inf with a single training image)."""
    import torch

    s = torch.as_tensor(samples).flatten(1).double()
    t = torch.as_tensor(train).flatten(1).double()
    d = torch.cdist(s, t)
    if d.shape[1] < 2:
        return d[:, 0].numpy(), np.full(len(s), np.inf)
    two = d.topk(2, dim=1, largest=False).values
    return two[:, 0].numpy(), two[:, 1].numpy()


def calibrated_threshold(fresh_d1: np.ndarray, q: float = CALIBRATION_QUANTILE) -> float:
    """The distance under which only a share `q` of fresh images (from the data's own
    distribution, never trained on) lie from their nearest training image."""
    return float(np.quantile(np.asarray(fresh_d1, dtype=np.float64), q))


def copies(d1: np.ndarray, d2: np.ndarray, threshold: float) -> dict:
    """Both copy criteria per sample: `ratio` (d1/d2 < 1/3) and `calibrated` (d1 < threshold)."""
    ratio = d1 / d2 < COPY_RATIO
    cal = d1 < threshold
    return {"ratio": ratio, "calibrated": cal}


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------

def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact two-sided binomial interval of k successes in n trials."""
    from scipy.stats import beta

    if n <= 0:
        return 0.0, 1.0
    a = 1 - level
    lo = 0.0 if k == 0 else float(beta.ppf(a / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - a / 2, k + 1, n - k))
    return lo, hi


def normalized_regret(q_named: float, q_oracle: float, q_first: float) -> float | None:
    """(Q(named) − Q(oracle)) / (Q(first) − Q(oracle)) for a quality where lower is better: 0 at
    the oracle, 1 at the first checkpoint; None where the first checkpoint is the oracle."""
    span = q_first - q_oracle
    if span <= 0:
        return 0.0 if q_named == q_oracle else None
    return (q_named - q_oracle) / span


def stratified_bootstrap(values: list[float], strata: list, reps: int = 10000, seed: int = 0,
                         level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lower, upper): the mean of `values` and its percentile bootstrap interval, resampling
    with replacement within each stratum (each stratum keeps its size)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(np.asarray(strata) == s) for s in dict.fromkeys(strata)]
    means = np.empty(reps)
    for r in range(reps):
        idx = np.concatenate([rng.choice(g, size=len(g), replace=True) for g in groups])
        means[r] = values[idx].mean()
    a = (1 - level) / 2
    return float(values.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))
