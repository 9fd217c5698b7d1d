#!/usr/bin/env python3
"""The lead-time study on real images: how early does each early-stop rule name a checkpoint
from before the model starts copying its training images, on MNIST at its own 28x28?
(docs/guide/early-stop.md, "Real images: the MNIST lead-time study")

    .venv/bin/python scripts/mnist_study.py OUT_DIR [--sizes 16:1200,32:1800,64:3000,rich]
        [--seeds 0,1,2] [--steps 3000] [--rich-size 20000] [--rich-steps 1000] [--ckpt-every 100]
        [--width 32] [--icr-samples 1024] [--mem-samples 64] [--truth-samples 256]
        [--truth-every 2] [--weights ema,raw] [--pattern 'ckpt_*.pt']
        [--lanes 2] [--phase train|evaluate|truth|decide|all] [--train-device cpu|cuda]
        [--bin DIFFMON]

Each phase is cached in OUT_DIR, per run and per checkpoint, so an interrupted study goes on where
it stopped (run it again with the same arguments):
1. train: the project's trainer (`python/train_toy.py --dataset mnist`: the EDM U-Net of the toy,
   batch 64, EMA 0.995, a checkpoint every `--ckpt-every` steps holding both the EMA and the raw
   weights) on N MNIST training digits per seed, with 1000 held-out digits from MNIST's test split;
   `--resumable`, so an interrupted run, or one extended by a larger `--steps`, goes on from its
   last checkpoint exactly as an uninterrupted run would;
2. evaluate: `diffmon watch` evaluates every checkpoint once per weights variant, with the
   held-out set configured, so each record has ICR, the generalization gap and diffmon's
   memorization ratio (`--mem-samples` PF-ODE latents);
3. truth: ground truth independent of diffmon, computed here: `--truth-samples` samples of the EMA
   weights from the EDM Heun sampler written below (18 steps, fixed latents) on every
   `--truth-every`-th checkpoint, each a copy when its nearest training image is 3x closer than
   the second nearest (Bonnaire et al.'s rule, pixel space); and, for each variant, the held-out
   denoising loss at fixed noise (the 1000 held-out digits, one fixed EDM-distributed sigma and
   noise draw each) for the practitioner's baseline;
4. decide: per run, variant and rule, what the rule decides, against memorization onset (the
   first truth checkpoint with >= 5% copies). Rules: `heldout-loss` (the lowest held-out loss is
   the best; fires after `patience` checkpoints without a new lowest, the patience of diffmon's
   detector), `memorization-alert` (diffmon's memorization ratio >= 5%, the alert rule
   DiffmonMemorizing; its best is the checkpoint before), `icr-alone` (`diffmon replay` with
   `early_stop.confirm=none` and `early_stop.memorization_level=0`: the turn of ICR alone),
   `turn-only` (the default detector without its memorization stop,
   `early_stop.memorization_level=0`, without a held-out set), `default` (the default detector
   without a held-out set) and `default+heldout` (with one). Lead = onset - best step;
   late = fired-at - onset.

Writes OUT_DIR/study.json (every row), OUT_DIR/table.md and a figure per data-set size,
OUT_DIR/mnist-<size>.png (ICR, the gap and the copy share against the step; the default
detector's best and fired-at steps and the onset marked). Prints the table and the seconds of
training and evaluation per checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
WEIGHTS = {"ema": "ema", "raw": "model"}  # variant -> checkpoint entry (train_toy --format ema_dict)
HELDOUT = 1000
ONSET = 0.05  # the share of copies that marks memorization onset
COPY_RATIO = 1 / 3  # a copy: nearest training image 3x closer than the second nearest
RULES = ("heldout-loss", "memorization-alert", "icr-alone", "turn-only", "default",
         "default+heldout")
ARGS: argparse.Namespace  # the command line, set by main()


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------

def runs(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    """(name, training images, seed, steps) of every run of the study."""
    out = []
    for item in args.sizes.split(","):
        size, _, own_steps = item.partition(":")  # "64:3000": 64 images, 3000 steps
        n, steps = (args.rich_size, args.rich_steps) if size == "rich" else (int(size), args.steps)
        steps = int(own_steps) if own_steps else steps
        name = "rich" if size == "rich" else f"n{size}"
        out += [(f"{name}-s{seed}", n, int(seed), steps) for seed in args.seeds.split(",")]
    return out


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoints the study evaluates (`--pattern`), by step."""
    return sorted((int(p.stem.split("_")[1]), p) for p in run_dir.glob(ARGS.pattern))


