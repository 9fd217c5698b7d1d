//! The compiled network: `diffmon-export --compile`'s AOTInductor package against the
//! TorchScript file of the same checkpoint, through the `Model` and through `diffmon eval`, and
//! packages that must be refused. The packages are compiled once (30 to 60 s on a CPU) and kept
//! under `target/compiled-fixture/<hash of the sources that make them>/`.

use crate::common::{diffmon, root, run_python, stderr, stdout, toy_run};
use diffmon::config::{CompiledSetting, Precision};
use diffmon::engine::model::{Model, compiled};
use diffmon::weights::ReadOptions;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};

/// The fixture folder of `python/compiled_fixture.py`, made once per change of its sources (or
/// of torch).
fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        use sha2::Digest;
        let mut hash = sha2::Sha256::new();
        let mut sources: Vec<PathBuf> = [
            "python/compiled_fixture.py",
            "python/diffmon/compile.py",
            "python/train_toy.py",
        ]
        .iter()
        .map(|f| root().join(f))
        .collect();
        // The exporter's package, every module of it, in a fixed order.
        let mut export: Vec<PathBuf> = std::fs::read_dir(root().join("python/diffmon/export"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "py"))
            .collect();
        export.sort();
        sources.extend(export);
        for f in sources {
            hash.update(std::fs::read(f).unwrap());
        }
        hash.update(compiled::torch_version());
        let key = format!("{:x}", hash.finalize());
        let dir = root().join("target/compiled-fixture").join(&key[..16]);
        if !dir.join("done").is_file() {
            let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
            run_python(&["python/compiled_fixture.py", tmp.to_str().unwrap()]);
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::rename(&tmp, &dir).unwrap();
        }
        dir
    })
}

fn model(arch: &Path, setting: CompiledSetting) -> Model {
    let mut m = Model::load(arch, Device::Cpu).unwrap();
    m.set_precision(Precision::Fp32);
    m.use_compiled(&setting).unwrap();
    m
}

/// Noisy images at a spread of noise levels, the same for every format.
fn draws(n: i64) -> (Tensor, Tensor) {
    tch::manual_seed(11);
    let x = Tensor::randn([n, 1, 16, 16], (Kind::Float, Device::Cpu));
    let sigma = Tensor::linspace(-3.0, 3.0, n, (Kind::Float, Device::Cpu)).exp();
    (x, sigma)
}

/// max |a − b| / max |b|.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let scale = b.abs().max().double_value(&[]);
    (a - b).abs().max().double_value(&[]) / scale
}

/// fp32 compiled against fp32 TorchScript of the same weights, on identical draws (a short
/// batch padded, a long one in parts): within 1e-5 relative (measured about 1e-7 on this CPU:
/// the same float32 arithmetic, fused and reordered). The package swapped to a checkpoint's
/// weights gives what a package compiled fresh from that checkpoint gives, and what its
/// TorchScript gives; before the swap it gives something else.
#[test]
fn the_compiled_package_matches_torchscript_and_follows_checkpoints() {
    let dir = fixture();
    let arch = dir.join("arch.ts");
    let ckpt = dir.join("ckpt_b.pt");
    let mut swapped = model(&arch, CompiledSetting::Auto);
    assert!(
        swapped.format().starts_with("compiled package"),
        "{}",
        swapped.format()
    );
    let mut script = model(&arch, CompiledSetting::Off);
    assert!(script.format().contains("off"), "{}", script.format());
    let fresh = model(&dir.join("b.ts"), CompiledSetting::Path(dir.join("b.pt2")));
    let fresh_script = model(&dir.join("b.ts"), CompiledSetting::Off);
    let mut worst: f64 = 0.0;
    let (x, sigma) = draws(2);
    let (before, _) = swapped.forward(&x, &sigma).unwrap();
    let (want, _) = fresh.forward(&x, &sigma).unwrap();
    assert!(
        rel(&before, &want) > 1e-3,
        "the architecture's weights and the checkpoint's give the same outputs"
    );
    let started = std::time::Instant::now();
    swapped
        .load_weights(&ckpt, &ReadOptions::default())
        .unwrap();
    eprintln!("checkpoint read and swapped in {:?}", started.elapsed());
    script.load_weights(&ckpt, &ReadOptions::default()).unwrap();
    for n in [1, 2, 5, 64] {
        let (x, sigma) = draws(n);
        let (d, f) = swapped.forward(&x, &sigma).unwrap();
        let (d_ts, f_ts) = script.forward(&x, &sigma).unwrap();
        let (d_fresh, f_fresh) = fresh.forward(&x, &sigma).unwrap();
        let (d_fts, f_fts) = fresh_script.forward(&x, &sigma).unwrap();
        assert_eq!(d.size(), d_ts.size());
        assert_eq!(f.size(), f_ts.size());
        for (what, got) in [
            ("swapped vs TorchScript, denoised", rel(&d, &d_ts)),
            ("swapped vs TorchScript, features", rel(&f, &f_ts)),
            ("swapped vs fresh package, denoised", rel(&d, &d_fresh)),
            ("swapped vs fresh package, features", rel(&f, &f_fresh)),
            ("fresh package vs its TorchScript", rel(&d_fresh, &d_fts)),
            (
                "fresh package vs its TorchScript, features",
                rel(&f_fresh, &f_fts),
            ),
        ] {
            assert!(got <= 1e-5, "batch {n}: {what}: {got:e}");
            worst = worst.max(got);
        }
    }
    eprintln!("compiled vs TorchScript: worst relative difference {worst:e}");
}

