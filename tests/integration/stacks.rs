//! Acceptance tests of issue #16: `diffmon watch`, with the default `checkpoints.pattern`, on run
//! folders written by real training stacks (`python/stacks.py`: accelerate `checkpoint-N/`
//! folders, diffusers `checkpoint-N/unet{,_ema}/`, diffusers `EMAModel` state dicts, Lightning
//! `step=N.ckpt` with `EMAWeightAveraging`, whole-module pickles, DCP folders). Each checkpoint is
//! evaluated exactly once, its step comes from its name, the record names the file or folder,
//! and its ICR equals `diffmon eval --json` of the flat copy of the weights diffmon should
//! evaluate from it (`FLAT/step_N.safetensors`, the EMA weights where there are some).
//!
//! Every stack trains the same tiny diffusers UNet, so one exported `model.ts` and one `train.h5`
//! serve all; one Python call writes every stack but accelerate, which is trained while the
//! daemon watches (with rotation). Run them all with
//! `cargo test --release --locked --test integration stacks::`.

use crate::common::{diffmon, root, run_python, stderr, stdout};
use crate::daemon::{Daemon, free_port};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const STEPS: [i64; 3] = [2, 4, 6];

/// `model.ts`, `train.h5`, `MARKER`'s folder, and `runs/S`, `flat/S` for every stack but
/// accelerate, written by one call of `python/stacks.py` (the imports are shared).
fn fixture() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let p = |s: &str| dir.path().join(s).to_str().unwrap().to_string();
        run_python(&[
            "python/stacks.py",
            "--stack",
            "diffusers,emamodel,lightning,module,dcp",
            "--ema",
            "--hostile",
            &p("MARKER"),
            "--out",
            &p("runs/{stack}"),
            "--flat",
            &p("flat/{stack}"),
            "--data",
            &p("train.h5"),
            "--export",
            &p("model.ts"),
        ]);
        dir
    })
    .path()
}

/// A daemon on `run` with the default checkpoint pattern; its config and state live in `case`.
fn watch(case: &Path, run: &Path) -> Daemon {
    watch_with(case, run, 64)
}

/// [`watch`] with `samples` ICR view pairs (more: a slower evaluation).
fn watch_with(case: &Path, run: &Path, samples: usize) -> Daemon {
    watch_configured(case, run, samples, "")
}

/// [`watch_with`], with `extra` YAML appended to the config.
fn watch_configured(case: &Path, run: &Path, samples: usize, extra: &str) -> Daemon {
    let port = free_port();
    let config = case.join("diffmon.yaml");
    fs::write(
        &config,
        format!(
            "run: {{dir: {run:?}, name: test}}\nstate_dir: {state:?}\n\
             model: {{architecture: {arch:?}}}\ndevice: cpu\ncpu_threads: 1\n\
             data: {{path: {data:?}}}\nhttp: {{listen: \"127.0.0.1:{port}\"}}\n\
             checkpoints: {{settle_secs: 0.5, poll_secs: 0.5}}\n\
             icr: {{samples: {samples}, batch_size: 64}}\npfd: {{enabled: false}}\n{extra}",
            state = case.join("state"),
            arch = fixture().join("model.ts"),
            data = fixture().join("train.h5"),
        ),
    )
    .unwrap();
    Daemon::spawn(config, port)
}

