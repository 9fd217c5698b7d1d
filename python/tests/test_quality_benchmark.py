"""The quality benchmark (studies/quality/): its instruments against straightforward references
on fixed arrays, its statistics against hand-computed cases, and the study end to end on a tiny
grid with every column checked for consistency."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "diffmon"
sys.path.insert(0, str(ROOT / "studies" / "quality"))

import measures  # noqa: E402
import rules  # noqa: E402


def kid_reference(x, y):
    """The unbiased MMD^2 with k(a, b) = (a.b/d + 1)^3, pair by pair."""
    d = x.shape[1]
    k = lambda a, b: (float(np.dot(a, b)) / d + 1.0) ** 3  # noqa: E731
    m, n = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    yy = sum(k(y[i], y[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    xy = sum(k(x[i], y[j]) for i in range(m) for j in range(n)) / (m * n)
    return xx + yy - 2 * xy


def test_kid_matches_the_pairwise_definition():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(17, 5)), rng.normal(0.3, 1.2, size=(23, 5))
    ref = measures.KidReference(y)
    # Sums of a few hundred terms of size ~1 in float64: agreement to 1e-12 relative.
    assert ref.mmd2(x) == pytest.approx(kid_reference(x, y), rel=1e-12, abs=1e-12)
    # Chunking (rows 2048 at a time) changes nothing: a chunk smaller than the set.
    assert measures._kernel_sum(x, y, chunk=4) == pytest.approx(measures._kernel_sum(x, y), rel=1e-13)
    kid, se = ref.kid(x, blocks=4)
    assert kid == pytest.approx(kid_reference(x, y), rel=1e-12)
    blocks = [kid_reference(b, y) for b in np.array_split(x, 4)]
    assert se == pytest.approx(np.std(blocks, ddof=1) / 2, rel=1e-9)
    # Unbiased: two samples of one distribution average to about 0, a shifted one is positive.
    same = [measures.KidReference(rng.normal(size=(60, 4))).mmd2(rng.normal(size=(60, 4))) for _ in range(40)]
    assert abs(np.mean(same)) < 3 * np.std(same) / math.sqrt(40)
    assert measures.KidReference(rng.normal(size=(60, 4))).mmd2(rng.normal(1.0, 1, size=(60, 4))) > 0.1


def test_frechet_matches_the_closed_form_of_diagonal_gaussians():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4000, 3)) * np.array([1.0, 2.0, 0.5])
    y = rng.normal(size=(4000, 3)) * np.array([1.5, 1.0, 0.5]) + np.array([1.0, 0.0, -1.0])
    cx, cy = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    # Reference: the symmetric form Tr(cx + cy - 2 (cx^1/2 cy cx^1/2)^1/2) by eigendecomposition.
    w, v = np.linalg.eigh(cx)
    r = v @ np.diag(np.sqrt(w)) @ v.T
    w2, _ = np.linalg.eigh(r @ cy @ r)
    expect = ((x.mean(0) - y.mean(0)) ** 2).sum() + np.trace(cx + cy) - 2 * np.sqrt(np.clip(w2, 0, None)).sum()
    assert measures.frechet(x, y) == pytest.approx(expect, rel=1e-8)


def numpy_features(net, x):
    """The classifier's penultimate layer in numpy: correlation with zero padding, ReLU, 2x2
    max-pooling, the linear layer and ReLU."""
    def conv(h, w, b):
        n, cin, hh, ww = h.shape
        p = np.pad(h, ((0, 0), (0, 0), (1, 1), (1, 1)))
        out = np.zeros((n, w.shape[0], hh, ww))
        for dy in range(3):
            for dx in range(3):
                out += np.einsum("nchw,oc->nohw", p[:, :, dy:dy + hh, dx:dx + ww], w[:, :, dy, dx])
        return out + b[None, :, None, None]

    def pool(h):
        n, c, hh, ww = h.shape
        return h.reshape(n, c, hh // 2, 2, ww // 2, 2).max(axis=(3, 5))

    sd = {k: v.double().numpy() for k, v in net.state_dict().items()}
    h = pool(np.maximum(conv(x, sd["conv1.weight"], sd["conv1.bias"]), 0))
    h = pool(np.maximum(conv(h, sd["conv2.weight"], sd["conv2.bias"]), 0))
    return np.maximum(h.reshape(len(x), -1) @ sd["fc1.weight"].T + sd["fc1.bias"], 0)


def test_classifier_features_match_a_numpy_reference():
    torch.manual_seed(0)
    net = measures.classifier_class()().eval()
    x = torch.rand(3, 1, 28, 28) * 2 - 1
    got = measures.features(net, x)
    assert got.shape == (3, measures.FEATURES)
    # float32 convolutions against float64 numpy: sums of ~300 products of size ~0.1.
    np.testing.assert_allclose(got, numpy_features(net, x.double().numpy()), rtol=1e-4, atol=1e-5)
    # The logits are the last layer over those features.
    logits = net(x).detach().double().numpy()
    sd = net.state_dict()
    np.testing.assert_allclose(logits, got @ sd["fc2.weight"].double().numpy().T + sd["fc2.bias"].double().numpy(),
                               rtol=1e-4, atol=1e-5)


def test_copy_criteria_on_hand_made_images():
    train = torch.zeros(3, 1, 2, 2)
    train[1] += 1.0
    train[2] -= 1.0
    samples = torch.stack([train[1] + 0.1, torch.full((1, 2, 2), 0.5), train[2] - 0.6])
    d1, d2 = measures.nearest_two(samples, train)
    # Pixel distances by hand (4 pixels each), to the float32 rounding of the images (1e-7).
    np.testing.assert_allclose(d1, [0.2, 1.0, 1.2], rtol=1e-6)
    np.testing.assert_allclose(d2, [2.2, 1.0, 3.2], rtol=1e-6)
    c = measures.copies(d1, d2, threshold=0.5)
    assert c["ratio"].tolist() == [True, False, False]  # 0.2/2.2 < 1/3; 1/1 and 1.2/3.2 = 0.375 are not
    assert c["calibrated"].tolist() == [True, False, False]
    assert measures.calibrated_threshold(np.arange(1001.0), q=0.005) == pytest.approx(5.0)


def test_clopper_pearson_and_regret_by_hand():
    # k = 0 or n: the one-sided tails are closed forms, 1 - 0.025^(1/n) and 0.025^(1/n).
    lo, hi = measures.clopper_pearson(0, 10)
    assert lo == 0 and hi == pytest.approx(1 - 0.025 ** 0.1, rel=1e-10)
    lo, hi = measures.clopper_pearson(9, 9)
    assert hi == 1 and lo == pytest.approx(0.025 ** (1 / 9), rel=1e-10)  # "9 of 9 is [0.66, 1]"
    assert round(lo, 2) == 0.66
    lo, hi = measures.clopper_pearson(51, 1024)  # about 5%: the 3.8-6.5 %
    assert (round(lo, 3), round(hi, 3)) == (0.037, 0.065)
    assert measures.normalized_regret(0.5, 0.5, 2.0) == 0
    assert measures.normalized_regret(2.0, 0.5, 2.0) == 1
    assert measures.normalized_regret(0.8, 0.5, 2.0) == pytest.approx(0.2)
    assert measures.normalized_regret(0.4, 0.5, 2.0) == pytest.approx(-1 / 15)  # an unsafe pick can beat it
    assert measures.normalized_regret(0.7, 0.5, 0.5) is None  # the first checkpoint is the oracle
    assert measures.normalized_regret(0.5, 0.5, 0.5) == 0


def test_stratified_bootstrap_keeps_each_stratum_whole():
    # Stratum a: three zeros, b: one 1: every resample's mean is exactly 1/4.
    mean, lo, hi = measures.stratified_bootstrap([0, 0, 0, 1], ["a", "a", "a", "b"], reps=200)
    assert mean == lo == hi == 0.25
    mean, lo, hi = measures.stratified_bootstrap([0, 1, 0, 1], ["a"] * 4, reps=2000)
    assert mean == 0.5 and lo < 0.5 < hi and lo >= 0 and hi <= 1


def test_the_rules_by_hand():
    steps = [10, 20, 30, 40, 50, 60]
    assert rules.patience_rule(steps, [5, 4, 3, 3.5, 2.9, 3.1], 2) == (50, None)
    assert rules.patience_rule(steps, [5, 4, 3, 3.5, 3.2, 1.0], 2) == (30, 50)
    assert rules.patience_rule(steps, [5, 4, 3, 3.5, 3.2, 1.0], 1) == (30, 40)
    assert rules.ratio_rule(steps, [0, None, 0.01, 0.06, 0.2, 0.3], 1) == (30, 40)
    assert rules.ratio_rule(steps, [0, None, 0.01, 0.06, 0.2, 0.3], 2) == (20, 40)
    assert rules.ratio_rule(steps, [0.1, 0, 0, 0, 0, 0], 2) == (10, 10)
    assert rules.ratio_rule(steps, [0] * 6, 1) == (60, None)


@pytest.mark.study
@pytest.mark.skipif(not BIN.exists(), reason="needs the release build (make setup)")
def test_benchmark_tiny_plan_end_to_end(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "studies" / "quality" / "benchmark.py"), str(out), "--plan", "tiny",
           "--bin", str(BIN)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((out / "benchmark.json").read_text())
    frozen = json.loads((out / "frozen.json").read_text())
    assert result["frozen_commit"] == frozen["frozen_commit"] and result["quality"] == "kid"
    assert 0 <= result["classifier"]["test_accuracy"] <= 1
    assert {r["run"] for r in result["runs"]} == {"n8-s1", "rich48-s1"}
    for r in result["runs"]:
        tt = json.loads((out / "runs" / r["run"] / "truth.json").read_text())
        steps = sorted(int(s) for s in tt)
        assert steps == list(range(10, r["steps"] + 1, 10)) and r["steps"] >= 30
        assert all(e["samples"] == 80 and 0 <= e["copies_both"] <= min(e["copies_ratio"], e["copies_calibrated"])
                   for e in tt.values())
        assert set(r["rules"]) >= set(rules.RULES) - {"oracle"}
        oracle = r["oracle"]["step"]
        safe = [s for s in steps if measures.clopper_pearson(tt[str(s)]["copies_calibrated"], 80)[1] < 0.05]
        assert oracle == (min(safe, key=lambda s: tt[str(s)]["kid"]) if safe else None)
        for name, x in r["rules"].items():
            e = tt[str(x["best_step"])]
            assert x["quality"] == e["kid"] and x["egen"] == e["egen"]
            assert x["copy_share"] == e["copies_calibrated"] / 80
            assert x["copy_lower95"] <= x["copy_share"] <= x["copy_upper95"]
            if x["fired"]:
                assert x["fired_at"] in steps and x["fired_at"] >= x["best_step"]
            if oracle is not None and x["regret"] is not None:
                q0, qo = tt[str(steps[0])]["kid"], tt[str(oracle)]["kid"]
                assert x["regret"] == pytest.approx((x["quality"] - qo) / (q0 - qo))
        assert r["rules"]["first"]["best_step"] == steps[0] and r["rules"]["last"]["best_step"] == steps[-1]
        if oracle is not None:
            assert r["rules"]["oracle"]["regret"] == 0
        rec = rules.bm.records(out / "runs" / r["run"], "ema-noflip")
        assert [x["step"] for x in rec] == steps  # diffmon evaluated every checkpoint once per variant
    s = result["summary"]
    assert set(s["rules"]) == set(rules.RULES)
    assert s["runs"] == {"data_limited": sum(r["data_limited"] and r["oracle"]["step"] is not None
                                             for r in result["runs"]), "data_rich": 1}
    assert (out / "table.md").read_text().startswith("Data-limited runs:")
    # The freeze: a file that produces data changed since is refused, naming it and the commit.
    frozen["files"]["studies/quality/measures.py"] = "0" * 64
    (out / "frozen.json").write_text(json.dumps(frozen))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and "studies/quality/measures.py differ from the frozen commit" in again.stderr