fn write_config(dir: &Path, name: &str, arch: &Path, compiled: &str) -> PathBuf {
    let run = toy_run();
    let cfg = dir.join(name);
    std::fs::write(
        &cfg,
        format!(
            "run: {{dir: {run:?}}}\nmodel: {{architecture: {arch:?}, compiled: {compiled}}}\n\
             device: cpu\ndata: {{path: {train:?}, heldout_path: {heldout:?}}}\n\
             icr: {{samples: 256, batch_size: 100, seed: 5}}\n",
            train = run.join("train.h5"),
            heldout = run.join("heldout.h5"),
        ),
    )
    .unwrap();
    cfg
}

/// `diffmon eval --json` of `ckpt`, its temporary folder the config's (where libtorch unpacks a
/// package).
fn eval(cfg: &Path, ckpt: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(["eval", "--config", cfg.to_str().unwrap()])
        .args([ckpt.to_str().unwrap(), "--json"])
        .env("DIFFMON_LOG", "warn")
        .env("TMPDIR", cfg.parent().unwrap())
        .output()
        .expect("run diffmon")
}

/// export → compile → `diffmon eval` on a trained toy's checkpoint: ICR, its traces, the losses
/// and the gap of the compiled network agree with TorchScript's to 1e-5 relative (batches of
/// 100 leave a short last batch); check-config says which format runs and why.
#[test]
fn eval_with_the_compiled_package_gives_torchscripts_numbers() {
    let dir = fixture();
    let tmp = tempfile::tempdir().unwrap();
    let arch = dir.join("arch.ts");
    let pkg = format!("{:?}", dir.join("arch.pt2"));
    let compiled = write_config(tmp.path(), "compiled.yaml", &arch, &pkg);
    let script = write_config(tmp.path(), "script.yaml", &arch, "off");
    let checked = diffmon(&["check-config", compiled.to_str().unwrap()]);
    assert!(checked.status.success(), "{}", stderr(&checked));
    assert!(
        stdout(&checked).contains("compiled package"),
        "{}",
        stdout(&checked)
    );
    let checked = diffmon(&["check-config", script.to_str().unwrap()]);
    assert!(stdout(&checked).contains("TorchScript (model.compiled: off)"));
    let ckpt = toy_run().join("ckpt_000060.pt");
    let record = |cfg: &Path| -> Value {
        let out = eval(cfg, &ckpt);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap()
    };
    let (c, s) = (record(&compiled), record(&script));
    for key in [
        "icr",
        "icr_invariant_trace",
        "icr_residual_trace",
        "loss_train",
        "loss_heldout",
        "generalization_gap",
    ] {
        let (a, b) = (c[key].as_f64().unwrap(), s[key].as_f64().unwrap());
        let r = (a - b).abs() / b.abs().max(1e-12);
        eprintln!("{key}: compiled {a}, TorchScript {b}, relative {r:e}");
        assert!(r <= 1e-5, "{key}: compiled {a}, TorchScript {b} ({r:e})");
    }
}

