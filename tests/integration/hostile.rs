//! Hostile checkpoints (docs/design.md §10) against the real binary: a TorchScript archive's code
//! never runs, a malformed archive is a recorded failure, a deflate bomb is refused with bounded
//! memory, a FIFO never blocks the evaluator, and no file content reaches messages or the
//! journal.

use crate::common::{python, stderr, toy_run};
use crate::daemon::{Daemon, empty_run, journal, journal_entries};
use std::fs;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A run folder with the toy architecture and data, and an eval config.
fn run_dir() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = empty_run();
    let cfg = dir.path().join("eval.yaml");
    fs::write(
        &cfg,
        "run: {dir: .}\nmodel: {architecture: model.ts}\ndevice: cpu\n\
         data: {path: train.h5, heldout_path: heldout.h5}\n\
         icr: {samples: 256, batch_size: 128, seed: 5}\n",
    )
    .unwrap();
    (dir, cfg)
}

fn py(script: &str, args: &[&Path]) {
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `diffmon eval --json` of `ckpts`, killed (and the test failed) if it has not ended within
/// `limit`: a regression that blocks fails instead of hanging the suite.
fn eval(cfg: &Path, ckpts: &[&Path], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(["eval", "--config", cfg.to_str().unwrap(), "--json"])
        .args(ckpts)
        .env("DIFFMON_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "diffmon eval still running after {limit:?}: {}",
                stderr(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().unwrap()
}

/// A TorchScript module whose `__setstate__` creates `marker` (what libtorch's loader runs).
const EVIL_TS: &str = r#"
import sys, textwrap, importlib.util, pathlib, torch
out, marker = sys.argv[1], sys.argv[2]
src = textwrap.dedent(f'''
import torch
from typing import Tuple
class Evil(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
    def forward(self, x):
        return x * self.w
    @torch.jit.export
    def __getstate__(self) -> Tuple[torch.Tensor, bool]:
        return (self.w, self.training)
    @torch.jit.export
    def __setstate__(self, state: Tuple[torch.Tensor, bool]) -> None:
        self.training = state[1]
        t = torch.from_file({marker!r}, shared=True, size=3)
        self.w = state[0] + t * 0.0
''')
p = pathlib.Path(out + ".gen.py")
p.write_text(src)
spec = importlib.util.spec_from_file_location("evilmod", p)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
torch.jit.save(torch.jit.script(mod.Evil()), out)
p.unlink()
"#;

#[test]
fn a_torchscript_checkpoint_never_runs_its_code() {
    let (dir, cfg) = run_dir();
    let ckpt = dir.path().join("ckpt_000090.ts");
    let marker = dir.path().join("PWNED");
    py(EVIL_TS, &[&ckpt, &marker]);
    assert!(!marker.exists());
    let out = eval(&cfg, &[&ckpt], Duration::from_secs(300));
    assert!(!marker.exists(), "the checkpoint's __setstate__ ran");
    // Its weights are not where the architecture's are (a custom __getstate__): a clear
    // failure naming the file.
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("ckpt_000090.ts") && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn a_torchscript_checkpoint_gives_the_icr_of_the_same_weights_in_safetensors() {
    let (dir, cfg) = run_dir();
    let d = dir.path();
    py(
        "import sys, torch\n\
         from safetensors.torch import save_file\n\
         m = torch.jit.load(sys.argv[1])\n\
         sd = torch.load(sys.argv[2])\n\
         m.load_state_dict(sd)\n\
         torch.jit.save(m, sys.argv[3])\n\
         save_file({k: v.contiguous() for k, v in sd.items()}, sys.argv[4])",
        &[
            &d.join("model.ts"),
            &toy_run().join("ckpt_000060.pt"),
            &d.join("ckpt_000060.ts"),
            &d.join("ckpt_000060.safetensors"),
        ],
    );
    let out = eval(
        &cfg,
        &[
            &d.join("ckpt_000060.ts"),
            &d.join("ckpt_000060.safetensors"),
        ],
        Duration::from_secs(300),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let icr: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["icr"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(icr.len(), 2);
    assert!((icr[0] - icr[1]).abs() <= 1e-12 * icr[1].abs(), "{icr:?}");
}

/// Rewrites the TorchScript archive `src` into `dst` with its storage `data/1` cut in half.
const SHORT_STORAGE: &str = r#"
import sys, zipfile
zin = zipfile.ZipFile(sys.argv[1])
with zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_STORED) as zout:
    for info in zin.infolist():
        data = zin.read(info.filename)
        if info.filename.split("/")[1:] == ["data", "1"]:
            data = data[: len(data) // 2]
        zout.writestr(info.filename, data)
"#;

const SECRET: &str = "TOPSECRET-4242";

#[test]
fn hostile_checkpoints_are_recorded_failures_and_the_daemon_goes_on() {
    let run = empty_run();
    let dir = run.path();
    // 1: a TorchScript archive whose storage is shorter than its tensors declare.
    py(
        SHORT_STORAGE,
        &[&dir.join("model.ts"), &dir.join("short.src")],
    );
    // 3: a symlink to a secret file.
    let secret = dir.join("secret.txt");
    fs::write(&secret, format!("root:x:0:0:{SECRET}:/root:/bin/bash\n")).unwrap();
    // 2: a FIFO named like a checkpoint.
    let fifo = dir.join("ckpt_2.ts");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let cfg = dir.join("eval.yaml");
    fs::write(
        &cfg,
        "run: {dir: .}\nmodel: {architecture: model.ts}\ndevice: cpu\n\
         data: {path: train.h5, heldout_path: heldout.h5}\n\
         icr: {samples: 256, batch_size: 128, seed: 5}\n",
    )
    .unwrap();
    fs::rename(dir.join("short.src"), dir.join("ckpt_1.ts")).unwrap();
    std::os::unix::fs::symlink(&secret, dir.join("ckpt_3.ts")).unwrap();

    // `diffmon eval`: each is a clear error naming the file, promptly, without the secret.
    let out = eval(
        &cfg,
        &[&dir.join("ckpt_1.ts"), &fifo, &dir.join("ckpt_3.ts")],
        Duration::from_secs(120),
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("ckpt_1.ts") && err.contains("holds 1024 bytes but the checkpoint declares"),
        "{err}"
    );
    assert!(err.contains("ckpt_2.ts") && err.contains("FIFO"), "{err}");
    assert!(err.contains("ckpt_3.ts"), "{err}");
    assert!(!err.contains(SECRET) && !err.contains("root:"), "{err}");
    assert!(!err.contains("72 6f 6f 74"), "{err}");

    // The daemon records each file as a failure and evaluates the good checkpoint after them
    // (its watcher skips the FIFO: only regular files are candidates).
    fs::copy(dir.join("model.ts"), dir.join("ckpt_4.ts.tmp")).unwrap();
    let d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.ts\", settle_secs: 0.2, poll_secs: 0.5}\n",
    );
    fs::rename(dir.join("ckpt_4.ts.tmp"), dir.join("ckpt_4.ts")).unwrap();
    d.wait_for(
        Duration::from_secs(180),
        "two failures and one evaluation",
        |_| {
            let (evals, failures) = journal(dir);
            evals.len() + failures.len() >= 3
        },
    );
    let (evals, mut failures) = journal(dir);
    failures.sort();
    let reasons: Vec<(i64, &str)> = failures.iter().map(|(s, r)| (*s, r.as_str())).collect();
    assert_eq!(reasons, vec![(1, "unreadable"), (3, "unreadable")]);
    assert_eq!(evals, vec![4]);
    let journal_text = serde_json::to_string(&journal_entries(dir)).unwrap();
    assert!(!journal_text.contains(SECRET), "{journal_text}");
    let log = d.log();
    assert!(!log.contains(SECRET), "{log}");
}

/// Peak resident memory (KiB), exit code and stderr of a `diffmon eval` child, measured by GNU
/// time (`make setup` installs it) around that child alone. Not from this process's own `wait4`:
/// Linux carries a process's peak RSS across `exec`, so a child forked from this test binary
/// would report the binary's own peak (other tests in it may have loaded libtorch's CUDA
/// libraries, hundreds of MB) when that is higher than the child's.
fn eval_peak_rss(cfg: &Path, ckpt: &Path) -> (i64, i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let peak = dir.path().join("peak");
    let out = Command::new("/usr/bin/time")
        .arg("-o")
        .arg(&peak)
        .args(["-f", "%M"])
        .arg(env!("CARGO_BIN_EXE_diffmon"))
        .args(["eval", "--config", cfg.to_str().unwrap(), "--json"])
        .arg(ckpt)
        .env("DIFFMON_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let text = fs::read_to_string(&peak).unwrap();
    // GNU time writes "Command exited with non-zero status N" before the number then.
    let kib = text
        .lines()
        .last()
        .unwrap_or("")
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{text}"));
    let code = out.status.code().unwrap_or(-1);
    (kib, code, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_deflate_bomb_is_refused_with_bounded_memory() {
    let (dir, cfg) = run_dir();
    let bomb = dir.path().join("ckpt_000010.pt");
    // A torch.save of the architecture's first parameter (so that it passes the check of names
    // and shapes) whose storage entry is replaced by 1.5 GiB of zeros, deflated by Python's
    // zlib while streaming (to about 1.5 MB).
    py(
        "import sys, zipfile, torch, io\n\
         name, t = next(iter(torch.jit.load(sys.argv[2]).state_dict().items()))\n\
         buf = io.BytesIO(); torch.save({name: torch.zeros_like(t)}, buf)\n\
         zin = zipfile.ZipFile(buf)\n\
         zeros = bytes(1 << 20)\n\
         with zipfile.ZipFile(sys.argv[1], 'w', zipfile.ZIP_DEFLATED) as zout:\n\
         \x20   for info in zin.infolist():\n\
         \x20       if info.filename.endswith('/data/0'):\n\
         \x20           with zout.open(info.filename, 'w', force_zip64=True) as f:\n\
         \x20               for _ in range(1536): f.write(zeros)\n\
         \x20       else:\n\
         \x20           zout.writestr(info.filename, zin.read(info.filename))\n",
        &[&bomb, &dir.path().join("model.ts")],
    );
    assert!(fs::metadata(&bomb).unwrap().len() < 4 << 20);
    let (peak_kib, code, err) = eval_peak_rss(&cfg, &bomb);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("ckpt_000010.pt")
            && err.contains("holds more than")
            && err.contains("what its tensors declare"),
        "{err}"
    );
    // `diffmon eval` of a good checkpoint of this toy run peaks near 190 MiB (libtorch, the
    // model, the data); inflating the bomb would add 1.5 GiB. 400 MiB leaves room for the
    // baseline to grow and is far below what any inflation of the entry would take.
    assert!(peak_kib < 400 << 10, "peak RSS {peak_kib} KiB");
}

/// The 36-byte file of issue #29: a sharded index whose only shard is itself (it overflowed
/// the watcher's stack while checking its structure, at every start).
const SELF_NAMING_INDEX: &[u8] = br#"{"weight_map": {"a": "ckpt_000100.pt"}}"#;

/// A complete checkpoint of the toy run at `step` (copied, then renamed into place).
fn place_good(dir: &Path, step: i64) {
    let tmp = dir.join(format!("ckpt_{step:06}.pt.tmp"));
    fs::copy(toy_run().join("ckpt_000030.pt"), &tmp).unwrap();
    fs::rename(&tmp, dir.join(format!("ckpt_{step:06}.pt"))).unwrap();
}

#[test]
fn a_self_naming_index_is_a_recorded_failure_and_the_daemon_goes_on() {
    let (run, cfg) = run_dir();
    let dir = run.path();
    let index = dir.join("ckpt_000100.pt");
    fs::write(&index, SELF_NAMING_INDEX).unwrap();
    // `diffmon eval` and `diffmon init`: a clear error, no crash.
    let out = eval(&cfg, &[&index], Duration::from_secs(120));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("ckpt_000100.pt") && err.contains("the index names itself as a shard"),
        "{err}"
    );
    let out = crate::common::diffmon(&["init", "--run-dir", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));

    // The daemon: a failure, then the next good checkpoint is evaluated (renamed into place
    // after the start, so that the watcher checks both at once).
    fs::rename(&index, dir.join("index.tmp")).unwrap();
    let mut d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n",
    );
    fs::rename(dir.join("index.tmp"), &index).unwrap();
    place_good(dir, 200);
    d.wait_for(
        Duration::from_secs(180),
        "one failure and one evaluation",
        |_| {
            let (evals, failures) = journal(dir);
            evals.len() + failures.len() >= 2
        },
    );
    assert!(d.child.try_wait().unwrap().is_none(), "{}", d.log());
    let (evals, failures) = journal(dir);
    assert_eq!(
        failures,
        vec![(100, "unreadable".to_string())],
        "{}",
        d.log()
    );
    assert_eq!(evals, vec![200]);
    // A restart neither crashes nor looks at it again.
    d.restart();
    std::thread::sleep(Duration::from_secs(2));
    assert!(d.child.try_wait().unwrap().is_none(), "{}", d.log());
    assert_eq!(journal(dir).1.len(), 1);
}

/// Writes two hostile `torch.save` archives whose storage entries are `argv[4]` GiB of zeros
/// each, deflated (about 1 MB per GiB), with storages that declare the whole size:
/// - argv[1] (unless `-`): three tensors the architecture does not have (`a`, `b`, `c`), 3 MB
///   in all;
/// - argv[2]: one tensor named and shaped like the architecture's first parameter (argv[3]),
///   viewing that storage.
const DECLARED_GIB: &str = r#"
import sys, io, pickle, zipfile, collections, torch
multi, bomb, arch, gib = sys.argv[1:5]
name, t = next(iter(torch.jit.load(arch).state_dict().items()))
GIB = int(gib) << 28  # float32 elements
class Storage:
    def __init__(self, key, numel):
        self.key, self.numel = key, numel
class T:
    def __init__(self, storage, size):
        self.storage, self.size = storage, tuple(size)
    def __reduce__(self):
        stride, acc = [], 1
        for d in reversed(self.size):
            stride.insert(0, acc)
            acc *= d
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.size, tuple(stride), False, collections.OrderedDict()))
class P(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return ('storage', torch.FloatStorage, obj.key, 'cpu', obj.numel)
        return None
def write(path, tensors):
    sd = collections.OrderedDict()
    for i, (n, size) in enumerate(tensors):
        sd[n] = T(Storage(str(i), GIB), size)
    buf = io.BytesIO()
    P(buf, protocol=2).dump(sd)
    zeros = bytes(1 << 20)
    with zipfile.ZipFile(path, 'w', zipfile.ZIP_DEFLATED) as z:
        z.writestr('archive/data.pkl', buf.getvalue())
        z.writestr('archive/byteorder', 'little')
        for i in range(len(tensors)):
            with z.open(f'archive/data/{i}', 'w', force_zip64=True) as f:
                for _ in range(GIB >> 18):
                    f.write(zeros)
        z.writestr('archive/version', '3\n')
if multi != '-':
    write(multi, [('a', [GIB]), ('b', [GIB]), ('c', [GIB])])
write(bomb, [(name, list(t.shape))])
"#;

/// [`DECLARED_GIB`]'s two files for the architecture of `run` (`model.ts`), `gib` GiB each.
pub(crate) fn declared_gib(multi: &Path, bomb: &Path, run: &Path, gib: u32) {
    let out = Command::new(python())
        .arg("-c")
        .arg(DECLARED_GIB)
        .args([multi, bomb, &run.join("model.ts")])
        .arg(gib.to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Peak resident memory (KiB) of a `diffmon watch` over `dir` until the journal holds
/// `records` entries: the daemon's own high-water mark (`VmHWM` of /proc/PID/status, which
/// starts afresh at `exec`, unlike `wait4`'s, which carries this test binary's peak over), read
/// once the records are written, before the SIGTERM.
fn watch_peak_rss(dir: &Path, records: usize) -> (i64, Vec<i64>, Vec<(i64, String)>) {
    let d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n",
    );
    d.wait_for(Duration::from_secs(300), "the records", |_| {
        let (evals, failures) = journal(dir);
        evals.len() + failures.len() >= records
    });
    let status = fs::read_to_string(format!("/proc/{}/status", d.child.id())).unwrap();
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM in {status}"));
    drop(d);
    let (evals, failures) = journal(dir);
    (hwm, evals, failures)
}

#[test]
fn memory_for_a_checkpoint_is_bounded_by_the_architecture_in_eval_and_watch() {
    let (run, cfg) = run_dir();
    let dir = run.path();
    let multi = dir.join("ckpt_000100.pt");
    let bomb = dir.join("ckpt_000200.pt");
    declared_gib(&multi, &bomb, dir, 1);
    assert!(fs::metadata(&multi).unwrap().len() < 4 << 20);
    assert!(fs::metadata(&bomb).unwrap().len() < 2 << 20);
    // Baseline: `diffmon eval` of a good checkpoint of the same toy model.
    let good = toy_run().join("ckpt_000030.pt");
    let (base_kib, code, err) = eval_peak_rss(&cfg, &good);
    assert_eq!(code, 0, "{err}");
    // Each hostile file is refused before a storage is inflated: names first, then the total
    // bound (4 times the toy architecture's size, at least 64 MiB). Inflating would add 1 GiB
    // per entry (3.26 GB and 1.24 GB before). The bound: the baseline plus 64 MiB, room for
    // allocator noise and the small pickles read, far below one inflated entry.
    let bound = base_kib + (64 << 10);
    let (multi_kib, code, err) = eval_peak_rss(&cfg, &multi);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("unexpected (3): a, b, c"), "{err}");
    assert!(
        multi_kib < bound,
        "multi: {multi_kib} KiB, good: {base_kib} KiB"
    );
    let (bomb_kib, code, err) = eval_peak_rss(&cfg, &bomb);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("checkpoints.max_total_mib"), "{err}");
    assert!(
        bomb_kib < bound,
        "bomb: {bomb_kib} KiB, good: {base_kib} KiB"
    );
    eprintln!("eval peak RSS: good {base_kib} KiB, multi {multi_kib} KiB, bomb {bomb_kib} KiB");

    // `diffmon watch`: the same two files, then a good checkpoint; against a daemon that
    // evaluates only the good one.
    let base_run = empty_run();
    place_good(base_run.path(), 300);
    let (watch_base_kib, evals, _) = watch_peak_rss(base_run.path(), 1);
    assert_eq!(evals, vec![300]);
    place_good(dir, 300);
    let (watch_kib, evals, mut failures) = watch_peak_rss(dir, 3);
    failures.sort();
    assert_eq!(evals, vec![300]);
    assert_eq!(
        failures,
        vec![
            (100, "mismatch".to_string()),
            (200, "unreadable".to_string())
        ]
    );
    let watch_bound = watch_base_kib + (64 << 10);
    assert!(
        watch_kib < watch_bound,
        "watch: {watch_kib} KiB, good only: {watch_base_kib} KiB"
    );
    eprintln!("watch peak RSS: {watch_kib} KiB, good only {watch_base_kib} KiB");
}