# ---------------------------------------------------------------------------------------------
# 1. train
# ---------------------------------------------------------------------------------------------

def train(out: Path, name: str, size: int, seed: int, steps: int) -> None:
    run_dir = out / name
    if (run_dir / f"ckpt_{steps:06d}.pt").exists():
        return
    with open(out / f"{name}.log", "a") as log:
        subprocess.run([PY, str(ROOT / "python" / "train_toy.py"), "--dataset", "mnist",
                        "--run-dir", str(run_dir), "--train-size", str(size),
                        "--heldout-size", str(HELDOUT), "--steps", str(steps),
                        "--ckpt-every", str(ARGS.ckpt_every), "--batch-size", "64", "--ema", "0.995",
                        "--width", str(ARGS.width), "--seed", str(seed), "--threads", "1",
                        "--format", "ema_dict", "--device", ARGS.train_device, "--resumable"],
                       check=True, stdout=log, stderr=subprocess.STDOUT)


def training_seconds(log: Path) -> float | None:
    """The seconds that trained the run's checkpoints, from the trainer's log: each checkpoint's
    own time, the last line of each step (a session stopped before its end left lines that a
    resumed one trained again; a total kept per session would miss the stopped ones)."""
    if not log.exists():
        return None
    per_step = {}
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0] == "step" and parts[4].endswith("s"):
            per_step[int(parts[1])] = float(parts[4][:-1])
    return sum(per_step.values()) or None


# ---------------------------------------------------------------------------------------------
# 2. evaluate (diffmon)
# ---------------------------------------------------------------------------------------------

def config(run_dir: Path, variant: str, heldout: bool) -> Path:
    """The daemon's config for one variant; without `heldout`, the same minus the held-out set
    (what `decide` replays as a user without one)."""
    path = run_dir / f"study-{variant}{'' if heldout else '-noheldout'}.yaml"
    data = f"data: {{path: {run_dir / 'train.h5'}"
    data += f", heldout_path: {run_dir / 'heldout.h5'}}}\n" if heldout else "}\n"
    path.write_text(
        f"run: {{dir: {run_dir}, name: {run_dir.name}-{variant}}}\n"
        f"state_dir: {run_dir / ('state-' + variant)}\n"
        f"model: {{architecture: {run_dir / 'model.ts'}}}\ndevice: cpu\ncpu_threads: 1\n"
        f"{data}icr: {{samples: {ARGS.icr_samples}}}\n"
        f"pfd: {{enabled: true, samples: {ARGS.mem_samples}, batch_size: {ARGS.mem_samples}}}\n"
        "memorization: {enabled: true}\n"
        f"checkpoints: {{pattern: '{ARGS.pattern}', weights_key: {WEIGHTS[variant]}}}\n"
        f"alerts: {{stop_file: EARLY_STOP_{variant}}}\nhttp: {{listen: '127.0.0.1:0'}}\n"
    )
    return path


def journal(run_dir: Path, variant: str) -> Path:
    return run_dir / f"state-{variant}" / "history.jsonl"


def recorded(run_dir: Path, variant: str) -> int:
    j = journal(run_dir, variant)
    return len(j.read_text().splitlines()) if j.exists() else 0


def evaluate(run_dir: Path, variant: str) -> None:
    """Every checkpoint of the run evaluated once by `diffmon watch` (cached in the state folder)."""
    cfg = config(run_dir, variant, heldout=True)
    n = len(checkpoints(run_dir))
    if recorded(run_dir, variant) >= n:
        return
    with open(run_dir / f"watch-{variant}.log", "a") as log:
        p = subprocess.Popen([str(ARGS.bin), "watch", "--config", str(cfg)], stdout=log, stderr=log,
                             env={**os.environ, "DIFFMON_LOG": "info"})
        try:
            while recorded(run_dir, variant) < n:
                if p.poll() is not None:
                    raise RuntimeError(f"diffmon watch stopped (status {p.returncode}); see {log.name}")
                time.sleep(1)
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=300)