/// A copy of the fixture's architecture and package in a folder of the test's, to spoil.
fn spoilable() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let arch = tmp.path().join("arch.ts");
    let pkg = tmp.path().join("arch.pt2");
    std::fs::copy(fixture().join("arch.ts"), &arch).unwrap();
    std::fs::copy(fixture().join("arch.pt2"), &pkg).unwrap();
    std::fs::copy(
        fixture().join("arch.pt2.json"),
        compiled::sidecar_path(&pkg),
    )
    .unwrap();
    (tmp, arch, pkg)
}

/// A run folder for `diffmon watch` with the fixture's package beside its architecture
/// ([`spoilable`]), the toy run's data and one checkpoint, `ckpt_000010.pt`.
struct PackageRun {
    tmp: tempfile::TempDir,
    pkg: PathBuf,
    config: PathBuf,
    port: u16,
}

impl PackageRun {
    fn new() -> PackageRun {
        let (tmp, _arch, pkg) = spoilable();
        let dir = tmp.path();
        for f in ["train.h5", "heldout.h5"] {
            std::fs::copy(toy_run().join(f), dir.join(f)).unwrap();
        }
        std::fs::copy(fixture().join("ckpt_b.pt"), dir.join("ckpt_000010.pt")).unwrap();
        let config = dir.join("diffmon.yaml");
        let port = crate::daemon::free_port();
        PackageRun {
            tmp,
            pkg,
            config,
            port,
        }
    }

    fn dir(&self) -> &Path {
        self.tmp.path()
    }

    /// Spoils the package's sidecar: it claims the shared object holds the weights and leaves
    /// one out, so the package's first forward reads memory nothing wrote (a SIGSEGV every time
    /// on this CPU).
    fn spoil(&self) {
        let sidecar = compiled::sidecar_path(&self.pkg);
        let mut spoiled: Value =
            serde_json::from_str(&std::fs::read_to_string(&sidecar).unwrap()).unwrap();
        spoiled["weights_inside"] = Value::Bool(true);
        spoiled["weights"].as_array_mut().unwrap().remove(0);
        std::fs::write(&sidecar, spoiled.to_string()).unwrap();
    }

    /// Starts `diffmon watch --config <config>`, which must end within two minutes (crash or
    /// refuse to start): its status and log. Its temporary folder is the run's, where a crash
    /// leaves libtorch's unpacked copy of the package.
    fn start_that_ends(&self, config: &Path) -> (std::process::ExitStatus, String) {
        let log = self.dir().join("start.log");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_diffmon"))
            .args(["watch", "--config", config.to_str().unwrap()])
            .env("TMPDIR", self.dir())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let status = crate::daemon::exited_within(&mut child, std::time::Duration::from_secs(120));
        let _ = child.kill();
        let log = std::fs::read_to_string(log).unwrap();
        (status.expect("the start neither crashed nor stopped"), log)
    }

    /// Starts `diffmon watch` under `model.compiled: auto` with the package refused by its trial
    /// and returns it once it has evaluated a checkpoint with TorchScript, warning why.
    fn watch_refused(&self) -> crate::daemon::Daemon {
        let d = crate::daemon::Daemon::spawn(self.config.clone(), self.port);
        d.wait_for(std::time::Duration::from_secs(120), "an evaluation", |d| {
            d.evaluated() >= 1.0
        });
        let log = d.log();
        assert!(
            log.contains("TorchScript (model.compiled: auto; ")
                && log.contains("the last 2 starts of diffmon died"),
            "{log}"
        );
        d
    }

    /// Writes the config with `model.compiled: <compiled>`, `icr.samples: <samples>` and
    /// `extra`.
    fn configure(&self, compiled: &str, samples: u32, extra: &str) {
        std::fs::write(
            &self.config,
            format!(
                "run: {{dir: ., name: test}}\nmodel: {{architecture: arch.ts, compiled: {compiled}}}\n\
                 device: cpu\ndata: {{path: train.h5, heldout_path: heldout.h5}}\n\
                 http: {{listen: \"127.0.0.1:{}\"}}\n\
                 icr: {{samples: {samples}, batch_size: 256}}\n\
                 checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{extra}",
                self.port
            ),
        )
        .unwrap();
    }
}