/// The daemon's journal entries (complete lines only).
fn entries(case: &Path) -> Vec<Value> {
    let text = fs::read_to_string(case.join("state/history.jsonl")).unwrap_or_default();
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn evaluations(case: &Path) -> Vec<Value> {
    entries(case)
        .into_iter()
        .filter(|e| e["kind"] == "evaluation")
        .map(|e| e["record"].clone())
        .collect()
}

fn failures(case: &Path) -> Vec<(i64, String, String)> {
    entries(case)
        .into_iter()
        .filter(|e| e["kind"] == "failure")
        .map(|e| {
            (
                e["step"].as_i64().unwrap(),
                e["reason"].as_str().unwrap().to_string(),
                e["message"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// `diffmon eval --json` of the flat copies of `steps`: step -> ICR.
fn flat_icr(config: &Path, flat: &Path, steps: &[i64]) -> BTreeMap<i64, f64> {
    let files: Vec<String> = steps
        .iter()
        .map(|s| {
            flat.join(format!("step_{s}.safetensors"))
                .to_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let mut args = vec!["eval", "--config", config.to_str().unwrap(), "--json"];
    args.extend(files.iter().map(String::as_str));
    let out = diffmon(&args);
    assert!(out.status.success(), "diffmon eval: {}", stderr(&out));
    stdout(&out)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["step"].as_i64().unwrap(), v["icr"].as_f64().unwrap())
        })
        .collect()
}

/// Every evaluated record's ICR equals the flat copy's, to 1e-12 relative.
fn assert_icr_matches_flat(d: &Daemon, records: &[Value], flat: &Path) {
    let steps: Vec<i64> = records
        .iter()
        .map(|r| r["step"].as_i64().unwrap())
        .collect();
    let want = flat_icr(&d.config, flat, &steps);
    for r in records {
        let step = r["step"].as_i64().unwrap();
        let got = r["icr"].as_f64().unwrap();
        let w = want[&step];
        assert!(
            (got - w).abs() <= 1e-12 * w.abs(),
            "step {step}: watch ICR {got} != eval of the flat weights {w} (checkpoint {})",
            r["checkpoint"]
        );
    }
}

/// Waits until the journal holds `n` entries (evaluations and failures), then a few more rescans.
fn wait_for_entries(d: &Daemon, case: &Path, n: usize) {
    d.wait_for(
        Duration::from_secs(90),
        &format!("{n} journal entries"),
        |_| entries(case).len() >= n,
    );
    std::thread::sleep(Duration::from_millis(1500)); // three rescans: nothing may come twice
}

/// The last path component of a record's `checkpoint`.
fn checkpoint_name(r: &Value) -> String {
    let c = r["checkpoint"].as_str().unwrap();
    Path::new(c.trim_end_matches('/'))
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string()
}

/// A stack written beforehand: each of its three checkpoints evaluated once, named `name(step)`.
fn complete_stack(stack: &str, name: impl Fn(i64) -> String) -> (tempfile::TempDir, Daemon) {
    let flat = fixture().join("flat").join(stack);
    watch_complete(stack, &fixture().join("runs").join(stack), &flat, name)
}

/// `run`'s three checkpoints evaluated once each, named `name(step)`, with the ICRs of `flat`'s.
fn watch_complete(
    stack: &str,
    run: &Path,
    flat: &Path,
    name: impl Fn(i64) -> String,
) -> (tempfile::TempDir, Daemon) {
    let case = tempfile::tempdir().unwrap();
    let d = watch(case.path(), run);
    wait_for_entries(&d, case.path(), STEPS.len());
    let fails = failures(case.path());
    assert!(fails.is_empty(), "{stack}: failures {fails:?}\n{}", d.log());
    let records = evaluations(case.path());
    let mut steps: Vec<i64> = records
        .iter()
        .map(|r| r["step"].as_i64().unwrap())
        .collect();
    steps.sort();
    assert_eq!(steps, STEPS, "{stack}: each checkpoint exactly once");
    for r in &records {
        let step = r["step"].as_i64().unwrap();
        assert_eq!(checkpoint_name(r), name(step), "{stack}: {r}");
    }
    assert_eq!(d.evaluated(), STEPS.len() as f64);
    assert_icr_matches_flat(&d, &records, flat);
    (case, d)
}

#[test]
fn control_flat_copies_watched_like_eval() {
    // The harness itself: the flat copies (plain safetensors, readable before issue #16) watched
    // as a run agree with `diffmon eval` on them. If this fails, the other tests prove nothing.
    let flat = fixture().join("flat/diffusers");
    watch_complete("flat", &flat, &flat, |s| format!("step_{s}.safetensors"));
}

#[test]
fn diffusers_checkpoint_folders_evaluate_unet_ema() {
    // checkpoint-N/{unet,unet_ema}/diffusion_pytorch_model.safetensors: the flat copy is the EMA.
    complete_stack("diffusers", |s| format!("checkpoint-{s}"));
}

#[test]
fn diffusers_checkpoint_folders_without_ema_evaluate_unet() {
    // The same run as a user training without `--use_ema` has it: checkpoint-N/unet/ only.
    // Its flat copy is the `unet/diffusion_pytorch_model.safetensors` diffusers wrote.
    let tmp = tempfile::tempdir().unwrap();
    let (run, flat) = (tmp.path().join("run"), tmp.path().join("flat"));
    fs::create_dir_all(&flat).unwrap();
    for s in STEPS {
        let from = fixture().join(format!("runs/diffusers/checkpoint-{s}/unet"));
        let to = run.join(format!("checkpoint-{s}/unet"));
        fs::create_dir_all(&to).unwrap();
        for e in fs::read_dir(&from).unwrap() {
            let e = e.unwrap();
            fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
        fs::copy(
            to.join("diffusion_pytorch_model.safetensors"),
            flat.join(format!("step_{s}.safetensors")),
        )
        .unwrap();
    }
    watch_complete("diffusers without EMA", &run, &flat, |s| {
        format!("checkpoint-{s}")
    });
}

#[test]
fn emamodel_state_dicts_evaluate_shadow_params() {
    complete_stack("emamodel", |s| format!("ema-{s}.pt"));
}

#[test]
fn lightning_checkpoints_with_ema_weight_averaging() {
    // step=N.ckpt: `state_dict` (the average, `model.` keys) is what the flat copy holds.
    complete_stack("lightning", |s| format!("step={s}.ckpt"));
}

#[test]
fn dcp_checkpoint_folders() {
    complete_stack("dcp", |s| format!("checkpoint-{s}"));
}

#[test]
fn whole_module_pickles_are_read_without_running_them() {
    let marker = fixture().join("MARKER");
    let (_case, d) = complete_stack("module", |s| format!("model-{s}.pt"));
    assert!(
        !marker.exists(),
        "reading a pickled module ran its code:\n{}",
        d.log()
    );
    // The fixture is really hostile: unpickling it the ordinary way creates the marker.
    let ckpt = fixture().join("runs/module/model-6.pt");
    run_python(&[
        "-c",
        "import sys, torch; torch.load(sys.argv[1], weights_only=False)",
        ckpt.to_str().unwrap(),
    ]);
    assert!(
        marker.exists(),
        "torch.load(weights_only=False) did not create the marker"
    );
}

#[test]
fn accelerate_folders_written_and_rotated_while_watched() {
    // accelerate's save_state every 2 steps with a total limit of 2 folders, training while the
    // daemon watches, each evaluation (12288 view pairs, seconds) slower than the time between two
    // checkpoints (0.7 s): rotation deletes most folders before their turn. Each is pinned when
    // found complete (docs/guide/watching.md, "Rotation"), so every one is evaluated, once and
    // right (its ICR that of a flat copy of the same weights), and named as it was in the run.
    let case = tempfile::tempdir().unwrap();
    let run = case.path().join("run");
    let flat = case.path().join("flat");
    fs::create_dir(&run).unwrap();
    let d = watch_with(case.path(), &run, 12288);
    let started = Instant::now();
    train(&[
        "--stack",
        "accelerate",
        "--steps",
        "12",
        "--every",
        "2",
        "--limit",
        "2",
        "--pause",
        "0.7",
        "--out",
        run.to_str().unwrap(),
        "--flat",
        flat.to_str().unwrap(),
    ]);
    let trained = started.elapsed();
    let names: Vec<String> = fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(names, ["checkpoint-10", "checkpoint-12"], "rotation");
    wait_for_entries(&d, case.path(), 6);
    let records = evaluations(case.path());
    let steps: Vec<i64> = records
        .iter()
        .map(|r| r["step"].as_i64().unwrap())
        .collect();
    assert_eq!(
        steps,
        [2, 4, 6, 8, 10, 12],
        "every checkpoint evaluated once, in step order; failures {:?}\n{}",
        failures(case.path()),
        d.log()
    );
    assert!(
        failures(case.path()).is_empty(),
        "{:?}",
        failures(case.path())
    );
    for r in &records {
        let step = r["step"].as_i64().unwrap();
        assert_eq!(checkpoint_name(r), format!("checkpoint-{step}"), "{r}");
    }
    // Slower than the checkpoints: the evaluations took longer than the training wrote them.
    let evaluating: f64 = records.iter().map(|r| r["seconds"].as_f64().unwrap()).sum();
    assert!(
        evaluating > trained.as_secs_f64() / 2.0,
        "evaluations {evaluating:.1} s against {:.1} s of training: not behind",
        trained.as_secs_f64()
    );
    // ... and the daemon said so, once (docs/guide/watching.md, "When diffmon falls behind").
    assert_eq!(
        d.log().matches("evaluation falls behind").count(),
        1,
        "{}",
        d.log()
    );
    // Steps 2 and 4, deleted by rotation long before their turn, were evaluated from their pins:
    // their ICR is that of the same weights (a flat copy of them).
    assert_icr_matches_flat(&d, &records[..2], &flat);
    // The default detector (the median of 3) names a checkpoint best one or two evaluations
    // after its own, when rotation has long deleted it: its pin is held until the detector can
    // no longer name it (issue #45), so every step it ever named best was kept, from its pin.
    let series: Vec<(i64, f64)> = records
        .iter()
        .map(|r| (r["step"].as_i64().unwrap(), r["icr"].as_f64().unwrap()))
        .collect();
    let (named, late) = named_best_by_median_of_3(&series);
    let log = d.log();
    assert!(
        !log.contains("cannot keep the best checkpoint"),
        "named best {named:?}:\n{log}"
    );
    for step in &named {
        let path = run.join(format!("checkpoint-{step}"));
        assert!(
            log.lines().any(|l| l.contains("best checkpoint kept")
                && l.contains(&format!("checkpoint={}", path.display()))),
            "step {step} was named best ({named:?}) but never kept:\n{log}"
        );
    }
    let best = *named.last().unwrap();
    let kept = case.path().join(format!("state/best/checkpoint-{best}"));
    assert!(kept.join("model.safetensors").is_file(), "{kept:?}");
    // Every pin is released once recorded, but the best checkpoint's and those the detector
    // may still name best (the median of 3: at most one).
    let pins: Vec<_> = fs::read_dir(case.path().join("state/pins"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    assert!(pins.len() <= 2, "{pins:?}");
    eprintln!(
        "accelerate: evaluated {steps:?} in {evaluating:.1} s, training {:.1} s; named best \
         {named:?}, of which named at a later evaluation than their own {late:?}",
        trained.as_secs_f64()
    );
}

/// The steps the default detector (the median of the last 3 values; for 2, their mean, named
/// after the lower one) names best over `series`, in order, each time the best's step changes:
/// the reference the daemon's keeper is checked against; and those named at a later
/// evaluation than their own (when rotation had deleted them), as (step, named at).
fn named_best_by_median_of_3(series: &[(i64, f64)]) -> (Vec<i64>, Vec<(i64, i64)>) {
    let mut named = Vec::new();
    let mut late = Vec::new();
    let mut best = f64::INFINITY;
    for end in 1..=series.len() {
        let mut window = series[end.saturating_sub(3)..end].to_vec();
        window.sort_by(|a, b| a.1.total_cmp(&b.1));
        let (smoothed, step) = match window.as_slice() {
            [only] => (only.1, only.0),
            [lo, hi] => ((lo.1 + hi.1) / 2.0, lo.0),
            [_, mid, _] => (mid.1, mid.0),
            _ => unreachable!(),
        };
        if smoothed < best {
            best = smoothed;
            if named.last() != Some(&step) {
                named.push(step);
                let at = series[end - 1].0;
                if at != step {
                    late.push((step, at));
                }
            }
        }
    }
    (named, late)
}

/// Detector settings whose decisions have a closed form ([`Decided`]): window 1, warm-up 1,
/// patience 1, no rise needed (min_rise 0, noise rule off, no confirmation).
const FIRST_RISE: &str = "early_stop: {window: 1, warmup: 1, patience: 1, min_rise: 0.0, noise_multiple: 0, confirm: none}\n";

/// What the detector of [`FIRST_RISE`] decides on a series of (step, ICR), in closed form: it
/// fires (once) at the first value above the smallest before it, naming that one, and a later
/// value below the fired best resolves it.
#[derive(Debug)]
struct Decided {
    /// The smallest value's step.
    best: i64,
    /// (the fired best's step, the step it fired at).
    fired: Option<(i64, i64)>,
    resolved: bool,
}

impl Decided {
    fn of(series: &[(i64, f64)]) -> Decided {
        let mut best = series[0];
        let mut fired: Option<((i64, f64), i64)> = None;
        let mut resolved = false;
        for &(step, v) in &series[1..] {
            if v < best.1 {
                resolved |= fired.is_some_and(|(f, _)| v < f.1);
                best = (step, v);
            } else if v > best.1 && fired.is_none() {
                fired = Some((best, step));
            }
        }
        Decided {
            best: best.0,
            fired: fired.map(|(f, at)| (f.0, at)),
            resolved,
        }
    }

    /// Does an early stop stand (the stop file is there)?
    fn stopped(&self) -> bool {
        self.fired.is_some() && !self.resolved
    }

    /// Checks the daemon's `/v1/early-stop` against it.
    fn check(&self, status: &Value, series: &[(i64, f64)]) {
        assert_eq!(
            status["fired"],
            self.stopped(),
            "{status}\n{self:?} {series:?}"
        );
        assert_eq!(status["best_step"], self.best, "{status}\n{self:?}");
        if let (Some((_, at)), false) = (self.fired, self.resolved) {
            assert_eq!(status["event"]["current_step"], at, "{status}");
        }
    }
}

/// The JSON lines `stacks.py` printed (`resumed_from`, `stopped_early_at`).
fn said(out: &std::process::Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `python/stacks.py` with `args`, which must succeed.
fn train(args: &[&str]) -> std::process::Output {
    let out = Command::new(crate::common::python())
        .arg("python/stacks.py")
        .args(args)
        .env("PYTHONPATH", root().join("python"))
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stacks.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// (step, ICR) of each evaluation of a segment.
type Series = Vec<(i64, f64)>;

/// The (step, ICR) of the journal's evaluations: of the first segment, and of the second.
fn segments(case: &Path) -> (Series, Series) {
    let (mut first, mut second) = (Vec::new(), Vec::new());
    let mut resumed = false;
    for e in entries(case) {
        match e["kind"].as_str().unwrap() {
            "resume" => resumed = true,
            "evaluation" => {
                let r = &e["record"];
                let point = (r["step"].as_i64().unwrap(), r["icr"].as_f64().unwrap());
                if resumed { &mut second } else { &mut first }.push(point);
            }
            other => panic!("a {other} entry: {e}"),
        }
    }
    (first, second)
}

/// The whole life of a run on a training stack (issue #33): training polls the stop file and
/// stops when the early stop fires; rotation deletes the best; `diffmon resume` puts the kept
/// copy back where the stack resumes from and removes the stop file; the stack's own resume code
/// loads it (exactly: the weights equal the kept checkpoint's); the restarted daemon follows the
/// new segment, does not evaluate the restored checkpoint again, and fires again exactly when
/// the lineage (the first segment up to the resume step, then the new one) turns.
fn resume_after_the_early_stop(stack: &str, name: fn(i64) -> String, more: &[&str]) {
    let case = tempfile::tempdir().unwrap();
    let run = case.path().join("run");
    let flat = case.path().join("flat");
    fs::create_dir(&run).unwrap();
    let (run_s, flat_s) = (run.to_str().unwrap(), flat.to_str().unwrap());
    let mut d = watch_configured(case.path(), &run, 64, FIRST_RISE);
    // A pause after each checkpoint gives the daemon the time to evaluate it, so the stop file
    // comes while training still runs.
    let common = [
        "--every",
        "2",
        "--pause",
        "1.5",
        "--lr",
        "0.05",
        "--stop-on-early-stop",
    ];
    let mut args = vec![
        "--stack", stack, "--steps", "16", "--out", run_s, "--flat", flat_s,
    ];
    args.extend(common.iter().chain(more));
    let first = said(&train(&args));
    let stopped = first
        .iter()
        .find_map(|l| l["stopped_early_at"].as_i64())
        .unwrap_or_else(|| {
            panic!(
                "training did not stop at the early stop: {:?}\n{}",
                segments(case.path()).0,
                d.log()
            )
        });
    let written = stopped / 2;
    d.wait_for(Duration::from_secs(120), "every checkpoint written", |_| {
        evaluations(case.path()).len() as i64 >= written
    });
    let status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
    let (series, _) = segments(case.path());
    let decided = Decided::of(&series);
    assert!(
        decided.fired.is_some(),
        "the first segment turned: {series:?}"
    );
    decided.check(&status, &series);
    assert_eq!(run.join("EARLY_STOP").exists(), decided.stopped());
    // `diffmon resume` takes the best the early stop named while it stands, else the best.
    let best = match (decided.fired, decided.resolved) {
        (Some((fired_best, _)), false) => fired_best,
        _ => decided.best,
    };
    d.terminate();

    // Rotation deleted the best (or does now: Lightning keeps every checkpoint here).
    let best_path = run.join(name(best));
    if best_path.is_dir() {
        fs::remove_dir_all(&best_path).unwrap();
    } else if best_path.exists() {
        fs::remove_file(&best_path).unwrap();
    }
    // The dry run names the loader of the checkpoint's shape, though only its kept copy is left.
    let config = case.path().join("diffmon.yaml");
    let dry = diffmon(&["resume", "--dry-run", "--config", config.to_str().unwrap()]);
    assert!(dry.status.success(), "{}", stderr(&dry));
    assert_eq!(
        stdout(&dry).contains("accelerator.load_state"),
        stack == "accelerate",
        "{}",
        stdout(&dry)
    );
    assert!(!stdout(&dry).contains("torch.load("), "{}", stdout(&dry));
    let out = diffmon(&[
        "resume",
        "--config",
        case.path().join("diffmon.yaml").to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("restored from"), "{}", stdout(&out));
    assert!(best_path.exists(), "not restored");
    assert!(!run.join("EARLY_STOP").exists(), "the stop file stays");

    d.restart();
    let resume_from = best_path.to_str().unwrap().to_string();
    let until = (best + 6).to_string();
    let mut args = vec![
        "--stack", stack, "--steps", &until, "--out", run_s, "--flat", flat_s,
    ];
    args.extend(common.iter().chain(more));
    args.extend(["--resume-from", &resume_from]);
    let second = said(&train(&args));
    let resumed = second
        .iter()
        .find(|l| l.get("resumed_from").is_some())
        .expect("resumed");
    assert_eq!(resumed["step"], best, "{resumed}");
    assert_eq!(
        resumed["exact"], true,
        "the stack loaded other weights than the kept ones"
    );
    let last = second
        .iter()
        .find_map(|l| l["stopped_early_at"].as_i64())
        .unwrap_or(best + 6);
    let new = (last - best) / 2;
    d.wait_for(
        Duration::from_secs(120),
        "the new segment's checkpoints",
        |_| segments(case.path()).1.len() as i64 >= new,
    );
    let (first_segment, second_segment) = segments(case.path());
    let steps: Vec<i64> = second_segment.iter().map(|p| p.0).collect();
    let expected: Vec<i64> = (1..=new).map(|k| best + 2 * k).collect();
    assert_eq!(
        steps, expected,
        "the new segment; the restored one not evaluated again"
    );
    let lineage: Vec<(i64, f64)> = first_segment
        .iter()
        .filter(|p| p.0 <= best)
        .chain(&second_segment)
        .copied()
        .collect();
    let status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
    assert_eq!(status["segment"], 2, "{status}");
    let decided = Decided::of(&lineage);
    decided.check(&status, &lineage);
    assert_eq!(run.join("EARLY_STOP").exists(), decided.stopped());
    eprintln!("{stack}: first segment {first_segment:?}, resumed from {best}: {second_segment:?}");
}

#[test]
fn accelerate_resumes_from_the_kept_best_after_the_early_stop() {
    resume_after_the_early_stop(
        "accelerate",
        |s| format!("checkpoint-{s}"),
        &["--limit", "2"],
    );
}

#[test]
fn lightning_resumes_from_the_kept_best_after_the_early_stop() {
    resume_after_the_early_stop("lightning", |s| format!("step={s}.ckpt"), &[]);
}