def records(run_dir: Path, variant: str) -> list[dict]:
    lines = journal(run_dir, variant).read_text().splitlines()
    out = [e["record"] for e in map(json.loads, lines) if e["kind"] == "evaluation"]
    return sorted(out, key=lambda r: r["step"])


# ---------------------------------------------------------------------------------------------
# 3. truth (independent of diffmon: the study's own sampler, copy rule and held-out loss)
# ---------------------------------------------------------------------------------------------

SIGMA_MIN, SIGMA_MAX, RHO, HEUN_STEPS = 0.002, 80.0, 7.0, 18


def heun_sample(net, latents):
    """EDM's deterministic Heun sampler (Karras et al. 2022, Algorithm 1 without churn):
    `HEUN_STEPS` steps on sigma_i = (smax^(1/rho) + i/(N-1) (smin^(1/rho) - smax^(1/rho)))^rho,
    then sigma_N = 0; the last step is Euler."""
    import torch

    i = torch.arange(HEUN_STEPS, dtype=torch.float64)
    sig = (SIGMA_MAX ** (1 / RHO) + i / (HEUN_STEPS - 1)
           * (SIGMA_MIN ** (1 / RHO) - SIGMA_MAX ** (1 / RHO))) ** RHO
    sig = torch.cat([sig, torch.zeros(1, dtype=torch.float64)])
    x = latents.double() * sig[0]
    for k in range(HEUN_STEPS):
        s, s_next = sig[k], sig[k + 1]
        d = (x - net(x.float(), s.float().expand(len(x))).double()) / s
        x_next = x + (s_next - s) * d
        if s_next > 0:
            d2 = (x_next - net(x_next.float(), s_next.float().expand(len(x))).double()) / s_next
            x_next = x + (s_next - s) * (d + d2) / 2
        x = x_next
    return x.float()


def copy_share(samples, train) -> tuple[float, list[float]]:
    """The share of samples whose nearest training image is 3x closer than the second nearest
    (pixel space, Euclidean), and each sample's ratio d1/d2."""
    import torch

    s = samples.flatten(1).double()
    t = train.flatten(1).double()
    d = torch.cdist(s, t)  # [M, N]
    if d.shape[1] < 2:
        return 1.0, [0.0] * len(s)
    two = d.topk(2, dim=1, largest=False).values
    ratio = (two[:, 0] / two[:, 1]).tolist()
    return float(np.mean([r < COPY_RATIO for r in ratio])), ratio


def heldout_loss(net, held, sigma, noise) -> float:
    """The EDM-weighted denoising loss over the held-out digits at fixed sigma and noise draws."""
    import torch

    sd = 0.5
    losses = []
    for i in range(0, len(held), 250):
        x0, s, n = held[i:i + 250], sigma[i:i + 250], noise[i:i + 250]
        d = net(x0 + s.reshape(-1, 1, 1, 1) * n, s)
        w = (s ** 2 + sd ** 2) / (s * sd) ** 2
        losses.append((w.reshape(-1, 1, 1, 1) * (d - x0) ** 2).double().flatten(1).mean(1))
    return float(torch.cat(losses).mean())