/// `pkg` written again entry by entry, each entry's bytes as `edit` gives them, then `extra`.
fn rezip(pkg: &Path, edit: &dyn Fn(&str, Vec<u8>) -> Vec<u8>, extra: &[(&str, &[u8])]) {
    use std::io::{Read, Write};
    let mut from = zip::ZipArchive::new(std::fs::File::open(pkg).unwrap()).unwrap();
    let mut entries = Vec::new();
    for i in 0..from.len() {
        let mut entry = from.by_index(i).unwrap();
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes).unwrap();
        entries.push((entry.name().to_string(), bytes));
    }
    let prefix = entries[0].0.split('/').next().unwrap().to_string();
    let mut to = zip::ZipWriter::new(std::fs::File::create(pkg).unwrap());
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, bytes) in entries {
        to.start_file(name.as_str(), stored).unwrap();
        to.write_all(&edit(&name, bytes)).unwrap();
    }
    for (name, bytes) in extra {
        to.start_file(format!("{prefix}/{name}"), stored).unwrap();
        to.write_all(bytes).unwrap();
    }
    to.finish().unwrap();
}

/// Hostile and mismatched packages: writable by others, truncated, random bytes, an entry that
/// would be unpacked outside libtorch's folder, a shared object that is no library, a sidecar
/// others can write, another torch, another architecture. Named by path, each is an error of
/// `eval` (exit 2) naming the file and the rebuild command, and of `check-config` where the
/// vetting before the load finds it; under `auto`, TorchScript runs with a warning that says
/// why. Never a crash, and nothing written outside.
#[test]
fn bad_packages_are_refused_with_the_rebuild_command() {
    let ckpt = toy_run().join("ckpt_000060.pt");
    type Spoil<'a> = (&'a str, &'a dyn Fn(&Path, &Path), &'a str);
    let spoil: [Spoil; 8] = [
        (
            "writable",
            &|pkg, _| {
                std::fs::set_permissions(pkg, std::fs::Permissions::from_mode(0o666)).unwrap()
            },
            "writable by others",
        ),
        (
            "truncated",
            &|pkg, _| {
                let bytes = std::fs::read(pkg).unwrap();
                std::fs::write(pkg, &bytes[..bytes.len() / 2]).unwrap();
            },
            "not a compiled package (a zip archive)",
        ),
        (
            "random",
            &|pkg, _| std::fs::write(pkg, vec![0x5a_u8; 4096]).unwrap(),
            "not a compiled package (a zip archive)",
        ),
        (
            "outside",
            &|pkg, _| {
                // Enough `..` to reach `/` from libtorch's folder, then this test's own.
                let escape = format!(
                    "data/aotinductor/model/{}{}/escaped.txt",
                    "../".repeat(16),
                    pkg.parent().unwrap().display()
                );
                rezip(pkg, &|_, b| b, &[(escape.as_str(), b"escaped")]);
            },
            "would be unpacked outside libtorch's folder",
        ),
        (
            "library",
            &|pkg, _| {
                // An ELF header, then no library.
                let edit = |name: &str, mut b: Vec<u8>| {
                    if name.ends_with(".so") {
                        b[64..].fill(0x5a);
                    }
                    b
                };
                rezip(pkg, &edit, &[]);
            },
            "libtorch cannot load it",
        ),
        (
            "sidecar",
            &|pkg, _| {
                let side = compiled::sidecar_path(pkg);
                std::fs::set_permissions(side, std::fs::Permissions::from_mode(0o666)).unwrap()
            },
            "writable by others (mode 666): a sidecar says what memory",
        ),
        (
            "torch",
            &|pkg, _| {
                let side = compiled::sidecar_path(pkg);
                let mut v: Value =
                    serde_json::from_str(&std::fs::read_to_string(&side).unwrap()).unwrap();
                v["torch"] = "2.11.0-not-this".into();
                std::fs::write(&side, v.to_string()).unwrap();
            },
            "compiled by torch 2.11.0-not-this",
        ),
        (
            "architecture",
            &|_, arch| {
                std::fs::copy(toy_run().join("model.ts"), arch).unwrap();
            },
            "another architecture file",
        ),
    ];
    for (name, spoil, says) in spoil {
        let (tmp, arch, pkg) = spoilable();
        spoil(&pkg, &arch);
        let explicit = write_config(tmp.path(), "path.yaml", &arch, &format!("{pkg:?}"));
        let out = eval(&explicit, &ckpt);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{name}: {err} {}", stdout(&out));
        assert!(err.contains(says), "{name}: {err}");
        assert!(err.contains(&pkg.display().to_string()), "{name}: {err}");
        // A refusal carries the rebuild command of a sidecar that is trusted.
        assert_eq!(
            err.contains("compiled_fixture.py"),
            name != "sidecar",
            "{name}: rebuild: {err}"
        );
        assert!(
            !tmp.path().join("escaped.txt").exists(),
            "{name}: unpacked outside"
        );
        // A package libtorch unpacked and could not load leaves no unpacked copy.
        let unpacked = std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("aotinductor_"))
            .count();
        assert_eq!(unpacked, 0, "{name}: libtorch's unpacked copy was left");
        // check-config vets without opening the package (no native code runs there): what only
        // libtorch's loader finds (a shared object that is no library) shows at the start of
        // eval and watch.
        let opened = says.starts_with("libtorch");
        let checked = diffmon(&["check-config", explicit.to_str().unwrap()]);
        let want = if opened { 0 } else { 2 };
        assert_eq!(
            checked.status.code(),
            Some(want),
            "{name}: {}",
            stderr(&checked)
        );
        let auto = write_config(tmp.path(), "auto.yaml", &arch, "auto");
        let out = eval(&auto, &ckpt);
        let err = stderr(&out);
        assert!(out.status.success(), "{name}: auto: {err}");
        assert!(
            err.contains("WARN") && err.contains("TorchScript (model.compiled: auto;"),
            "{name}: auto: {err}"
        );
        assert!(err.contains(says), "{name}: auto: {err}");
        let checked = diffmon(&["check-config", auto.to_str().unwrap()]);
        let text = stdout(&checked);
        assert_eq!(
            text.contains("TorchScript (model.compiled: auto;") && text.contains(says),
            !opened,
            "{name}: {text}"
        );
    }
}

