//! Checkpoints as real training stacks write them (issue #16), read as data: `torch.save(model)`
//! module trees, EDM-style network snapshots (plain pickle) and training states, Lightning
//! `.ckpt` with and without EMA weight averaging, diffusers' `EMAModel.state_dict()`. Fixtures are
//! written once by `python/make_format_fixtures.py` with the real libraries; every read is
//! compared exactly (tolerance 0: the same bytes) with the `state_dict()` Python saved beside it
//! as safetensors.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::common::run_python;
use diffmon::engine::model::Model;
use diffmon::weights::{
    self, CheckpointFormat, Naming, ReadOptions, StateDict, read_checkpoint, read_weights,
};
use tch::{Device, Kind, Tensor};

fn dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        run_python(&[
            "python/make_format_fixtures.py",
            dir.path().to_str().unwrap(),
        ]);
        dir
    })
    .path()
}

fn file(name: &str) -> PathBuf {
    dir().join(name)
}

/// The reference `state_dict()`, in its order (safetensors files store names sorted).
fn reference(name: &str) -> StateDict {
    let sd = read_checkpoint(&file(name), &ReadOptions::default()).unwrap();
    let order = std::fs::read_to_string(file(&format!("{name}.order"))).unwrap();
    let tensors = order
        .lines()
        .map(|n| (n.to_string(), sd.get(n).unwrap().clone()))
        .collect();
    StateDict { tensors }
}

fn opts(key: Option<&str>, prefer_ema: bool) -> ReadOptions {
    ReadOptions {
        weights_key: key.map(str::to_string),
        prefer_ema,
        ..ReadOptions::default()
    }
}

/// Same names in the same order, same dtypes, shapes and bytes (exact).
fn assert_same(got: &StateDict, want: &StateDict, what: &str) {
    let names = |s: &StateDict| s.names().map(str::to_string).collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "{what}: names");
    for ((n, a), (_, b)) in got.tensors.iter().zip(&want.tensors) {
        assert_eq!(a, b, "{what}: tensor {n}");
    }
}

fn arch() -> Model {
    Model::load(&file("arch.ts"), Device::Cpu).unwrap()
}

fn as_f32(t: &Tensor) -> Vec<f32> {
    let t = t.to_kind(Kind::Float).contiguous().view(-1);
    Vec::<f32>::try_from(&t).unwrap()
}