def truth(run_dir: Path) -> None:
    """Per checkpoint: the copy share of the EMA weights' samples (every `--truth-every`-th) and
    each variant's held-out loss; cached in OUT/<run>/truth.json, one entry per checkpoint."""
    import h5py
    import torch

    sys.path.insert(0, str(ROOT / "python"))
    from train_toy import ToyDenoiser

    torch.set_num_threads(1)
    path = run_dir / "truth.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    with h5py.File(run_dir / "train.h5", "r") as f:
        train_x = torch.from_numpy(f["images"][()])
    with h5py.File(run_dir / "heldout.h5", "r") as f:
        held = torch.from_numpy(f["images"][()])
    g = torch.Generator().manual_seed(20261128)
    sigma = torch.exp(-1.2 + 1.2 * torch.randn(len(held), generator=g))  # EDM's training sigmas
    noise = torch.randn(held.shape, generator=g)
    latents = torch.randn((ARGS.truth_samples,) + tuple(train_x.shape[1:]), generator=g)
    net = ToyDenoiser(1, ARGS.width).eval()
    ckpts = checkpoints(run_dir)
    for k, (step, ckpt) in enumerate(ckpts):
        sample_it = k % ARGS.truth_every == ARGS.truth_every - 1 or k == len(ckpts) - 1
        entry = done.get(str(step), {"heldout_loss": {}})
        losses = [v for v in ARGS.weights.split(",") if v not in entry["heldout_loss"]]
        if not losses and ("copy_share" in entry or not sample_it):
            continue
        t0 = time.perf_counter()
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        with torch.no_grad():
            for variant in losses:
                net.load_state_dict(state[WEIGHTS[variant]])
                entry["heldout_loss"][variant] = heldout_loss(net, held, sigma, noise)
            if sample_it and "copy_share" not in entry:
                net.load_state_dict(state[WEIGHTS["ema"]])
                t1 = time.perf_counter()
                share, ratio = copy_share(heun_sample(net, latents), train_x)
                entry["copy_share"] = share
                entry["ratio_median"] = float(np.median(ratio))
                entry["seconds"] = time.perf_counter() - t1
        done[str(step)] = entry
        tmp = path.with_name(".truth.json.tmp")
        tmp.write_text(json.dumps(done, indent=1, sort_keys=True))
        os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# 4. decide
# ---------------------------------------------------------------------------------------------

def replay(run_dir: Path, variant: str, heldout: bool, *overrides: str) -> dict:
    """What diffmon's detector decides over the recorded history (`diffmon replay --json`)."""
    cfg = config(run_dir, variant, heldout)
    cmd = [str(ARGS.bin), "replay", "--config", str(cfg), "--json"]
    for o in overrides:
        cmd += ["--set", o]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def patience_rule(steps: list[int], values: list[float], patience: int) -> tuple[int | None, int | None]:
    """A practitioner's early stopping on a loss: the best is the lowest value so far; fires at
    the `patience`-th consecutive checkpoint without a new lowest. Returns (best, fired_at)."""
    best, best_value, wait = None, float("inf"), 0
    for step, v in zip(steps, values):
        if v < best_value:
            best, best_value, wait = step, v, 0
        else:
            wait += 1
            if wait >= patience:
                return best, step
    return best, None


def onset(truth_table: dict) -> int | None:
    steps = sorted((int(s), e["copy_share"]) for s, e in truth_table.items() if "copy_share" in e)
    return next((s for s, share in steps if share >= ONSET), None)


def decide(run_dir: Path, variant: str, patience: int) -> list[dict]:
    recs = records(run_dir, variant)
    tt = json.loads((run_dir / "truth.json").read_text())
    first = onset(tt)
    steps = sorted(int(s) for s in tt)
    decisions = {}
    losses = [tt[str(s)]["heldout_loss"][variant] for s in steps]
    decisions["heldout-loss"] = patience_rule(steps, losses, patience)
    alert = next((i for i, r in enumerate(recs) if (r.get("memorization_ratio") or 0) >= ONSET), None)
    decisions["memorization-alert"] = (
        (recs[alert - 1]["step"] if alert else None, recs[alert]["step"]) if alert is not None
        else (None, None))
    no_memorization_stop = "early_stop.memorization_level=0"
    for rule, heldout, sets in (
            ("icr-alone", False, ("early_stop.confirm=none", no_memorization_stop)),
            ("turn-only", False, (no_memorization_stop,)),
            ("default", False, ()), ("default+heldout", True, ())):
        d = replay(run_dir, variant, heldout, *sets)
        decisions[rule] = (d.get("best_step"), d.get("fired_at_step"))
    rows = []
    for rule in RULES:
        best, fired = decisions[rule]
        lead = first - best if (first is not None and best is not None and fired is not None) else None
        late = fired - first if (first is not None and fired is not None) else None
        rows.append({"rule": rule, "fired": fired is not None, "best_step": best,
                     "fired_at_step": fired, "onset_step": first, "lead_steps": lead,
                     "late_steps": late})
    return rows