/// A package that holds no tensor of its own (the exporter takes them out): an epsilon
/// network's, whose VP schedule table is a constant of the graph. diffmon gives it the
/// constants file and the architecture's weights before it runs, and each checkpoint's weights
/// after: fp32 within 1e-5 relative of TorchScript (as above) before and after a checkpoint.
#[test]
fn a_package_without_weights_runs_on_its_constants_file_and_each_checkpoint() {
    let dir = fixture();
    let side: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("eps.pt2.json")).unwrap()).unwrap();
    assert_eq!(side["weights_inside"], false);
    let table = &side["constants"]["tensors"]["_tensor_constant0"];
    assert_eq!(table["shape"], serde_json::json!([1000]), "{side}");
    let arch = dir.join("eps.ts");
    let mut compiled = model(&arch, CompiledSetting::Path(dir.join("eps.pt2")));
    assert!(compiled.format().starts_with("compiled package"));
    let mut script = model(&arch, CompiledSetting::Off);
    let ckpt = dir.join("ckpt_eps.pt");
    let (x, sigma) = draws(5);
    let (before, _) = compiled.forward(&x, &sigma).unwrap();
    for checkpoint in [None, Some(&ckpt)] {
        if let Some(c) = checkpoint {
            compiled.load_weights(c, &ReadOptions::default()).unwrap();
            script.load_weights(c, &ReadOptions::default()).unwrap();
        }
        let (d, f) = compiled.forward(&x, &sigma).unwrap();
        let (d_ts, f_ts) = script.forward(&x, &sigma).unwrap();
        let (rd, rf) = (rel(&d, &d_ts), rel(&f, &f_ts));
        eprintln!("eps package vs TorchScript ({checkpoint:?}): {rd:e}, {rf:e}");
        assert!(rd <= 1e-5 && rf <= 1e-5, "{checkpoint:?}: {rd:e} {rf:e}");
    }
    let (after, _) = compiled.forward(&x, &sigma).unwrap();
    assert!(
        rel(&before, &after) > 1e-3,
        "the checkpoint changed nothing"
    );
}

