#!/usr/bin/env python3
"""The quality-aware early-stop benchmark on MNIST: how good is the checkpoint each rule keeps,
against the best checkpoint that does not copy, measured by instruments no rule reads?
(docs/guide/early-stop.md, "Benchmark: what the kept checkpoint is worth")

    .venv/bin/python studies/quality/benchmark.py OUT [--plan frozen|tuning|tiny]
        [--phase shared|runs|decide|all] [--lanes 2] [--only NAME,...] [--train-device cpu]

Everything is cached in OUT, per run and per checkpoint: run it again with the same arguments
and it goes on where it stopped. `nice -n 19` it beside other work.

Protocol (the PFD paper's teacher–student set-up, §3 and App. D.2):
1. shared, once: MNIST's 60 000 training digits split by a fixed seed into 10 000 for a small
   classifier (`measures.Classifier`, its test accuracy reported) and 50 000 for a teacher (the
   toy's EDM U-Net, trained by python/train_toy.py). A pool of teacher samples (EDM Heun, 18
   steps, clamped to [-1, 1]) is what every student trains on: pool[0:1000] is the students'
   held-out set, pool[1000:3000] calibrates the distance copy criterion, the data-limited runs
   draw their N images from pool[3000:8000], the data-rich ones take pool[8000:8000+N].
2. per run: the student (same trainer, batch 64, EMA 0.995, both weights in each checkpoint)
   on N teacher samples; `diffmon watch` (the frozen binary) evaluates every checkpoint with the
   held-out set and the teacher (`pfd.teacher`: E_gen), once with ICR's default augmentations
   and once without the flip (`ema-noflip`); the study's truth on the EMA weights at every
   checkpoint: 1024 samples from latents no rule sees, their copies under two criteria, KID and
   the Fréchet distance in the classifier's features against MNIST's 10 000 test digits, E_gen
   of the study's own (the RMS pixel distance to the teacher's flow on the same latents), and
   the held-out denoising loss of both weights at one fixed noise draw. A data-limited run is
   trained on (in steps of a quarter of its plan, up to its cap) until its copy share under the
   calibrated criterion has reached 5% and `EXTRA` checkpoints have followed.
3. decide (studies/quality/rules.py): each rule's named checkpoint, its quality and normalized
   regret against the oracle, its copy share with a Clopper–Pearson interval; the statistics;
   OUT/benchmark.json, OUT/table.md and a figure per N.

Freezing: the first start writes OUT/frozen.json (the commit, the SHA-256 of the files that
produce data and a copy of the diffmon binary in OUT/shared). A later start whose files differ
stops with the difference named: the frozen runs are trained and evaluated by the frozen code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "python"))
import measures  # noqa: E402

PY = sys.executable
SPLIT_SEED, POOL_SEED, TRUTH_SEED, LOSS_SEED = 20261203, 20261204, 20261205, 20261206
ONSET = 0.05
EXTRA = 3  # checkpoints trained past the calibrated onset
POOL_CHUNK = 1000
HELDOUT, CALIBRATION, LIMITED, RICH = (0, 1000), (1000, 3000), (3000, 8000), 8000
FROZEN_FILES = ("studies/quality/benchmark.py", "studies/quality/measures.py", "python/train_toy.py")

# Per plan: the shared models' settings and the runs (name, N, seed, steps, cap, checkpoint every).
PLANS = {
    "frozen": {
        "teacher_steps": 6000, "classifier_epochs": 3, "truth_samples": 1024, "width": 32,
        "icr_samples": 1024, "pfd_samples": 128, "classifier_digits": 10000,
        "sizes": [(16, 1200, 3000, 100), (32, 1800, 4000, 100), (64, 3000, 6000, 200),
                  (128, 5000, 10000, 200)],
        "seeds": [101, 102, 103, 104, 105],
        "large": [(256, 9000, 16000, 400, [101, 102, 103])],
        "rich": [(20000, 8000, 16000, 500, [101, 102, 103, 104, 105, 106])],
    },
    "tuning": {
        "sizes": [(16, 1200, 3000, 100), (32, 1800, 4000, 100), (64, 3000, 6000, 200)],
        "seeds": [901, 902], "large": [], "rich": [],
    },
    "tiny": {  # the test's: everything small, every phase and rule exercised
        "teacher_steps": 30, "classifier_epochs": 1, "truth_samples": 80, "width": 4,
        "icr_samples": 32, "pfd_samples": 16, "classifier_digits": 600, "teacher_digits": 600,
        "pool": 200, "pool_chunk": 100, "heldout": 40, "calibration": 60, "heun_steps": 4,
        "test_digits": 500,
        "sizes": [(8, 40, 60, 10)], "seeds": [1], "large": [], "rich": [(48, 30, 30, 10, [1])],
    },
}
ARGS: argparse.Namespace


def plan_settings(plan: str) -> dict:
    base = dict(PLANS["frozen"])
    base.update(PLANS[plan])
    return base


def runs(cfg: dict) -> list[dict]:
    """Every run of the plan, in the order they are trained: each seed across the data-limited
    sizes, then the large size, then the data-rich runs (the budget's order of priority)."""
    out = []
    for seed in cfg["seeds"]:
        for n, steps, cap, every in cfg["sizes"]:
            out.append({"name": f"n{n}-s{seed}", "n": n, "seed": seed, "steps": steps, "cap": cap,
                        "every": every, "limited": True})
    for n, steps, cap, every, seeds in cfg["large"]:
        out += [{"name": f"n{n}-s{s}", "n": n, "seed": s, "steps": steps, "cap": cap, "every": every,
                 "limited": True} for s in seeds]
    for n, steps, cap, every, seeds in cfg["rich"]:
        out += [{"name": f"rich{n}-s{s}", "n": n, "seed": s, "steps": steps, "cap": cap,
                 "every": every, "limited": False} for s in seeds]
    return out


def atomic_json(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def write_h5(path: Path, images) -> None:
    import h5py

    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as f:
        f.create_dataset("images", data=np.asarray(images, dtype=np.float32))
    os.replace(tmp, path)


def read_h5(path: Path, key: str = "images"):
    import h5py
    import torch

    with h5py.File(path, "r") as f:
        return torch.from_numpy(np.asarray(f[key][()], dtype=np.float32))


# ---------------------------------------------------------------------------------------------
# Freezing
# ---------------------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def freeze(out: Path, plan: str) -> Path:
    """OUT/frozen.json on the first start; afterwards, a check that the files producing data
    are the frozen ones. Returns the diffmon binary the runs use (the frozen copy)."""
    path = out / "frozen.json"
    files = {f: sha256(ROOT / f) for f in FROZEN_FILES}
    frozen_bin = out / "shared" / "diffmon-frozen"
    if not path.exists():
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", *FROZEN_FILES],
                               capture_output=True, text=True).stdout.strip()
        if plan != "tiny" and (commit is None or dirty):
            raise SystemExit(f"benchmark: commit the study's files before freezing ({dirty or 'no git'})")
        (out / "shared").mkdir(parents=True, exist_ok=True)
        shutil.copy2(ARGS.bin, frozen_bin)
        atomic_json(path, {"frozen_commit": commit, "plan": plan, "files": files,
                           "diffmon_sha256": sha256(frozen_bin), "settings": plan_settings(plan),
                           "frozen_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        return frozen_bin
    frozen = json.loads(path.read_text())
    changed = [f for f in FROZEN_FILES if frozen["files"].get(f) != files[f]]
    if changed and ARGS.phase != "decide":
        raise SystemExit(f"benchmark: {', '.join(changed)} differ from the frozen commit "
                         f"{frozen['frozen_commit']} ({path}); train and evaluate from a checkout of it "
                         "(`git worktree add DIR COMMIT`), or decide only (`--phase decide`)")
    if frozen["plan"] != plan and (frozen["plan"], plan) != ("frozen", "tuning"):
        raise SystemExit(f"benchmark: {out} holds the plan {frozen['plan']!r}, not {plan!r}")
    return frozen_bin


# ---------------------------------------------------------------------------------------------
# 1. shared: classifier, teacher, pool, the teacher's flow on the study's latents
# ---------------------------------------------------------------------------------------------

def mnist_split(cfg: dict):
    """(classifier digits, their labels, teacher digits) from MNIST's training split."""
    import train_toy
    from mnist import ROWS

    perm = np.random.default_rng(SPLIT_SEED).permutation(ROWS["train"])
    k = cfg["classifier_digits"]
    cls_idx = np.sort(perm[:k])
    teach_idx = np.sort(perm[k:k + cfg["teacher_digits"]] if "teacher_digits" in cfg else perm[k:])
    cls, labels = train_toy.mnist_images("train", cls_idx)
    teacher, _ = train_toy.mnist_images("train", teach_idx)
    return cls, labels, teacher


def shared_classifier(shared: Path, cfg: dict) -> None:
    import torch
    import train_toy

    path = shared / "classifier.pt"
    if path.exists():
        return
    t0 = time.perf_counter()
    cls, labels, _ = mnist_split(cfg)
    net = measures.train_classifier(cls, labels, epochs=cfg["classifier_epochs"], seed=SPLIT_SEED)
    test, test_labels = train_toy.mnist_images("test", np.arange(cfg.get("test_digits", 10000)))
    acc = measures.accuracy(net, test, test_labels)
    np.save(shared / "test-features.npy", measures.features(net, test))
    atomic_json(shared / "classifier.json", {"test_accuracy": acc, "train_digits": len(cls),
                                             "epochs": cfg["classifier_epochs"],
                                             "seconds": time.perf_counter() - t0})
    tmp = shared / ".classifier.pt.tmp"
    torch.save(net.state_dict(), tmp)
    os.replace(tmp, path)


def load_classifier(shared: Path):
    import torch

    net = measures.classifier_class()()
    net.load_state_dict(torch.load(shared / "classifier.pt", map_location="cpu", weights_only=True))
    return net.eval()


def shared_teacher(shared: Path, cfg: dict) -> None:
    """The teacher trained on the 50 000 teacher digits, exported (EMA weights) as teacher.ts."""
    import torch
    import train_toy
    from diffmon.export import export

    if (shared / "teacher.ts").exists():
        return
    data = shared / "teacher-digits.h5"
    if not data.exists():
        write_h5(data, mnist_split(cfg)[2].numpy())
    run = shared / "teacher"
    steps = cfg["teacher_steps"]
    with open(shared / "teacher.log", "a") as log:
        subprocess.run([PY, str(ROOT / "python" / "train_toy.py"), "--dataset", "file",
                        "--train-file", str(data), "--train-size", str(len(read_h5(data))),
                        "--run-dir", str(run), "--steps", str(steps), "--ckpt-every", str(max(1, steps // 6)),
                        "--batch-size", "64", "--ema", "0.999", "--width", str(cfg["width"]),
                        "--seed", str(SPLIT_SEED % 1000), "--threads", "1", "--format", "ema_dict",
                        "--device", ARGS.train_device, "--resumable"],
                       check=True, stdout=log, stderr=subprocess.STDOUT)
    net = train_toy.ToyDenoiser(1, cfg["width"])
    net.load_state_dict(torch.load(run / f"ckpt_{steps:06d}.pt", map_location="cpu",
                                   weights_only=True)["ema"])
    export(net.eval(), train_toy.FEATURE_LAYER, shared / "teacher.ts", example_shape=(1, 1, 28, 28))


def load_teacher(shared: Path):
    import torch

    ts = torch.jit.load(str(shared / "teacher.ts"), map_location="cpu").eval()
    return lambda x, s: ts(x, s)[0]


def pool_chunk(shared: Path, k: int, cfg: dict):
    """Chunk k of the teacher's samples (POOL_CHUNK of them, latents seeded by (POOL_SEED, k))."""
    import torch

    path = shared / "pool" / f"chunk-{k:03d}.h5"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        size = cfg.get("pool_chunk", POOL_CHUNK)
        z = torch.randn((size, 1, 28, 28), generator=torch.Generator().manual_seed(POOL_SEED + k))
        x = measures.heun_sample(load_teacher(shared), z, steps=cfg.get("heun_steps", measures.HEUN_STEPS))
        write_h5(path, x.clamp(-1, 1).numpy())
    return read_h5(path)


def pool(shared: Path, cfg: dict, start: int, stop: int):
    """pool[start:stop] (the chunks it needs are sampled once and cached)."""
    import torch

    size = cfg.get("pool_chunk", POOL_CHUNK)
    parts = [pool_chunk(shared, k, cfg) for k in range(start // size, (stop - 1) // size + 1)]
    return torch.cat(parts)[start - (start // size) * size:][:stop - start]


def layout(cfg: dict) -> dict:
    """The pool's parts: held-out, calibration, data-limited candidates, data-rich start."""
    if cfg.get("pool"):  # tiny
        h, c = cfg["heldout"], cfg["calibration"]
        return {"heldout": (0, h), "calibration": (h, h + c), "limited": (h + c, cfg["pool"]),
                "rich": h + c}
    return {"heldout": HELDOUT, "calibration": CALIBRATION, "limited": LIMITED, "rich": RICH}


def truth_latents(cfg: dict):
    import torch

    return torch.randn((cfg["truth_samples"], 1, 28, 28), generator=torch.Generator().manual_seed(TRUTH_SEED))


def shared_teacher_flow(shared: Path, cfg: dict):
    """The teacher's flow on the study's truth latents, and the teacher's own KID (the floor)."""
    import torch

    path = shared / "teacher-flow.pt"
    if not path.exists():
        flow = measures.heun_sample(load_teacher(shared), truth_latents(cfg),
                                    steps=cfg.get("heun_steps", measures.HEUN_STEPS))
        ref = measures.KidReference(np.load(shared / "test-features.npy"))
        feats = measures.features(load_classifier(shared), flow.clamp(-1, 1))
        kid, se = ref.kid(feats)
        atomic_json(shared / "teacher.json", {"kid": kid, "kid_se": se,
                                              "fd": measures.frechet(feats, ref.y)})
        tmp = shared / ".teacher-flow.pt.tmp"
        torch.save(flow, tmp)
        os.replace(tmp, path)
    return torch.load(path, weights_only=True)


def shared_phase(out: Path, cfg: dict) -> None:
    shared = out / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(2) as lanes:  # the classifier beside the teacher's training
        jobs = [lanes.submit(shared_classifier, shared, cfg), lanes.submit(shared_teacher, shared, cfg)]
        for j in jobs:
            j.result()
    size = cfg.get("pool_chunk", POOL_CHUNK)
    with ThreadPoolExecutor(ARGS.lanes) as lanes:  # the chunks side by side, one thread each
        list(lanes.map(lambda k: pool_chunk(shared, k, cfg), range(-(-layout(cfg)["limited"][1] // size))))
    shared_teacher_flow(shared, cfg)


# ---------------------------------------------------------------------------------------------
# 2. per run: data, training, diffmon, truth
# ---------------------------------------------------------------------------------------------

VARIANTS = {"ema": {"weights_key": "ema", "flip": True}, "ema-noflip": {"weights_key": "ema", "flip": False}}


def run_data(out: Path, run: dict, cfg: dict) -> None:
    d = out / "runs" / run["name"]
    d.mkdir(parents=True, exist_ok=True)
    if (d / "data-train.h5").exists():
        return
    shared, lay = out / "shared", layout(cfg)
    if run["limited"]:
        lo, hi = lay["limited"]
        pick = np.sort(np.random.default_rng([run["n"], run["seed"]]).choice(hi - lo, run["n"], replace=False))
        train = pool(shared, cfg, lo, hi)[pick]
    else:
        train = pool(shared, cfg, lay["rich"], lay["rich"] + run["n"])
    write_h5(d / "data-heldout.h5", pool(shared, cfg, *lay["heldout"]).numpy())
    write_h5(d / "data-train.h5", train.numpy())


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    return sorted((int(p.stem.split("_")[1]), p) for p in run_dir.glob("ckpt_*.pt"))


def train(out: Path, run: dict, steps: int, cfg: dict) -> None:
    d = out / "runs" / run["name"]
    if (d / f"ckpt_{steps:06d}.pt").exists():
        return
    with open(d / "train.log", "a") as log:
        subprocess.run([PY, str(ROOT / "python" / "train_toy.py"), "--dataset", "file",
                        "--train-file", str(d / "data-train.h5"), "--train-size", str(run["n"]),
                        "--heldout-file", str(d / "data-heldout.h5"), "--run-dir", str(d),
                        "--steps", str(steps), "--ckpt-every", str(run["every"]), "--batch-size", "64",
                        "--ema", "0.995", "--width", str(cfg["width"]), "--seed", str(run["seed"]),
                        "--threads", "1", "--format", "ema_dict", "--device", ARGS.train_device,
                        "--resumable", "--stop-file", "NEVER_STOP"],
                       check=True, stdout=log, stderr=subprocess.STDOUT)


def config(out: Path, run_dir: Path, variant: str, heldout: bool, cfg: dict) -> Path:
    """The daemon's config of one variant; without `heldout`, the same minus the held-out set
    (what a user without one has: the rules replay it)."""
    v = VARIANTS[variant]
    path = run_dir / f"diffmon-{variant}{'' if heldout else '-noheldout'}.yaml"
    data = f"data: {{path: {run_dir / 'train.h5'}"
    data += f", heldout_path: {run_dir / 'heldout.h5'}}}\n" if heldout else "}\n"
    flip = "" if v["flip"] else ", augment: {flip: false}"
    path.write_text(
        f"run: {{dir: {run_dir}, name: {run_dir.name}-{variant}}}\n"
        f"state_dir: {run_dir / ('state-' + variant)}\n"
        f"model: {{architecture: {run_dir / 'model.ts'}}}\ndevice: cpu\ncpu_threads: 1\n"
        f"{data}icr: {{samples: {cfg['icr_samples']}{flip}}}\n"
        f"pfd: {{enabled: true, teacher: {out / 'shared' / 'teacher.ts'}, samples: {cfg['pfd_samples']}, "
        f"batch_size: {cfg['pfd_samples']}}}\n"
        "memorization: {enabled: true}\n"
        f"checkpoints: {{pattern: 'ckpt_*.pt', weights_key: {v['weights_key']}}}\n"
        f"alerts: {{stop_file: EARLY_STOP_{variant}}}\nhttp: {{listen: '127.0.0.1:0'}}\n")
    return path


def journal(run_dir: Path, variant: str) -> Path:
    return run_dir / f"state-{variant}" / "history.jsonl"


def records(run_dir: Path, variant: str) -> list[dict]:
    j = journal(run_dir, variant)
    if not j.exists():
        return []
    out = [e["record"] for e in map(json.loads, j.read_text().splitlines()) if e["kind"] == "evaluation"]
    return sorted(out, key=lambda r: r["step"])


def evaluate(out: Path, run_dir: Path, variant: str, binary: Path, cfg: dict) -> None:
    """Every checkpoint evaluated once by `diffmon watch` (cached in its state folder)."""
    n = len(checkpoints(run_dir))
    if len(records(run_dir, variant)) >= n:
        return
    conf = config(out, run_dir, variant, True, cfg)
    with open(run_dir / f"watch-{variant}.log", "a") as log:
        p = subprocess.Popen([str(binary), "watch", "--config", str(conf)], stdout=log, stderr=log,
                             env={**os.environ, "DIFFMON_LOG": "info"})
        try:
            while len(records(run_dir, variant)) < n:
                if p.poll() is not None:
                    raise RuntimeError(f"diffmon watch stopped (status {p.returncode}); see {log.name}")
                time.sleep(1)
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=300)


def heldout_draw(held):
    """The one fixed noise draw of the held-out loss: EDM's training sigmas and noise."""
    import torch

    g = torch.Generator().manual_seed(LOSS_SEED)
    return torch.exp(-1.2 + 1.2 * torch.randn(len(held), generator=g)), torch.randn(held.shape, generator=g)


def heldout_loss(net, held, sigma, noise) -> float:
    """The EDM-weighted denoising loss over the held-out images at fixed sigmas and noise."""
    import torch

    sd, losses = 0.5, []
    with torch.no_grad():
        for i in range(0, len(held), 250):
            x0, s, n = held[i:i + 250], sigma[i:i + 250], noise[i:i + 250]
            d = net(x0 + s.reshape(-1, 1, 1, 1) * n, s)
            w = (s ** 2 + sd ** 2) / (s * sd) ** 2
            losses.append((w.reshape(-1, 1, 1, 1) * (d - x0) ** 2).double().flatten(1).mean(1))
    return float(torch.cat(losses).mean()) if losses else float("nan")


def calibration(out: Path, run_dir: Path, cfg: dict) -> dict:
    """The distance copy criterion's threshold for this run's training set: the 0.5% quantile
    of fresh teacher samples' nearest-training-image distances."""
    path = run_dir / "calibration.json"
    if not path.exists():
        fresh = pool(out / "shared", cfg, *layout(cfg)["calibration"])
        d1, d2 = measures.nearest_two(fresh, read_h5(run_dir / "train.h5"))
        atomic_json(path, {"threshold": measures.calibrated_threshold(d1), "fresh": len(fresh),
                           "quantile": measures.CALIBRATION_QUANTILE,
                           "fresh_ratio_copies": int((d1 / d2 < measures.COPY_RATIO).sum()),
                           "fresh_d1_median": float(np.median(d1))})
    return json.loads(path.read_text())


def truth(out: Path, run_dir: Path, cfg: dict) -> None:
    """Per checkpoint, in OUT/runs/<run>/truth.json: the EMA weights' samples from the study's
    latents, their copies (both criteria), KID (+ its error) and the Fréchet distance, E_gen (the
    study's), and both weights' held-out loss."""
    import torch
    import train_toy

    torch.set_num_threads(1)
    path = run_dir / "truth.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    todo = [(s, c) for s, c in checkpoints(run_dir) if str(s) not in done]
    if not todo:
        return
    shared = out / "shared"
    train_x, held = read_h5(run_dir / "train.h5"), read_h5(run_dir / "heldout.h5")
    threshold = calibration(out, run_dir, cfg)["threshold"]
    sigma, noise = heldout_draw(held)
    latents, teacher_flow = truth_latents(cfg), shared_teacher_flow(shared, cfg)
    classifier = load_classifier(shared)
    ref = measures.KidReference(np.load(shared / "test-features.npy"))
    net = train_toy.ToyDenoiser(1, cfg["width"]).eval()
    for step, ckpt in todo:
        t0 = time.perf_counter()
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        entry = {"heldout_loss": {}}
        for variant in ("model", "ema"):  # the EMA weights last: they are sampled
            net.load_state_dict(state[variant])
            entry["heldout_loss"]["raw" if variant == "model" else "ema"] = heldout_loss(net, held, sigma, noise)
        flow = measures.heun_sample(net, latents, steps=cfg.get("heun_steps", measures.HEUN_STEPS))
        d1, d2 = measures.nearest_two(flow, train_x)
        c = measures.copies(d1, d2, threshold)
        feats = measures.features(classifier, flow.clamp(-1, 1))
        kid, kid_se = ref.kid(feats)
        entry.update({"samples": len(flow), "copies_calibrated": int(c["calibrated"].sum()),
                      "copies_ratio": int(c["ratio"].sum()), "copies_both": int((c["ratio"] & c["calibrated"]).sum()),
                      "kid": kid, "kid_se": kid_se, "fd": measures.frechet(feats, ref.y),
                      "egen": float(((flow.double() - teacher_flow.double()) ** 2).flatten(1).sum(1).mean().sqrt()),
                      "d1_median": float(np.median(d1)), "seconds": time.perf_counter() - t0})
        done[str(step)] = entry
        atomic_json(path, done)


def onset(run_dir: Path, criterion: str = "calibrated") -> int | None:
    """The first checkpoint whose copy share under `criterion` is at least 5%."""
    tt = json.loads((run_dir / "truth.json").read_text()) if (run_dir / "truth.json").exists() else {}
    return next((int(s) for s, e in sorted(tt.items(), key=lambda kv: int(kv[0]))
                 if e[f"copies_{criterion}"] >= ONSET * e["samples"]), None)


def trained_enough(run_dir: Path, run: dict) -> bool:
    """Data-limited: the calibrated onset reached and EXTRA checkpoints past it. Data-rich: ICR's
    minimum (the default variant) has at least 10 checkpoints after it."""
    steps = [s for s, _ in checkpoints(run_dir)]
    if run["limited"]:
        first = onset(run_dir)
        return first is not None and len([s for s in steps if s > first]) >= EXTRA
    icr = [r["icr"] for r in records(run_dir, "ema")]
    return bool(icr) and len(icr) - 1 - int(np.argmin(icr)) >= 10


def run_all(out: Path, run: dict, binary: Path, cfg: dict) -> None:
    """One run's phases, extended by a quarter of its plan until it has trained enough."""
    d = out / "runs" / run["name"]
    run_data(out, run, cfg)
    steps = run["steps"]
    while True:
        train(out, run, steps, cfg)
        for v in VARIANTS:
            evaluate(out, d, v, binary, cfg)
        truth(out, d, cfg)
        last = checkpoints(d)[-1][0]
        if trained_enough(d, run) or last >= run["cap"]:
            atomic_json(d / "done.json", {"steps": last, "trained_enough": trained_enough(d, run)})
            return
        steps = min(run["cap"], last + max(run["every"], run["steps"] // 4))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--plan", default="frozen", choices=tuple(PLANS))
    ap.add_argument("--phase", default="all", choices=("shared", "runs", "decide", "all"))
    ap.add_argument("--lanes", type=int, default=2, help="runs side by side, one thread each")
    ap.add_argument("--only", default=None, help="comma-separated run names (default: the whole plan)")
    ap.add_argument("--train-device", default="cpu")
    ap.add_argument("--bin", type=Path, default=ROOT / "target" / "release" / "diffmon",
                    help="the diffmon binary frozen on the first start (later starts use the copy)")
    global ARGS
    ARGS = args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # each lane one thread: the lanes are the parallelism
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = plan_settings(args.plan)
    binary = freeze(args.out, args.plan)
    plan = runs(cfg)
    if args.only:
        wanted = set(args.only.split(","))
        plan = [r for r in plan if r["name"] in wanted]
    t0 = time.perf_counter()
    if args.phase in ("shared", "all", "runs"):
        shared_phase(args.out, cfg)
    if args.phase in ("runs", "all"):
        with ThreadPoolExecutor(args.lanes) as pool_:
            list(pool_.map(lambda r: run_all(args.out, r, binary, cfg), plan))
    if args.phase in ("decide", "all"):
        import rules

        rules.decide_all(args.out, plan, cfg, binary)
    print(f"benchmark: {args.phase} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
