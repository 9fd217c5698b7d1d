//! Shared fixtures: written once per test run by `python/make_fixtures.py`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn python() -> PathBuf {
    root().join(".venv/bin/python")
}

/// Runs a Python script of the project with the project's helpers importable.
pub fn run_python(args: &[&str]) -> Output {
    let out = Command::new(python())
        .args(args)
        .env("PYTHONPATH", root().join("python"))
        .current_dir(root())
        .output()
        .expect("run the project's Python (make setup creates .venv)");
    assert!(
        out.status.success(),
        "python {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The fixture folder (models, checkpoints in every format, reference outputs, HDF5 images).
pub fn fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        run_python(&["python/make_fixtures.py", dir.path().to_str().unwrap()]);
        dir
    })
    .path()
}

/// The release binary built with the tests.
pub fn diffmon(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(args)
        .env("DIFFMON_LOG", "warn")
        .output()
        .expect("run diffmon")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A small data-limited toy run (trained by `python/train_toy.py`), shared by the tests.
pub fn toy_run() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        run_python(&[
            "python/train_toy.py",
            "--run-dir",
            dir.path().to_str().unwrap(),
            "--train-size",
            "64",
            "--heldout-size",
            "256",
            "--width",
            "16",
            "--steps",
            "60",
            "--ckpt-every",
            "30",
        ]);
        dir
    })
    .path()
}

/// Reads a float dataset of an HDF5 file as a CPU tensor.
pub fn h5_tensor(path: &Path, name: &str) -> tch::Tensor {
    let file = hdf5::File::open(path).unwrap();
    let ds = file.dataset(name).unwrap();
    let shape: Vec<i64> = ds.shape().iter().map(|&d| d as i64).collect();
    let v: Vec<f32> = ds.read_raw().unwrap();
    tch::Tensor::from_slice(&v).reshape(shape)
}

/// A plain HTTP/1.0 GET: the body when the status is 200.
pub fn http_get(url: &str) -> Option<String> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = match rest.split_once('/') {
        Some((h, p)) => (h, format!("/{p}")),
        None => (rest, "/".to_string()),
    };
    let mut s = std::net::TcpStream::connect(host).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.split(' ')
        .nth(1)
        .is_some_and(|code| code == "200")
        .then(|| body.to_string())
}
