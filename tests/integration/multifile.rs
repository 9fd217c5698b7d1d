//! Checkpoints stored in several files (issue #16): a sharded safetensors checkpoint as
//! diffusers' `save_pretrained(max_shard_size=...)` writes it, a PyTorch Distributed Checkpoint
//! as `torch.distributed.checkpoint.save` writes it in one process, and one whose tensors are
//! split in chunks across two `.distcp` files as the ranks of a sharded save store them (checked
//! valid by torch's own `dcp.load`). Fixtures come from `python/make_multifile_fixtures.py`;
//! every read is compared exactly (the same bytes) with the `state_dict()` Python saved beside
//! it as one safetensors file.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::common::run_python;
use diffmon::weights::{
    CheckpointFormat, ReadOptions, StateDict, WeightsError, detect_format, read_checkpoint,
    read_weights, validate_structure,
};

fn dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        run_python(&[
            "python/make_multifile_fixtures.py",
            dir.path().to_str().unwrap(),
        ]);
        dir
    })
    .path()
}

fn sorted(mut sd: StateDict) -> StateDict {
    sd.tensors.sort_by(|a, b| a.0.cmp(&b.0));
    sd
}

fn reference(name: &str) -> StateDict {
    sorted(read_checkpoint(&dir().join(name), &ReadOptions::default()).unwrap())
}

const INDEX: &str = "sharded/diffusion_pytorch_model.safetensors.index.json";

#[test]
fn a_sharded_safetensors_checkpoint_reads_as_its_state_dict() {
    let index = dir().join(INDEX);
    assert_eq!(
        validate_structure(&index).unwrap(),
        CheckpointFormat::ShardedSafeTensors
    );
    let read = read_weights(&index, &ReadOptions::default()).unwrap();
    assert_eq!(read.format, CheckpointFormat::ShardedSafeTensors);
    let want = reference("sharded.safetensors");
    assert!(want.len() > 20, "{}", want.len());
    assert_eq!(sorted(read.state), want);
}

#[test]
fn distributed_checkpoints_read_the_model_entry_whole_or_from_chunks() {
    let want = reference("dcp.safetensors");
    for folder in ["dcp", "chunked"] {
        let metadata = dir().join(folder).join(".metadata");
        assert_eq!(
            detect_format(&metadata).unwrap(),
            CheckpointFormat::Distributed
        );
        validate_structure(&metadata).unwrap();
        let read = read_weights(&metadata, &ReadOptions::default()).unwrap();
        assert_eq!(sorted(read.state), want, "{folder}");
    }
    // weights_key picks another top-level entry: the optimizer's state, names without the key.
    let opts = ReadOptions {
        weights_key: Some("optimizer".into()),
        ..ReadOptions::default()
    };
    let optimizer = read_checkpoint(&dir().join("dcp/.metadata"), &opts).unwrap();
    assert!(
        optimizer.names().any(|n| n.starts_with("state.0.exp_avg")),
        "{:?}",
        optimizer.names().collect::<Vec<_>>()
    );
}

/// A copy of fixture folder `name` in a fresh temporary folder.
fn copy_of(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let to = tmp.path().join(name);
    fs::create_dir(&to).unwrap();
    for e in fs::read_dir(dir().join(name)).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    (tmp, to)
}

#[test]
fn hostile_multi_file_checkpoints_are_clear_errors() {
    // A shard named outside the index's folder.
    let (_t, sharded) = copy_of("sharded");
    let index = sharded.join("diffusion_pytorch_model.safetensors.index.json");
    let text = fs::read_to_string(&index).unwrap();
    let first = text.find("diffusion_pytorch_model-0").unwrap();
    let mut bad = text.clone();
    bad.replace_range(first..first, "../");
    fs::write(&index, &bad).unwrap();
    let e = read_checkpoint(&index, &ReadOptions::default()).unwrap_err();
    assert!(
        matches!(e, WeightsError::BadIndex { .. }) && e.to_string().contains("not a file name"),
        "{e}"
    );
    // A shard missing.
    fs::write(&index, &text).unwrap();
    let shard = fs::read_dir(&sharded)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("-00002-"))
        .unwrap();
    fs::remove_file(&shard).unwrap();
    assert!(validate_structure(&index).is_err());
    assert!(read_checkpoint(&index, &ReadOptions::default()).is_err());
    // A shard that is a link to a secret file elsewhere: refused before it is opened, nothing
    // of it in the message (before: its first 8 bytes as a "header length", 3619251681095544690
    // for `root:*:2`).
    let elsewhere = tempfile::tempdir().unwrap();
    let secret = elsewhere.path().join("shadow");
    fs::write(&secret, "root:*:20000:0:99999:7:::TOPSECRET-4242\n").unwrap();
    std::os::unix::fs::symlink(&secret, &shard).unwrap();
    let leaks = |e: &str| {
        e.contains("TOPSECRET") || e.contains("root") || e.contains("3619251681095544690")
    };
    for e in [
        validate_structure(&index).unwrap_err(),
        read_checkpoint(&index, &ReadOptions::default()).unwrap_err(),
    ] {
        let e = e.to_string();
        assert!(
            e.contains("is a link to a file outside the index's folder"),
            "{e}"
        );
        assert!(!leaks(&e), "{e}");
    }

    // A .distcp cut short: incomplete, not a panic; and a chunk item that is not an archive.
    let (_t, chunked) = copy_of("chunked");
    let data = chunked.join("__1_0.distcp");
    let full = fs::read(&data).unwrap();
    fs::write(&data, &full[..full.len() / 2]).unwrap();
    let metadata = chunked.join(".metadata");
    assert!(matches!(
        validate_structure(&metadata),
        Err(WeightsError::TruncatedPickle { .. })
    ));
    assert!(read_checkpoint(&metadata, &ReadOptions::default()).is_err());
    let mut garbage = full.clone();
    for b in garbage.iter_mut().take(64) {
        *b = 0x41;
    }
    fs::write(&data, &garbage).unwrap();
    let e = read_checkpoint(&metadata, &ReadOptions::default()).unwrap_err();
    assert!(e.to_string().contains("__1_0.distcp"), "{e}");
    // A .distcp file that is a link to the secret file.
    fs::remove_file(&data).unwrap();
    std::os::unix::fs::symlink(&secret, &data).unwrap();
    for e in [
        validate_structure(&metadata).unwrap_err(),
        read_checkpoint(&metadata, &ReadOptions::default()).unwrap_err(),
    ] {
        let e = e.to_string();
        assert!(
            e.contains("is a link to a file outside the checkpoint's folder"),
            "{e}"
        );
        assert!(!leaks(&e), "{e}");
    }
    // The metadata naming a file outside the folder.
    let md = fs::read(&metadata).unwrap();
    let at = md.windows(12).position(|w| w == b"__0_0.distcp").unwrap();
    let mut escaped = md.clone();
    escaped[at..at + 3].copy_from_slice(b"../");
    fs::write(&metadata, &escaped).unwrap();
    let e = read_checkpoint(&metadata, &ReadOptions::default()).unwrap_err();
    assert!(e.to_string().contains("not a file name"), "{e}");
}