fn raw_f32(t: &weights::RawTensor) -> Vec<f32> {
    t.data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Every tensor of `want` (names after removing `strip`) equals the model's, exactly.
fn assert_model_holds(model: &Model, want: &StateDict, strip: &str, what: &str) {
    for (name, t) in &want.tensors {
        let name = name.strip_prefix(strip).unwrap_or(name);
        let got = model
            .tensor(name)
            .unwrap_or_else(|| panic!("{what}: no {name}"));
        assert_eq!(as_f32(&got), raw_f32(t), "{what}: {name}");
    }
}

#[test]
fn whole_module_pickle_is_read_without_running_its_code() {
    let ck = read_weights(&file("whole_module.pt"), &ReadOptions::default()).unwrap();
    assert_eq!(ck.format, CheckpointFormat::TorchZip);
    assert_eq!(ck.naming, Naming::ByName);
    let want = reference("whole_module.safetensors");
    // Parameters, persistent buffers (not `cache`), children; the tied `gain` under both names.
    assert_same(&ck.state, &want, "torch.save(model)");
    assert!(ck.state.get("body.1.gain").is_some());
    assert!(!ck.state.names().any(|n| n.ends_with("cache")));
    // The fixture script proved that torch.load creates both markers; diffmon's read did not.
    assert!(!file("MARKER_SETSTATE").exists(), "__setstate__ ran");
    assert!(!file("MARKER_REDUCE").exists(), "__reduce__ callable ran");

    let mut model = arch();
    model
        .load_weights(&file("whole_module.pt"), &ReadOptions::default())
        .unwrap();
    assert_model_holds(&model, &want, "", "torch.save(model) loaded");
    assert!(!file("MARKER_SETSTATE").exists() && !file("MARKER_REDUCE").exists());

    // An architecture with non-persistent buffers (`cache`, which no state dict holds): the
    // exporter's note in the file lets the same checkpoint load, and `cache` keeps its value.
    let mut cached = Model::load(&file("arch_cache.ts"), Device::Cpu).unwrap();
    assert!(cached.tensor("body.0.cache").is_some());
    cached
        .load_weights(&file("whole_module.pt"), &ReadOptions::default())
        .unwrap();
    assert_model_holds(&cached, &want, "", "loaded beside non-persistent buffers");
    assert_eq!(
        cached.tensor("body.0.cache").unwrap(),
        Tensor::zeros([3], (Kind::Float, Device::Cpu))
    );
}

#[test]
fn edm_snapshot_and_training_state_are_read() {
    let snap = file("snapshot.pkl");
    assert_eq!(
        weights::detect_format(&snap).unwrap(),
        CheckpointFormat::Pickle
    );
    assert_eq!(
        weights::validate_structure(&snap).unwrap(),
        CheckpointFormat::Pickle
    );
    let want = reference("snapshot.safetensors");
    let ck = read_weights(&snap, &ReadOptions::default()).unwrap();
    assert_eq!(ck.format, CheckpointFormat::Pickle);
    assert_same(&ck.state, &want, "snapshot (auto: the one module)");
    let keyed = read_checkpoint(&snap, &opts(Some("ema"), false)).unwrap();
    assert_same(&keyed, &want, "snapshot weights_key=ema");
    let e = read_checkpoint(&snap, &opts(Some("loss_fn"), true)).unwrap_err();
    assert!(
        e.to_string().contains("entry `loss_fn` holds an object"),
        "{e}"
    );

    let mut model = arch();
    model.load_weights(&snap, &ReadOptions::default()).unwrap();
    assert_model_holds(&model, &want, "", "snapshot loaded");

    // A snapshot cut short is incomplete, not a hostile file.
    let bytes = std::fs::read(&snap).unwrap();
    let cut = file("snapshot_cut.pkl");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = weights::validate_structure(&cut).unwrap_err();
    assert!(e.is_incomplete(), "{e}");
    assert!(read_checkpoint(&cut, &ReadOptions::default()).is_err());

    let ts = read_checkpoint(&file("training_state.pt"), &ReadOptions::default()).unwrap();
    assert_same(
        &ts,
        &reference("training_state.safetensors"),
        "training state (net)",
    );
}

#[test]
fn lightning_checkpoints_with_and_without_ema() {
    let plain = read_checkpoint(&file("lightning.ckpt"), &ReadOptions::default()).unwrap();
    let want = reference("lightning.safetensors");
    assert_same(&plain, &want, "lightning state_dict");
    assert!(plain.names().all(|n| n.starts_with("net.")));
    // The `net.` prefix is found and removed when loading.
    let mut model = arch();
    model
        .load_weights(&file("lightning.ckpt"), &ReadOptions::default())
        .unwrap();
    assert_model_holds(&model, &want, "net.", "lightning loaded");

    let ema_file = file("lightning_ema.ckpt");
    let ema_want = reference("lightning_ema.safetensors");
    let raw_want = reference("lightning_raw.safetensors");
    assert_ne!(
        ema_want, raw_want,
        "the fixture's EMA equals the raw weights"
    );
    let ema = read_checkpoint(&ema_file, &opts(None, true)).unwrap();
    assert_same(&ema, &ema_want, "prefer_ema: state_dict");
    let raw = read_checkpoint(&ema_file, &opts(None, false)).unwrap();
    assert_same(&raw, &raw_want, "no prefer_ema: current_model_state");
    model.load_weights(&ema_file, &opts(None, false)).unwrap();
    assert_model_holds(&model, &raw_want, "net.", "lightning raw loaded");
    model.load_weights(&ema_file, &opts(None, true)).unwrap();
    assert_model_holds(&model, &ema_want, "net.", "lightning ema loaded");
}

#[test]
fn diffusers_ema_model_state_dict_loads_in_parameter_order() {
    let path = file("diffusers_ema.pt");
    let want = reference("diffusers_ema.safetensors");
    let ck = read_weights(&path, &ReadOptions::default()).unwrap();
    assert_eq!(ck.naming, Naming::Ordered);
    assert_same(&ck.state, &want, "shadow_params (auto)");
    let keyed = read_weights(&path, &opts(Some("shadow_params"), true)).unwrap();
    assert_eq!(keyed.naming, Naming::Ordered);
    assert_same(&keyed.state, &want, "shadow_params (weights_key)");

    let mut model = arch();
    let shapes = model.state_shapes();
    model.load_weights(&path, &ReadOptions::default()).unwrap();
    for (i, (_, t)) in want.tensors.iter().enumerate() {
        let name = &shapes[i].0;
        assert_eq!(
            as_f32(&model.tensor(name).unwrap()),
            raw_f32(t),
            "parameter {i} ({name})"
        );
    }

    let before = as_f32(&model.tensor(&shapes[0].0).unwrap());
    let short = read_weights(&file("diffusers_ema_short.pt"), &ReadOptions::default()).unwrap();
    assert_eq!(
        (short.naming, short.state.len()),
        (Naming::Ordered, want.len() - 1)
    );
    let e = model
        .load_weights(&file("diffusers_ema_short.pt"), &ReadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("diffusers_ema_short.pt")
            && e.contains(&format!("lists {} tensors", want.len() - 1))
            && e.contains(&format!("{} parameters", want.len())),
        "{e}"
    );
    let e = model
        .load_weights(&file("diffusers_ema_wrong.pt"), &ReadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "tensor 0 of the ordered list has shape [{}]",
            want.tensors[0].1.numel()
        )) && e.contains(&format!("parameter 0 ({})", shapes[0].0)),
        "{e}"
    );
    // A refused load changes nothing.
    assert_eq!(as_f32(&model.tensor(&shapes[0].0).unwrap()), before);
}