/// The constants file is trusted like the package and bound to its sidecar: missing, changed,
/// writable by others, or a constant the sidecar leaves out is a refusal naming the file (an
/// error under a path, TorchScript with a warning under `auto`), never a package that reads
/// memory nothing wrote.
#[test]
fn a_bad_constants_file_is_refused() {
    type Spoil<'a> = (&'a str, &'a dyn Fn(&Path), &'a str);
    let spoils: [Spoil; 4] = [
        (
            "missing",
            &|pkg| std::fs::remove_file(compiled::constants_path(pkg)).unwrap(),
            "cannot read it",
        ),
        (
            "changed",
            &|pkg| {
                let path = compiled::constants_path(pkg);
                let mut bytes = std::fs::read(&path).unwrap();
                let n = bytes.len();
                bytes[n / 2] ^= 1;
                std::fs::write(&path, bytes).unwrap();
            },
            "not the file its sidecar was written with",
        ),
        (
            "writable",
            &|pkg| {
                let path = compiled::constants_path(pkg);
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o664)).unwrap()
            },
            "writable by its group (mode 664): a constants file holds what the package's kernels read",
        ),
        (
            "unnamed",
            &|pkg| {
                let side = compiled::sidecar_path(pkg);
                let mut v: Value =
                    serde_json::from_str(&std::fs::read_to_string(&side).unwrap()).unwrap();
                v["constants"]["tensors"] = serde_json::json!({});
                std::fs::write(&side, v.to_string()).unwrap();
            },
            "neither its weights nor its constants file give",
        ),
    ];
    for (name, spoil, says) in spoils {
        let tmp = tempfile::tempdir().unwrap();
        let (arch, pkg) = (tmp.path().join("eps.ts"), tmp.path().join("eps.pt2"));
        for (from, to) in [
            ("eps.ts", arch.clone()),
            ("eps.pt2", pkg.clone()),
            ("eps.pt2.json", compiled::sidecar_path(&pkg)),
            ("eps.pt2.constants", compiled::constants_path(&pkg)),
        ] {
            std::fs::copy(fixture().join(from), to).unwrap();
        }
        spoil(&pkg);
        let mut m = Model::load(&arch, Device::Cpu).unwrap();
        m.set_precision(Precision::Fp32);
        let err = m
            .use_compiled(&CompiledSetting::Path(pkg.clone()))
            .err()
            .unwrap_or_else(|| panic!("{name}: loaded"))
            .to_string();
        assert!(err.contains(says), "{name}: {err}");
        assert!(err.contains(&pkg.display().to_string()), "{name}: {err}");
        assert!(err.contains("compiled_fixture.py"), "{name}: {err}");
        let format = m.use_compiled(&CompiledSetting::Auto).unwrap().to_string();
        assert!(
            format.starts_with("TorchScript (model.compiled: auto;") && format.contains(says),
            "{name}: {format}"
        );
    }
}

