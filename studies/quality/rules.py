"""The benchmark's decide phase: what each rule names, what that checkpoint is worth, and the
statistics over runs (studies/quality/benchmark.py runs it; `--phase decide` alone replays).

Per run, on the EMA weights:
- quality Q = KID in the classifier's features (lower is better); E_gen (the study's) beside it;
- the copy share p of a checkpoint = its calibrated-criterion copies of the study's samples,
  with a two-sided 95% Clopper–Pearson interval; a checkpoint is *safe* when the interval's
  upper end is under 5%;
- the oracle: the safe checkpoint of lowest Q; normalized regret of a named checkpoint
  (Q(named) − Q(oracle)) / (Q(first) − Q(oracle)).

A rule that does not fire names what it would keep at the run's end: the detector and the
held-out rules their best so far (diffmon's keep_best), the ratio rules the last checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import benchmark as bm
import measures

PATIENCES = (1, 2, 4)
# rule -> (variant, held-out set, --set overrides) of its `diffmon replay`
REPLAYS = {
    "default": ("ema", False, ()),
    "default+heldout": ("ema", True, ()),
    "default+teacher": ("ema", False, ("early_stop.metric=pfd_generalization",)),
    "turn-only": ("ema", False, ("early_stop.memorization_level=0",)),
    "icr-alone": ("ema", False, ("early_stop.confirm=none", "early_stop.memorization_level=0")),
    "default-noflip": ("ema-noflip", False, ()),
}
RULES = (*REPLAYS, *(f"heldout-loss-p{p}" for p in PATIENCES), "ratio-back1", "ratio-back2",
         "first", "last", "oracle")
SHOWN = ("default", "heldout-loss-p2", "ratio-back1", "oracle")  # marked on the figures


def replay(out: Path, run_dir: Path, binary: Path, cfg: dict, rule: str) -> dict:
    variant, heldout, sets = REPLAYS[rule]
    conf = bm.config(out, run_dir, variant, heldout, cfg)
    cmd = [str(binary), "replay", "--config", str(conf), "--json"]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: status {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def patience_rule(steps: list[int], values: list[float], patience: int) -> tuple[int | None, int | None]:
    """Early stopping on a loss: the best is the lowest value so far; fires at the `patience`-th
    consecutive checkpoint without a new lowest. Returns (best, fired_at)."""
    best, best_value, wait = None, float("inf"), 0
    for step, v in zip(steps, values):
        if v < best_value:
            best, best_value, wait = step, v, 0
        else:
            wait += 1
            if wait >= patience:
                return best, step
    return best, None


def ratio_rule(steps: list[int], ratios: list[float | None], back: int) -> tuple[int, int | None]:
    """diffmon's memorization ratio alone: fires at the first checkpoint where it reaches 5%,
    naming the checkpoint `back` before (the first when there is none); else the last."""
    hit = next((i for i, r in enumerate(ratios) if (r or 0) >= bm.ONSET), None)
    if hit is None:
        return steps[-1], None
    return steps[max(0, hit - back)], steps[hit]


def decisions(out: Path, run_dir: Path, binary: Path, cfg: dict, truth: dict) -> dict:
    """rule -> (named step, fired-at step or None, extra) for one run."""
    steps = sorted(int(s) for s in truth)
    recs = {r["step"]: r for r in bm.records(run_dir, "ema")}
    out_ = {}
    for rule in REPLAYS:
        d = replay(out, run_dir, binary, cfg, rule)
        named = d.get("best_step") if d.get("best_step") is not None else steps[-1]
        out_[rule] = (named, d.get("fired_at_step"), {"turned_at": d.get("turned_at_step"),
                                                     "trigger": d.get("trigger")})
    losses = [truth[str(s)]["heldout_loss"]["ema"] for s in steps]
    for p in PATIENCES:
        best, fired = patience_rule(steps, losses, p)
        out_[f"heldout-loss-p{p}"] = (best, fired, {})
    ratios = [recs.get(s, {}).get("memorization_ratio") for s in steps]
    for back in (1, 2):
        named, fired = ratio_rule(steps, ratios, back)
        out_[f"ratio-back{back}"] = (named, fired, {})
    out_["first"] = (steps[0], None, {})
    out_["last"] = (steps[-1], None, {})
    return out_


def score_run(out: Path, run: dict, binary: Path, cfg: dict) -> dict | None:
    d = out / "runs" / run["name"]
    if not (d / "done.json").exists():
        return None
    truth = json.loads((d / "truth.json").read_text())
    steps = sorted(int(s) for s in truth)
    q = {s: truth[str(s)]["kid"] for s in steps}
    egen = {s: truth[str(s)]["egen"] for s in steps}
    share, interval = {}, {}
    for s in steps:
        e = truth[str(s)]
        share[s] = e["copies_calibrated"] / e["samples"]
        interval[s] = measures.clopper_pearson(e["copies_calibrated"], e["samples"])
    safe = [s for s in steps if interval[s][1] < bm.ONSET]
    oracle = min(safe, key=lambda s: q[s]) if safe else None
    oracle_egen = min(safe, key=lambda s: egen[s]) if safe else None
    dec = decisions(out, d, binary, cfg, truth)
    if oracle is not None:
        dec["oracle"] = (oracle, None, {})
    rules = {}
    for rule, (named, fired, extra) in dec.items():
        rules[rule] = {
            "fired": fired is not None, "best_step": named, "fired_at": fired,
            "quality": q[named], "quality_se": truth[str(named)]["kid_se"],
            "regret": (measures.normalized_regret(q[named], q[oracle], q[steps[0]])
                       if oracle is not None else None),
            "egen": egen[named],
            "regret_egen": (measures.normalized_regret(egen[named], egen[oracle_egen], egen[steps[0]])
                            if oracle_egen is not None else None),
            "copy_share": share[named], "copy_lower95": interval[named][0],
            "copy_upper95": interval[named][1],
            "copy_share_ratio_rule": truth[str(named)]["copies_ratio"] / truth[str(named)]["samples"],
            "steps_past_oracle": ((fired if fired is not None else steps[-1]) - oracle
                                  if oracle is not None else None),
            **{k: v for k, v in extra.items() if v is not None},
        }
    recs = bm.records(d, "ema")
    icr_min = recs[int(np.argmin([r["icr"] for r in recs]))]["step"] if recs else None
    return {"run": run["name"], "n": run["n"], "seed": run["seed"], "weights": "ema",
            "data_limited": run["limited"], "steps": steps[-1],
            "oracle": {"step": oracle, "quality": q[oracle] if oracle is not None else None,
                       "egen_step": oracle_egen},
            "onset": {"calibrated": bm.onset(d, "calibrated"), "ratio": bm.onset(d, "ratio")},
            "icr_min_step": icr_min, "criteria": criteria_agreement(truth),
            "seconds": costs(d, truth), "rules": rules}


def criteria_agreement(truth: dict) -> dict:
    """Where the two copy criteria disagree: checkpoints on which one says >= 5% and the other
    not, and the samples each counts alone."""
    split = [int(s) for s, e in truth.items()
             if (e["copies_calibrated"] >= bm.ONSET * e["samples"]) != (e["copies_ratio"] >= bm.ONSET * e["samples"])]
    return {"checkpoints_disagreeing": sorted(split),
            "calibrated_only": sum(e["copies_calibrated"] - e["copies_both"] for e in truth.values()),
            "ratio_only": sum(e["copies_ratio"] - e["copies_both"] for e in truth.values())}


def costs(run_dir: Path, truth: dict) -> dict:
    per_step = {}
    log = run_dir / "train.log"
    for line in (log.read_text().splitlines() if log.exists() else []):
        parts = line.split()
        if len(parts) >= 5 and parts[0] == "step" and parts[4].endswith("s"):
            per_step[int(parts[1])] = float(parts[4][:-1])
    diffmon = {v: sum(r["seconds"] for r in bm.records(run_dir, v)) for v in bm.VARIANTS}
    return {"train": sum(per_step.values()), "diffmon": diffmon,
            "truth": sum(e["seconds"] for e in truth.values())}


# ---------------------------------------------------------------------------------------------
# Over runs
# ---------------------------------------------------------------------------------------------

def rate(k: int, n: int) -> dict:
    lo, hi = measures.clopper_pearson(k, n)
    return {"k": k, "n": n, "share": k / n if n else None, "lower95": lo, "upper95": hi}


def summary(scored: list[dict]) -> dict:
    limited = [r for r in scored if r["data_limited"] and r["oracle"]["step"] is not None]
    rich = [r for r in scored if not r["data_limited"]]
    strata = [r["n"] for r in limited]
    per_rule = {}
    for rule in RULES:
        rows = [r["rules"][rule] for r in limited if rule in r["rules"]]
        regrets = [x["regret"] for x in rows if x["regret"] is not None]
        leads = [r["onset"]["calibrated"] - r["rules"][rule]["best_step"] for r in limited
                 if rule in r["rules"] and r["onset"]["calibrated"] is not None]
        per_rule[rule] = {
            "safe": rate(sum(x["copy_upper95"] < bm.ONSET for x in rows), len(rows)),
            "fired": rate(sum(x["fired"] for x in rows), len(rows)),
            "regret_mean": (measures.stratified_bootstrap(
                regrets, [r["n"] for r in limited if rule in r["rules"] and r["rules"][rule]["regret"] is not None])
                if regrets else None),
            "regret_median": float(np.median(regrets)) if regrets else None,
            "lead_median": float(np.median(leads)) if leads else None,
        }
        if rule != "default" and limited and len(rows) == len(limited) and all(
                r["rules"]["default"]["regret"] is not None and r["rules"][rule]["regret"] is not None for r in limited):
            diffs = [r["rules"]["default"]["regret"] - r["rules"][rule]["regret"] for r in limited]
            per_rule[rule]["default_minus_rule"] = measures.stratified_bootstrap(diffs, strata)
    with_onset = [r for r in limited if r["onset"]["calibrated"] is not None]
    turned = [r for r in with_onset if r["rules"]["turn-only"].get("turned_at") is not None]
    out = {
        "runs": {"data_limited": len(limited), "data_rich": len(rich)},
        "rules": per_rule,
        "icr_min_before_onset": rate(sum(r["icr_min_step"] < r["onset"]["calibrated"] for r in with_onset),
                                     len(with_onset)),
        "turn_before_onset": rate(sum(r["rules"]["turn-only"]["turned_at"] < r["onset"]["calibrated"]
                                      for r in turned), len(with_onset)),
    }
    if len(limited) >= 3:
        from scipy.stats import spearmanr

        rho = spearmanr([r["icr_min_step"] for r in limited], [r["oracle"]["step"] for r in limited])
        out["spearman_icr_min_vs_oracle"] = {"rho": float(rho.statistic), "p": float(rho.pvalue),
                                             "runs": len(limited)}
    false_stops = {}
    for rule in RULES:
        k = n = 0
        for r in rich:
            x, last = r["rules"].get(rule), r["rules"]["last"]
            if x is None:
                continue
            n += 1
            worse = x["quality"] - last["quality"] > 2 * np.hypot(x["quality_se"], last["quality_se"])
            k += bool(x["fired"] and worse)
        false_stops[rule] = rate(k, n)
    out["false_stop_data_rich"] = false_stops
    out["default_misses"] = [
        {"run": r["run"], "best_step": r["rules"]["default"]["best_step"],
         "regret": r["rules"]["default"]["regret"], "copy_share": r["rules"]["default"]["copy_share"],
         "copy_upper95": r["rules"]["default"]["copy_upper95"]}
        for r in limited if r["rules"]["default"]["copy_upper95"] >= bm.ONSET
        or (r["rules"]["default"]["regret"] or 0) > 0.15]
    return out


def fmt(v, spec=".3f") -> str:
    return "–" if v is None else format(v, spec)


def table(result: dict) -> str:
    s = result["summary"]
    lines = [f"Data-limited runs: {s['runs']['data_limited']}; data-rich: {s['runs']['data_rich']}. "
             "Safe: the named checkpoint's copy share has a 95% upper bound under 5%.", "",
             "| rule | safe | fired | mean regret [95%] | median regret | default − rule [95%] | median lead |",
             "|---|---|---|---|---:|---|---:|"]
    for rule, x in s["rules"].items():
        safe = x["safe"]
        m = x["regret_mean"]
        diff = x.get("default_minus_rule")
        lines.append(
            f"| {rule} | {safe['k']}/{safe['n']} [{fmt(safe['lower95'], '.2f')}, {fmt(safe['upper95'], '.2f')}] | "
            f"{x['fired']['k']}/{x['fired']['n']} | "
            f"{fmt(m[0]) + f' [{fmt(m[1])}, {fmt(m[2])}]' if m else '–'} | {fmt(x['regret_median'])} | "
            f"{fmt(diff[0]) + f' [{fmt(diff[1])}, {fmt(diff[2])}]' if diff else '–'} | {fmt(x['lead_median'], '.0f')} |")
    lines += ["", "| run | oracle (KID) | onset (calibrated, 1/3 rule) | default: named, fired at, trigger | "
              "KID | regret | copies [95%] |", "|---|---|---|---|---:|---:|---|"]
    for r in result["runs"]:
        x = r["rules"]["default"]
        lines.append(
            f"| {r['run']} | {fmt(r['oracle']['step'], 'd')} ({fmt(r['oracle']['quality'], '.4f')}) | "
            f"{fmt(r['onset']['calibrated'], 'd')}, {fmt(r['onset']['ratio'], 'd')} | "
            f"{x['best_step']}, {fmt(x['fired_at'], 'd')}, {x.get('trigger', '–')} | {x['quality']:.4f} | "
            f"{fmt(x['regret'], '.2f')} | {x['copy_share']:.3f} [{x['copy_lower95']:.3f}, {x['copy_upper95']:.3f}] |")
    return "\n".join(lines) + "\n"


def figure(out: Path, n: int, scored: list[dict]) -> Path | None:
    """KID and the copy share against the step for each seed of one N, each shown rule's pick."""
    try:
        import matplotlib
    except ImportError:
        print("benchmark: no matplotlib: figures skipped", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    marks = {"default": "o", "heldout-loss-p2": "^", "ratio-back1": "s", "oracle": "*"}
    fig, axes = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for k, r in enumerate(x for x in scored if x["n"] == n):
        tt = json.loads((out / "runs" / r["run"] / "truth.json").read_text())
        steps = sorted(int(s) for s in tt)
        color = f"C{k}"
        axes[0].plot(steps, [tt[str(s)]["kid"] for s in steps], color=color, label=r["run"], lw=1)
        axes[1].plot(steps, [tt[str(s)]["copies_calibrated"] / tt[str(s)]["samples"] for s in steps],
                     color=color, lw=1)
        for rule in SHOWN:
            x = r["rules"].get(rule)
            if x is not None:
                axes[0].plot([x["best_step"]], [x["quality"]], marks[rule], color=color, ms=7, mfc="none")
                axes[1].plot([x["best_step"]], [x["copy_share"]], marks[rule], color=color, ms=7, mfc="none")
    axes[0].set_ylabel("KID (classifier features)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("copy share (calibrated)")
    axes[1].axhline(bm.ONSET, color="grey", lw=0.6)
    axes[1].set_xlabel("training step")
    axes[0].legend(fontsize=7)
    axes[0].set_title(f"MNIST teacher samples, N = {n}: default (o), held-out p2 (^), ratio-back1 (s), "
                      "oracle (*)", fontsize=8)
    fig.tight_layout()
    path = out / f"benchmark-n{n}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def decide_all(out: Path, plan: list[dict], cfg: dict, binary: Path) -> dict:
    scored, missing = [], []
    for run in plan:
        r = score_run(out, run, binary, cfg)
        (scored.append(r) if r is not None else missing.append(run["name"]))
    if missing:
        print(f"benchmark: not complete yet (left out): {', '.join(missing)}", file=sys.stderr)
    frozen = json.loads((out / "frozen.json").read_text())
    shared = out / "shared"
    result = {"frozen_commit": frozen["frozen_commit"], "quality": "kid", "copy_criterion": "calibrated",
              "classifier": json.loads((shared / "classifier.json").read_text()),
              "teacher": json.loads((shared / "teacher.json").read_text()),
              "runs": scored, "missing": missing, "summary": summary(scored)}
    bm.atomic_json(out / "benchmark.json", result)
    text = table(result)
    (out / "table.md").write_text(text)
    print(text)
    for n in sorted({r["n"] for r in scored}):
        figure(out, n, scored)
    return result