def disagreement(run_dir: Path) -> dict:
    """Where diffmon's memorization ratio (EMA) and the study's copy share disagree: the largest
    absolute difference at a checkpoint with both, and the two onsets."""
    recs = {r["step"]: r.get("memorization_ratio") for r in records(run_dir, "ema")}
    tt = json.loads((run_dir / "truth.json").read_text())
    pairs = [(int(s), recs.get(int(s)), e["copy_share"]) for s, e in tt.items()
             if "copy_share" in e and recs.get(int(s)) is not None]
    diffmon_onset = next((s for s in sorted(recs) if (recs[s] or 0) >= ONSET), None)
    worst = max(pairs, key=lambda p: abs(p[1] - p[2]), default=None)
    return {"diffmon_onset": diffmon_onset, "study_onset": onset(tt),
            "max_abs_diff": abs(worst[1] - worst[2]) if worst else None,
            "at_step": worst[0] if worst else None}


def figure(out: Path, label: str, names: list[str], rows: list[dict]) -> Path | None:
    """ICR (EMA), the gap and the copy share against the step for each seed of one size; the
    default detector's best (dashed) and fired-at (solid) steps, and the onset (dotted)."""
    try:
        import matplotlib
    except ImportError:
        print("mnist_study: no matplotlib: figures skipped", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True)
    for k, name in enumerate(names):
        run_dir = out / name
        if not journal(run_dir, "ema").exists() or not (run_dir / "truth.json").exists():
            continue
        color = f"C{k}"
        recs = records(run_dir, "ema")
        steps = [r["step"] for r in recs]
        axes[0].plot(steps, [r["icr"] for r in recs], color=color, label=name)
        axes[1].plot(steps, [r.get("generalization_gap") for r in recs], color=color)
        tt = json.loads((run_dir / "truth.json").read_text())
        cs = sorted((int(s), e["copy_share"]) for s, e in tt.items() if "copy_share" in e)
        axes[2].plot([s for s, _ in cs], [v for _, v in cs], color=color, marker=".")
        row = next((r for r in rows if r["run"] == name and r["weights"] == "ema"
                    and r["rule"] == "default"), None)
        for ax in axes:
            if row and row["best_step"] is not None and row["fired"]:
                ax.axvline(row["best_step"], color=color, ls="--", lw=0.8)
                ax.axvline(row["fired_at_step"], color=color, ls="-", lw=0.8)
            if row and row["onset_step"] is not None:
                ax.axvline(row["onset_step"], color=color, ls=":", lw=1.2)
    axes[0].set_ylabel("ICR (EMA)")
    axes[1].set_ylabel("generalization gap")
    axes[2].set_ylabel("copies (study)")
    axes[2].axhline(ONSET, color="grey", lw=0.6)
    axes[2].set_xlabel("training step")
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"MNIST, {label}: default detector best (--), fired (-), onset (:)", fontsize=9)
    fig.tight_layout()
    path = out / f"mnist-{label}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def cell(v) -> str:
    return "–" if v is None else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sizes", default="16:1200,32:1800,64:3000,rich",
                    help="training images per data-limited run, each with its own steps after a "
                         "colon (else --steps); `rich` for the data-rich runs")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=3000,
                    help="steps of a data-limited run whose size names none")
    ap.add_argument("--rich-size", type=int, default=20000)
    ap.add_argument("--rich-steps", type=int, default=1000)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--width", type=int, default=32, help="the U-Net's base channels")
    ap.add_argument("--icr-samples", type=int, default=1024)
    ap.add_argument("--mem-samples", type=int, default=64,
                    help="PF-ODE latents of diffmon's memorization ratio (pfd.samples)")
    ap.add_argument("--truth-samples", type=int, default=256)
    ap.add_argument("--truth-every", type=int, default=2)
    ap.add_argument("--weights", default="ema,raw",
                    help="the weights evaluated (ema, raw); run again with more to add them")
    ap.add_argument("--pattern", default="ckpt_*.pt",
                    help="the checkpoints evaluated (e.g. 'ckpt_*00.pt': every 100 steps of a run "
                         "saved every 50)")
    ap.add_argument("--lanes", type=int, default=2, help="runs side by side, one thread each")
    ap.add_argument("--train-device", default="cpu",
                    help="where the trainer runs (cuda: train many runs at once on one GPU with "
                         "--phase train --lanes 8, then evaluate on any machine)")
    ap.add_argument("--phase", default="all", choices=("train", "evaluate", "truth", "decide", "all"))
    ap.add_argument("--bin", type=Path, default=ROOT / "target" / "release" / "diffmon",
                    help="the diffmon binary to run (default: this checkout's release build)")
    global ARGS
    ARGS = args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plan = runs(args)
    variants = args.weights.split(",")
    t0 = time.perf_counter()

    def run_all(name: str, size: int, seed: int, steps: int) -> None:
        """One run's phases in order, so a lane finishes a run before it takes the next."""
        if args.phase in ("train", "all"):
            train(args.out, name, size, seed, steps)
        if args.phase in ("evaluate", "all"):
            for v in variants:
                evaluate(args.out / name, v)
        if args.phase in ("truth", "all"):
            truth(args.out / name)

    with ThreadPoolExecutor(args.lanes) as pool:
        list(pool.map(lambda r: run_all(*r), plan))
    if args.phase not in ("decide", "all"):
        return 0
    patience = 2  # diffmon's early_stop.patience default (docs/design.md §9)
    rows, seconds = [], []
    for name, size, seed, steps in plan:
        run_dir = args.out / name
        if not (run_dir / "truth.json").exists() or not all(journal(run_dir, v).exists() for v in variants):
            print(f"mnist_study: {name} is not complete yet: run the study again", file=sys.stderr)
            continue
        n_ckpt = len(checkpoints(run_dir))
        train_s = training_seconds(args.out / f"{name}.log")
        eval_s = {v: float(np.median([r["seconds"] for r in records(run_dir, v)])) for v in variants}
        tt = json.loads((run_dir / "truth.json").read_text())
        truth_s = float(np.median([e["seconds"] for e in tt.values() if "copy_share" in e]))
        seconds.append({"run": name, "train_per_ckpt": train_s / n_ckpt if train_s else None,
                        "diffmon_per_ckpt": eval_s, "truth_per_sampled_ckpt": truth_s,
                        **disagreement(run_dir)})
        for v in variants:
            for row in decide(run_dir, v, patience):
                rows.append({"run": name, "images": size, "seed": seed, "steps": steps,
                             "weights": v, **row})
    lines = ["| run | weights | rule | fired | best step | fired at | onset (≥ 5% copies) | lead | late |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['weights']} | {r['rule']} | {'yes' if r['fired'] else 'no'} | "
                     f"{cell(r['best_step'])} | {cell(r['fired_at_step'])} | "
                     f"{cell(r['onset_step']) if r['onset_step'] is not None else 'never'} | "
                     f"{cell(r['lead_steps'])} | {cell(r['late_steps'])} |")
    lines += ["", "| run | training s/checkpoint | diffmon s/checkpoint (ema, raw) | truth s/sampled checkpoint "
              "| diffmon's onset | study's onset | largest difference in copy share (step) |",
              "|---|---:|---|---:|---:|---:|---|"]
    for s in seconds:
        diff = "–" if s["max_abs_diff"] is None else f"{s['max_abs_diff']:.3f}"
        train_s = "–" if s["train_per_ckpt"] is None else f"{s['train_per_ckpt']:.1f}"
        lines.append(f"| {s['run']} | {train_s} | "
                     f"{', '.join(f'{v:.1f}' for v in s['diffmon_per_ckpt'].values())} | "
                     f"{s['truth_per_sampled_ckpt']:.1f} | {cell(s['diffmon_onset'])} | "
                     f"{cell(s['study_onset'])} | {diff} ({cell(s['at_step'])}) |")
    table = "\n".join(lines)
    print(table)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "study.json").write_text(json.dumps({"rows": rows, "seconds": seconds}, indent=1))
    for label in dict.fromkeys(n.split("-s")[0] for n, *_ in plan):
        names = [n for n, *_ in plan if n.split("-s")[0] == label]
        figure(args.out, label, names, rows)
    print(f"mnist_study: decided in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