/// A package that crashes the daemon's start crashes two starts, not every one (a service
/// manager restarts a crashed daemon). The package is the fixture's with its sidecar spoiled so
/// that it claims the shared object holds its weights and leaves one out: the daemon never fills
/// that weight and the package's first forward reads memory nothing wrote, a SIGSEGV every time
/// on this CPU. Each start puts the package on trial (`<state>/compiled-trial`); the third finds
/// it there at two starts and runs TorchScript under `auto`, with a warning naming the package
/// and the trial file, and evaluates; named by path, the package stops that start with the same
/// reason (exit 2, no crash). check-config says the same before any start. A rebuilt package (another modification time) gets a trial of
/// its own, passes it at the start, and its trial file is removed.
#[test]
fn a_package_that_crashes_the_start_is_tried_twice_then_refused() {
    use crate::daemon::Daemon;
    use std::os::unix::process::ExitStatusExt;
    let run = PackageRun::new();
    let (dir, pkg, config, port) = (run.dir(), &run.pkg, &run.config, run.port);
    let sidecar = compiled::sidecar_path(pkg);
    run.spoil();
    let write_config = |compiled: &str| run.configure(compiled, 256, "");
    let watch = || run.start_that_ends(config);
    let trial = dir.join(".diffmon/compiled-trial");
    write_config("auto");
    for start in 1..=2 {
        let (status, log) = watch();
        assert_eq!(status.signal(), Some(libc::SIGSEGV), "start {start}: {log}");
        let text = std::fs::read_to_string(&trial).unwrap();
        assert!(text.contains(&format!("\"starts\":{start}")), "{text}");
    }

    let reason = [
        pkg.to_str().unwrap(),
        "the last 2 starts of diffmon died",
        trial.to_str().unwrap(),
    ];
    let check = diffmon(&["check-config", config.to_str().unwrap()]);
    assert!(check.status.success(), "{}", stderr(&check));
    let said = stdout(&check);
    assert!(
        said.contains("TorchScript (model.compiled: auto; "),
        "{said}"
    );
    assert!(reason.iter().all(|r| said.contains(r)), "{said}");

    // Named by path: refused, the start stops with the reason (exit 2, as for every package
    // that does not fit), and check-config says so.
    write_config(&format!("{pkg:?}"));
    let (status, log) = watch();
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(reason.iter().all(|r| log.contains(r)), "{log}");
    let check = diffmon(&["check-config", config.to_str().unwrap()]);
    assert_eq!(check.status.code(), Some(2), "{}", stdout(&check));
    let said = format!("{}{}", stdout(&check), stderr(&check));
    assert!(reason.iter().all(|r| said.contains(r)), "{said}");

    // Under `auto`: TorchScript runs, with the warning, and evaluates.
    write_config("auto");
    run.watch_refused().terminate();

    // Rebuilt (copied anew: another modification time) with its own sidecar: a trial of its
    // own, passed at the start; the trial file is gone and the package runs.
    std::fs::copy(fixture().join("arch.pt2"), pkg).unwrap();
    std::fs::copy(fixture().join("arch.pt2.json"), &sidecar).unwrap();
    let mut d = Daemon::spawn(config.clone(), port);
    assert!(!trial.exists(), "the passed trial's file is still there");
    assert!(d.log().contains("network=compiled package"), "{}", d.log());
    d.terminate();
}

/// A package that crashes the daemon in its first evaluation (a kernel that fails on a
/// checkpoint's weights, where the start's contract check passed) costs the package, not the
/// checkpoint: the crash marker names the package on trial, the next start evaluates the
/// checkpoint again instead of recording it as `crashed`, and after two such deaths the package is
/// refused and TorchScript evaluates it under `auto`. The crash is a real SIGSEGV delivered to
/// the daemon while the package runs the evaluation (the marker's handler does not tell who
/// raised it).
#[test]
fn a_package_that_crashes_its_first_evaluation_is_blamed_not_the_checkpoint() {
    use crate::daemon::{Daemon, exited_within, journal};
    use std::os::unix::process::ExitStatusExt;
    use std::time::Duration;
    let run = PackageRun::new();
    let (dir, config, port) = (run.dir(), &run.config, run.port);
    // 2^20 view pairs: an evaluation far longer than the test takes to deliver the signal.
    run.configure("auto", 1 << 20, "");
    let trial = dir.join(".diffmon/compiled-trial");
    let mut logs = Vec::new();
    for died in 1..=2 {
        let mut d = Daemon::spawn(config.clone(), port);
        d.wait_for_evaluation_of("ckpt_000010.pt");
        assert!(d.log().contains("network=compiled package"), "{}", d.log());
        // SAFETY: kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(d.child.id() as i32, libc::SIGSEGV) }, 0);
        let status = exited_within(&mut d.child, Duration::from_secs(60));
        assert_eq!(status.and_then(|s| s.signal()), Some(libc::SIGSEGV));
        let text = std::fs::read_to_string(&trial).unwrap();
        assert!(text.contains(&format!("\"starts\":{died}")), "{text}");
        logs.push(d.log());
    }
    // The second start blamed the package for the first death, not the checkpoint.
    assert!(
        logs[1].contains("ran on trial: the package is blamed, not the checkpoint"),
        "{}",
        logs[1]
    );

    run.configure("auto", 256, "");
    let mut d = run.watch_refused();
    let log = d.log();
    d.terminate();
    let (evals, failures) = journal(dir);
    assert_eq!(evals, vec![10], "{log}");
    assert!(
        failures.is_empty(),
        "nothing recorded as crashed: {failures:?}"
    );
}

/// The same on the Slurm executor, whose jobs each run `diffmon eval`: a job that dies while the
/// package runs on trial (in the job's folder, `package-on-trial` names it) died of the package,
/// not of its checkpoint; it is submitted again beyond `evaluation.retries` (1 here), the trial
/// (in the run's state folder, shared by the jobs) refuses the package at two such deaths, and
/// the third job evaluates the checkpoint with TorchScript. Before, the first job's status 139
/// was the checkpoint's failure. The package is the one whose sidecar is spoiled (a SIGSEGV in
/// its first forward, every time).
#[test]
fn a_slurm_job_killed_by_a_package_on_trial_is_submitted_again_and_nothing_is_lost() {
    use crate::daemon::{Daemon, journal};
    use std::time::Duration;
    let Some(cluster) = crate::slurm_cluster::Cluster::start() else {
        return;
    };
    let run = PackageRun::new();
    run.spoil();
    run.configure(
        "auto",
        256,
        "evaluation: {executor: slurm, slurm: {poll_secs: 0.5}}\n",
    );
    let conf = format!("SLURM_CONF={}", cluster.conf.display());
    // The jobs get the daemon's environment: the crashed ones leave libtorch's unpacked copy
    // of the package in the run's folder.
    let tmp = format!("TMPDIR={}", run.dir().display());
    let d = Daemon::spawn_wrapped(run.config.clone(), run.port, &["env", &conf, &tmp]);
    d.wait_for(Duration::from_secs(300), "the checkpoint's outcome", |_| {
        !journal_is_empty(run.dir())
    });
    let log = d.log();
    assert_eq!(journal(run.dir()), (vec![10], vec![]), "{log}");
    assert_eq!(
        d.metric("diffmon_slurm_jobs_failed_total{run=\"test\",reason=\"failed\"}"),
        Some(2.0),
        "{log}"
    );
    assert!(
        log.contains("while the compiled package ran on trial"),
        "{log}"
    );
    // The third job ran TorchScript: its output says why.
    let jobs: Vec<_> = std::fs::read_dir(run.dir().join(".diffmon/jobs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(jobs.len(), 3, "{jobs:?}");
    let refused = jobs.iter().any(|j| {
        std::fs::read_dir(j).unwrap().any(|f| {
            std::fs::read_to_string(f.unwrap().path())
                .is_ok_and(|t| t.contains("the last 2 starts of diffmon died"))
        })
    });
    assert!(refused, "no job's output says the package was refused");
}

fn journal_is_empty(dir: &Path) -> bool {
    crate::daemon::journal_entries(dir).is_empty()
}

/// A sweep whose runs share the network shares its package's trial, kept in the first run's state
/// folder whichever run's evaluator loads it, and `check-config` reads that file: after two
/// starts the package crashed, it reports the refusal. (The trial was in the folder of the run
/// armed last, the sweep's last run, while `check-config` read the first's.)
#[test]
fn a_sweep_keeps_its_package_trial_in_its_first_runs_state_folder() {
    use std::os::unix::process::ExitStatusExt;
    let run = PackageRun::new();
    run.spoil();
    let dir = run.dir();
    for name in ["ra", "rb"] {
        std::fs::create_dir(dir.join(name)).unwrap();
    }
    let config = dir.join("sweep.yaml");
    std::fs::write(
        &config,
        format!(
            "model: {{architecture: arch.ts, compiled: auto}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\n\
             icr: {{samples: 256, batch_size: 256}}\n\
             http: {{listen: \"127.0.0.1:{}\"}}\n\
             runs:\n  - {{name: ra, dir: ra}}\n  - {{name: rb, dir: rb}}\n",
            run.port
        ),
    )
    .unwrap();
    for start in 1..=2 {
        let (status, log) = run.start_that_ends(&config);
        assert_eq!(status.signal(), Some(libc::SIGSEGV), "start {start}: {log}");
    }
    let trial = std::fs::read_to_string(dir.join("ra/.diffmon/compiled-trial")).unwrap();
    assert!(trial.contains("\"starts\":2"), "{trial}");
    assert!(!dir.join("rb/.diffmon/compiled-trial").exists());
    let check = diffmon(&["check-config", config.to_str().unwrap()]);
    assert!(check.status.success(), "{}", stderr(&check));
    let said = stdout(&check);
    assert!(
        said.contains("TorchScript (model.compiled: auto; ")
            && said.contains("the last 2 starts of diffmon died"),
        "{said}"
    );
}
