//! End-to-end tests of the `weights` module: fixtures written by `testdata/make.py` (real
//! torch 2.13 output, embedded), and hostile archives assembled here.

use std::io::{Cursor, Write};
use std::path::Path;

use super::pickle::tests::PickleWriter;
use super::*;

const DTYPES_PT: &[u8] = include_bytes!("testdata/dtypes.pt");
const NESTED_ONE_PT: &[u8] = include_bytes!("testdata/nested_one.pt");
const NESTED_TWO_PT: &[u8] = include_bytes!("testdata/nested_two.pt");
const DDP_PT: &[u8] = include_bytes!("testdata/ddp.pt");
const MODEL_SAFETENSORS: &[u8] = include_bytes!("testdata/model.safetensors");
const TORCHSCRIPT_PT: &[u8] = include_bytes!("testdata/torchscript.pt");

const MEM: &str = "mem/ckpt.pt";

fn read(bytes: &[u8], opts: &ReadOptions) -> Result<StateDict, WeightsError> {
    read_checkpoint_from(Cursor::new(bytes), bytes.len() as u64, Path::new(MEM), opts)
}

fn read_default(bytes: &[u8]) -> Result<StateDict, WeightsError> {
    read(bytes, &ReadOptions::default())
}

fn validate(bytes: &[u8]) -> Result<CheckpointFormat, WeightsError> {
    validate_structure_from(Cursor::new(bytes), bytes.len() as u64, Path::new(MEM))
}

fn detect(bytes: &[u8]) -> Result<CheckpointFormat, WeightsError> {
    detect_format_from(Cursor::new(bytes), bytes.len() as u64, Path::new(MEM))
}

fn key(k: &str) -> ReadOptions {
    ReadOptions {
        weights_key: Some(k.to_string()),
        strip_prefix: None,
        ..ReadOptions::default()
    }
}

fn f32s(t: &RawTensor) -> Vec<f32> {
    assert_eq!(t.dtype, DType::F32);
    t.data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn le<const N: usize, T>(v: &[T], f: impl Fn(&T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(f).collect()
}

/// A zip with stored entries, as torch writes them.
fn zip_bytes(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, data) in entries {
        w.start_file(*name, opts).unwrap();
        w.write_all(data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

fn unzip(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut a = zip::ZipArchive::new(Cursor::new(bytes)).unwrap();
    (0..a.len())
        .map(|i| {
            let mut f = a.by_index(i).unwrap();
            let mut v = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut v).unwrap();
            (f.name().to_string(), v)
        })
        .collect()
}

/// A torch.save-like archive `a/` with the given pickle and storages.
fn archive(pkl: &[u8], storages: &[(&str, &[u8])]) -> Vec<u8> {
    let names: Vec<String> = storages
        .iter()
        .map(|(k, _)| format!("a/data/{k}"))
        .collect();
    let mut entries: Vec<(&str, &[u8])> = vec![("a/data.pkl", pkl), ("a/byteorder", b"little")];
    for (name, (_, data)) in names.iter().zip(storages) {
        entries.push((name, data));
    }
    entries.push(("a/version", b"3\n"));
    zip_bytes(&entries)
}

/// `OrderedDict(name=tensor_v2(...))` with a single tensor.
fn one_tensor_pickle(ty: &str, numel: i64, offset: i64, size: &[i64], stride: &[i64]) -> Vec<u8> {
    let mut w = PickleWriter::new();
    w.ordered_dict().op(b'(').str("t");
    w.tensor_v2(ty, "0", numel, offset, size, stride);
    w.op(b'u');
    w.finish()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    le(v, |x| x.to_le_bytes())
}

// ---------------------------------------------------------------------------------------------
// Positive cases on real torch.save output.

#[test]
fn reads_every_dtype_and_view_from_torch_save() {
    let sd = read_default(DTYPES_PT).unwrap();
    let names: Vec<&str> = sd.names().collect();
    assert_eq!(
        names,
        [
            "weight", "bias", "f32", "f32_t", "f32_view", "f64", "f16", "bf16", "i64", "i32",
            "i16", "i8", "u8", "bool", "scalar", "empty", "param"
        ]
    );
    let t = |n: &str| sd.get(n).unwrap();
    assert_eq!(t("weight").shape, [2, 3]);
    assert_eq!(f32s(t("weight")), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(f32s(t("bias")), [-1.0, 0.5]);
    assert_eq!(f32s(t("f32")), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    // Transposed view of the same storage: materialized row-major.
    assert_eq!(t("f32_t").shape, [3, 2]);
    assert_eq!(f32s(t("f32_t")), [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    // View with storage_offset 2.
    assert_eq!(t("f32_view").shape, [3]);
    assert_eq!(f32s(t("f32_view")), [2.0, 3.0, 4.0]);
    assert_eq!(t("f64").dtype, DType::F64);
    assert_eq!(t("f64").data, le(&[1.5f64, -2.25], |x| x.to_le_bytes()));
    assert_eq!(t("f16").dtype, DType::F16);
    assert_eq!(
        t("f16").data,
        le(&[0x3c00u16, 0xb800, 0x7bff], |x| x.to_le_bytes())
    );
    assert_eq!(t("bf16").dtype, DType::BF16);
    assert_eq!(
        t("bf16").data,
        le(&[0x3fc0u16, 0xc000, 0x3e80], |x| x.to_le_bytes())
    );
    assert_eq!(t("i64").dtype, DType::I64);
    assert_eq!(t("i64").data, le(&[-(1i64 << 40), 7], |x| x.to_le_bytes()));
    // arange(24).reshape(2,3,4).permute(2,0,1): element [k,i,j] = 12i + 4j + k.
    let i32t = t("i32");
    assert_eq!(
        (i32t.dtype, i32t.shape.as_slice()),
        (DType::I32, &[4, 2, 3][..])
    );
    let mut want = Vec::new();
    for k in 0..4 {
        for i in 0..2 {
            for j in 0..3 {
                want.push(12 * i + 4 * j + k);
            }
        }
    }
    assert_eq!(i32t.data, le(&want, |x: &i32| x.to_le_bytes()));
    assert_eq!(t("i16").data, le(&[-300i16, 300], |x| x.to_le_bytes()));
    assert_eq!(
        (t("i8").dtype, t("i8").data.as_slice()),
        (DType::I8, &[0x80u8, 0x7f][..])
    );
    assert_eq!(
        (t("u8").dtype, t("u8").data.as_slice()),
        (DType::U8, &[0u8, 255][..])
    );
    assert_eq!(
        (t("bool").dtype, t("bool").data.as_slice()),
        (DType::Bool, &[1u8, 0, 1][..])
    );
    assert_eq!((t("scalar").shape.len(), f32s(t("scalar"))), (0, vec![3.0]));
    assert_eq!(
        (t("empty").shape.as_slice(), t("empty").data.len()),
        (&[0, 4][..], 0)
    );
    assert_eq!(f32s(t("param")), [2.0, 4.0]);
    for (name, t) in &sd.tensors {
        assert_eq!(t.data.len(), t.numel() * t.dtype.size(), "{name}");
    }
}

#[test]
fn nested_dict_is_picked_automatically_when_unique() {
    // {"step": 7, "ema": sd, "lr": 0.5, "name": "run", "u16": <uint16 tensor>}
    let sd = read_default(NESTED_ONE_PT).unwrap();
    assert_eq!(sd.names().collect::<Vec<_>>(), ["w", "b"]);
    assert_eq!(f32s(sd.get("w").unwrap()), [10.0, 20.0]);
    assert_eq!(read(NESTED_ONE_PT, &key("ema")).unwrap(), sd);
    // The uint16 tensor (written by torch as _rebuild_tensor_v3 + UntypedStorage) only
    // matters when selected.
    let e = read(NESTED_ONE_PT, &key("u16")).unwrap_err();
    assert!(matches!(e, WeightsError::NotAStateDict { .. }), "{e}");
    assert!(
        e.to_string()
            .ends_with("entry `u16` holds a tensor, not a dict of tensors"),
        "{e}"
    );
}

#[test]
fn weights_key_selects_among_several_state_dicts() {
    // {"model": sd1, "ema": sd10, "step": 7, "state": {"ema": <same object as ema>, "big": 2**40}}
    // Without weights_key: `ema` with prefer_ema (the default), `model` without.
    let auto = read_default(NESTED_TWO_PT).unwrap();
    assert_eq!(f32s(auto.get("w").unwrap()), [10.0, 20.0]);
    let raw = read(
        NESTED_TWO_PT,
        &ReadOptions {
            prefer_ema: false,
            ..ReadOptions::default()
        },
    )
    .unwrap();
    assert_eq!(f32s(raw.get("w").unwrap()), [1.0, 2.0]);
    let model = read(NESTED_TWO_PT, &key("model")).unwrap();
    assert_eq!(f32s(model.get("w").unwrap()), [1.0, 2.0]);
    let ema = read(NESTED_TWO_PT, &key("ema")).unwrap();
    assert_eq!(f32s(ema.get("w").unwrap()), [10.0, 20.0]);
    assert_eq!(f32s(ema.get("b").unwrap()), [30.0]);
    // Dotted path through a memo reference to the (already filled) ema dict.
    assert_eq!(read(NESTED_TWO_PT, &key("state.ema")).unwrap(), ema);

    let e = read(NESTED_TWO_PT, &key("emma")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "mem/ckpt.pt: no state dict under key `emma` (top-level keys: model, ema, step, state)"
    );
    let e = read(NESTED_TWO_PT, &key("step")).unwrap_err();
    assert!(e.to_string().contains("entry `step` holds an int"), "{e}");
    let e = read(NESTED_TWO_PT, &key("state")).unwrap_err();
    assert!(e.to_string().contains("dict without tensors"), "{e}");
}

#[test]
fn strip_prefix_removes_module_prefix() {
    let opts = ReadOptions {
        weights_key: None,
        strip_prefix: Some("module.".into()),
        ..ReadOptions::default()
    };
    let sd = read(DDP_PT, &opts).unwrap();
    assert_eq!(sd.names().collect::<Vec<_>>(), ["w", "b", "other"]);
    assert_eq!(f32s(sd.get("b").unwrap()), [3.0]);
    let plain = read_default(DDP_PT).unwrap();
    assert_eq!(
        plain.names().collect::<Vec<_>>(),
        ["module.w", "module.b", "other"]
    );
}

#[test]
fn safetensors_in_file_order_with_key_filter_and_prefix() {
    assert_eq!(
        detect(MODEL_SAFETENSORS).unwrap(),
        CheckpointFormat::SafeTensors
    );
    assert_eq!(
        validate(MODEL_SAFETENSORS).unwrap(),
        CheckpointFormat::SafeTensors
    );
    let sd = read_default(MODEL_SAFETENSORS).unwrap();
    // The writer sorts by dtype then name; file (data offset) order is kept.
    assert_eq!(
        sd.names().collect::<Vec<_>>(),
        ["m.i64", "ema.b", "ema.w", "z.f32", "a.bf16"]
    );
    let w = sd.get("ema.w").unwrap();
    assert_eq!(
        (w.shape.as_slice(), f32s(w)),
        (&[2, 2][..], vec![1.0, 2.0, 3.0, 4.0])
    );
    assert_eq!(
        sd.get("m.i64").unwrap().data,
        le(&[5i64, -6], |x| x.to_le_bytes())
    );
    let bf = sd.get("a.bf16").unwrap();
    assert_eq!(
        (bf.dtype, bf.data.clone()),
        (DType::BF16, le(&[0x3fc0u16, 0xc000], |x| x.to_le_bytes()))
    );

    // weights_key filters `ema.*` and drops the prefix...
    let ema = read(MODEL_SAFETENSORS, &key("ema")).unwrap();
    assert_eq!(ema.names().collect::<Vec<_>>(), ["b", "w"]);
    // ...and is ignored when no tensor has that prefix.
    assert_eq!(read(MODEL_SAFETENSORS, &key("model")).unwrap(), sd);
    let opts = ReadOptions {
        weights_key: None,
        strip_prefix: Some("ema.".into()),
        ..ReadOptions::default()
    };
    let stripped = read(MODEL_SAFETENSORS, &opts).unwrap();
    assert_eq!(
        stripped.names().collect::<Vec<_>>(),
        ["m.i64", "b", "w", "z.f32", "a.bf16"]
    );
}

#[test]
fn safetensors_truncated_or_padded_is_invalid() {
    for cut in [
        MODEL_SAFETENSORS.len() - 1,
        MODEL_SAFETENSORS.len() / 2,
        20,
        9,
        4,
    ] {
        let bytes = &MODEL_SAFETENSORS[..cut];
        let e = validate(bytes).unwrap_err();
        assert!(e.is_incomplete(), "{cut}: {e}");
        assert!(read_default(bytes).is_err(), "{cut}");
    }
    let mut longer = MODEL_SAFETENSORS.to_vec();
    longer.push(0);
    assert!(matches!(
        validate(&longer),
        Err(WeightsError::CorruptSafeTensors { .. })
    ));
}

#[test]
fn torchscript_is_read_as_data_by_attribute_path() {
    assert_eq!(
        detect(TORCHSCRIPT_PT).unwrap(),
        CheckpointFormat::TorchScript
    );
    assert_eq!(
        validate(TORCHSCRIPT_PT).unwrap(),
        CheckpointFormat::TorchScript
    );
    // torch.jit.script(nn.Linear(2, 1)): the module's own tensor attributes.
    let ck = read_weights_from(
        Cursor::new(TORCHSCRIPT_PT),
        TORCHSCRIPT_PT.len() as u64,
        Path::new(MEM),
        &ReadOptions::default(),
    )
    .unwrap();
    assert_eq!(ck.format, CheckpointFormat::TorchScript);
    let names: Vec<&str> = ck.state.names().collect();
    assert_eq!(names, ["weight", "bias"]);
    assert_eq!(ck.state.get("weight").unwrap().shape, [1, 2]);
    assert_eq!(ck.state.get("bias").unwrap().shape, [1]);
    assert_eq!(detect(DTYPES_PT).unwrap(), CheckpointFormat::TorchZip);
    assert_eq!(validate(DTYPES_PT).unwrap(), CheckpointFormat::TorchZip);
}

/// A module pickle as TorchScript writes it: `__torch__.M` NEWOBJ + BUILD of its attributes.
fn module_pickle() -> Vec<u8> {
    let mut w = PickleWriter::new();
    w.global("__torch__", "M").op(b')').op(0x81);
    w.op(b'}').op(b'(');
    w.str("training").op(0x88);
    w.str("w").tensor_v2("FloatStorage", "0", 2, 0, &[2], &[1]);
    w.str("sub").global("__torch__.x", "Sub").op(b')').op(0x81);
    w.op(b'}')
        .str("v")
        .tensor_v2("FloatStorage", "0", 2, 1, &[1], &[1]);
    w.op(b's').op(b'b');
    w.op(b'u').op(b'b');
    w.finish()
}

#[test]
fn torchscript_classes_are_placeholders_only_in_torchscript_archives() {
    let pkl = module_pickle();
    let data = le(&[1.0f32, 2.0], |x| x.to_le_bytes());
    let ts = zip_bytes(&[
        ("m/data.pkl", &pkl),
        ("m/code/__torch__.py", b"raise SystemExit"),
        ("m/data/0", &data),
    ]);
    let sd = read_default(&ts).unwrap();
    let names: Vec<&str> = sd.names().collect();
    assert_eq!(names, ["w", "sub.v"]);
    assert_eq!(f32s(sd.get("sub.v").unwrap()), [2.0]);
    // The same pickle in a torch.save archive: the class is refused, as any foreign global.
    let pt = zip_bytes(&[("m/data.pkl", &pkl), ("m/data/0", &data)]);
    let e = read_default(&pt).unwrap_err();
    assert!(matches!(e, WeightsError::ForbiddenGlobal { .. }), "{e}");
    // Other globals stay forbidden in TorchScript archives.
    let mut w = PickleWriter::new();
    w.global("os", "system").str("id").op(0x85).op(b'R');
    let evil = zip_bytes(&[("m/data.pkl", &w.finish()), ("m/constants.pkl", b"")]);
    let e = read_default(&evil).unwrap_err();
    assert!(e.to_string().contains("os.system"), "{e}");
}

#[test]
fn safetensors_header_is_parsed_once_per_read() {
    let parses = || safetensors_file::HEADER_PARSES.with(|n| n.get());
    let before = parses();
    detect(MODEL_SAFETENSORS).unwrap();
    assert_eq!(parses() - before, 0, "detect_format parses no header");
    read_default(MODEL_SAFETENSORS).unwrap();
    assert_eq!(parses() - before, 1, "a read parses the header once");
}

fn deflated_zip(entries: &[(&str, &[u8])], big: (&str, usize)) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, data) in entries {
        w.start_file(*name, stored).unwrap();
        w.write_all(data).unwrap();
    }
    let deflated = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated)
        .large_file(true);
    w.start_file(big.0, deflated).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..big.1 {
        w.write_all(&zeros).unwrap();
    }
    w.finish().unwrap().into_inner()
}

#[test]
fn a_deflate_bomb_entry_is_refused_at_its_bound() {
    // A storage declared as 4 floats whose entry inflates to 64 MiB.
    let mut w = PickleWriter::new();
    w.op(b'}')
        .str("w")
        .tensor_v2("FloatStorage", "0", 4, 0, &[4], &[1]);
    w.op(b's');
    let pkl = w.finish();
    let bomb = deflated_zip(&[("a/data.pkl", &pkl)], ("a/data/0", 64));
    assert!(bomb.len() < 1 << 20, "{}", bomb.len());
    let e = read_default(&bomb).unwrap_err();
    assert!(
        matches!(&e, WeightsError::EntryTooLarge { limit: 16, .. }),
        "{e}"
    );
    assert!(!e.is_incomplete());
    assert!(e.to_string().contains("what its tensors declare"), "{e}");
    // Declared as large as it inflates, but over the configured ceiling.
    let mut w = PickleWriter::new();
    w.op(b'}')
        .str("w")
        .tensor_v2("FloatStorage", "0", 16 << 20, 0, &[16 << 20], &[1]);
    w.op(b's');
    let pkl = w.finish();
    let bomb = deflated_zip(&[("a/data.pkl", &pkl)], ("a/data/0", 64));
    let opts = ReadOptions {
        max_entry_bytes: 8 << 20,
        ..ReadOptions::default()
    };
    let e = read(&bomb, &opts).unwrap_err();
    assert!(e.to_string().contains("checkpoints.max_entry_mib"), "{e}");
    assert!(read_default(&bomb).is_ok());
}

#[test]
fn only_regular_files_are_opened() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("ckpt_10.pt");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // Without a writer, a blocking open would never return.
    let e = read_checkpoint(&fifo, &ReadOptions::default()).unwrap_err();
    assert!(
        matches!(e, WeightsError::NotRegularFile { kind, .. } if kind.contains("FIFO")),
        "{e}"
    );
    assert!(validate_structure(&fifo).is_err());
    assert!(detect_format(dir.path()).is_err());
}

#[test]
fn messages_never_quote_file_content() {
    let secret = b"root:x:0:0:TOPSECRET-4242:/root:/bin/bash\n";
    let e = read_default(secret).unwrap_err().to_string();
    let hex: Vec<String> = secret[..4].iter().map(|b| format!("{b:02x}")).collect();
    assert!(!e.contains("root") && !e.contains("TOPSECRET"), "{e}");
    assert!(!e.contains(&hex.join(" ")), "{e}");
    // A name from inside a file is escaped and capped.
    let name = format!("a\nb\x1b[31m{}", "x".repeat(500));
    let mut w = PickleWriter::new();
    w.op(b'}')
        .str(&name)
        .tensor_v2("ComplexFloatStorage", "0", 1, 0, &[1], &[1]);
    w.op(b's');
    let pt = zip_bytes(&[("a/data.pkl", &w.finish()), ("a/data/0", &[0; 8])]);
    let e = read_default(&pt).unwrap_err().to_string();
    assert!(!e.contains('\n') && !e.contains('\x1b'), "{e}");
    assert!(e.contains("a\\nb\\u{1b}[31m"), "{e}");
    assert!(e.len() < 400, "{e}");
}

#[test]
fn public_functions_detect_by_content_not_extension() {
    let dir = tempfile::tempdir().unwrap();
    let st = dir.path().join("weights.pt"); // safetensors content, torch-like name
    std::fs::write(&st, MODEL_SAFETENSORS).unwrap();
    let pt = dir.path().join("weights.safetensors"); // zip content
    std::fs::write(&pt, DTYPES_PT).unwrap();
    assert_eq!(detect_format(&st).unwrap(), CheckpointFormat::SafeTensors);
    assert_eq!(detect_format(&pt).unwrap(), CheckpointFormat::TorchZip);
    assert_eq!(validate_structure(&pt).unwrap(), CheckpointFormat::TorchZip);
    assert_eq!(
        read_checkpoint(&st, &ReadOptions::default()).unwrap().len(),
        5
    );
    assert_eq!(
        read_checkpoint(&pt, &ReadOptions::default()).unwrap(),
        read_default(DTYPES_PT).unwrap()
    );

    let missing = dir.path().join("nope.pt");
    let e = read_checkpoint(&missing, &ReadOptions::default()).unwrap_err();
    assert!(matches!(e, WeightsError::Io { .. }));
    assert_eq!(e.path(), missing);

    let empty = dir.path().join("empty.pt");
    std::fs::write(&empty, b"").unwrap();
    let e = validate_structure(&empty).unwrap_err();
    assert_eq!(e.to_string(), format!("{}: empty file", empty.display()));
}

#[test]
fn rebuild_tensor_v3_with_untyped_storage() {
    // What torch 2.13 writes for dtypes without a legacy storage class, here with float32.
    let mut w = PickleWriter::new();
    w.op(b'}').op(b'(').str("x");
    w.global("torch._utils", "_rebuild_tensor_v3").op(b'(');
    w.storage(("torch.storage", "UntypedStorage"), "0", 16);
    w.long(1).int_tuple(&[3]).int_tuple(&[1]).op(0x89);
    w.ordered_dict()
        .global("torch", "float32")
        .op(b't')
        .op(b'R');
    w.op(b'u');
    let data = f32_bytes(&[9.0, 1.0, 2.0, 3.0]);
    let sd = read_default(&archive(&w.finish(), &[("0", &data)])).unwrap();
    assert_eq!(f32s(sd.get("x").unwrap()), [1.0, 2.0, 3.0]);
}

// ---------------------------------------------------------------------------------------------
// Hostile and damaged input.

fn forbidden_message(global: &str) -> String {
    format!(
        "mem/ckpt.pt: pickle refers to global `{global}`, which diffmon does not load (only \
         tensors, storages and plain containers are read; no code from a checkpoint is ever \
         executed)"
    )
}

#[test]
fn foreign_global_is_refused_via_global() {
    let mut w = PickleWriter::new();
    w.global("os", "system")
        .str("touch /tmp/pwned")
        .op(0x85)
        .op(b'R');
    let e = read_default(&archive(&w.finish(), &[])).unwrap_err();
    assert!(matches!(e, WeightsError::ForbiddenGlobal { .. }));
    assert_eq!(e.to_string(), forbidden_message("os.system"));
}

#[test]
fn foreign_global_is_refused_via_stack_global() {
    let mut w = PickleWriter::new();
    w.str("os")
        .str("system")
        .op(0x93)
        .str("touch /tmp/pwned")
        .op(0x85)
        .op(b'R');
    let e = read_default(&archive(&w.finish(), &[])).unwrap_err();
    assert_eq!(e.to_string(), forbidden_message("os.system"));
}

#[test]
fn pickled_module_is_refused() {
    // torch.save(model) pickles the class; the state dict inside is never reached.
    let mut w = PickleWriter::new();
    w.global("__main__", "Net").op(b')').op(0x81);
    let e = read_default(&archive(&w.finish(), &[])).unwrap_err();
    assert_eq!(e.to_string(), forbidden_message("__main__.Net"));
}

#[test]
fn empty_random_and_truncated_files() {
    let e = read_default(b"").unwrap_err();
    assert_eq!(e.to_string(), "mem/ckpt.pt: empty file");
    assert!(matches!(detect(b""), Err(WeightsError::EmptyFile { .. })));

    let mut rng = Rng(7);
    let noise: Vec<u8> = (0..4096).map(|_| rng.next() as u8).collect();
    let e = read_default(&noise).unwrap_err();
    assert!(matches!(e, WeightsError::UnknownFormat { .. }), "{e}");
    assert!(e.to_string().contains("unrecognized content"), "{e}");

    for cut in [
        DTYPES_PT.len() - 1,
        DTYPES_PT.len() - 30,
        DTYPES_PT.len() / 2,
        100,
        3,
    ] {
        let bytes = &DTYPES_PT[..cut];
        let e = validate(bytes).unwrap_err();
        assert!(e.is_incomplete(), "{cut}: {e}");
        let e = read_default(bytes).unwrap_err();
        assert!(e.to_string().starts_with("mem/ckpt.pt: "), "{e}");
    }
    let e = validate(&DTYPES_PT[..DTYPES_PT.len() / 2]).unwrap_err();
    assert!(
        e.to_string().contains("truncated or corrupt zip archive"),
        "{e}"
    );
}

#[test]
fn corrupted_storage_bytes_fail_the_crc() {
    let mut bytes = DTYPES_PT.to_vec();
    let needle = le(&[1.5f64, -2.25], |x| x.to_le_bytes()); // storage of "f64"
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap();
    bytes[at] ^= 1;
    assert_eq!(validate(&bytes).unwrap(), CheckpointFormat::TorchZip); // structure is intact
    let e = read_default(&bytes).unwrap_err();
    assert!(matches!(e, WeightsError::CorruptZip { .. }), "{e}");
}

#[test]
fn zip_without_data_pkl() {
    let bytes = zip_bytes(&[("a/version", b"3\n")]);
    let e = validate(&bytes).unwrap_err();
    assert!(matches!(e, WeightsError::MissingEntry { .. }), "{e}");
    assert!(!e.is_incomplete());
}

#[test]
fn storage_shorter_than_declared() {
    let pkl = one_tensor_pickle("FloatStorage", 6, 0, &[2, 3], &[3, 1]);
    let e = read_default(&archive(&pkl, &[("0", &[0u8; 16])])).unwrap_err();
    assert!(matches!(e, WeightsError::BadTensor { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("holds 16 bytes but the checkpoint declares 24"),
        "{e}"
    );
}

#[test]
fn shape_larger_than_storage() {
    let pkl = one_tensor_pickle("FloatStorage", 4, 0, &[2, 3], &[3, 1]);
    let e = read_default(&archive(&pkl, &[("0", &[0u8; 16])])).unwrap_err();
    assert!(matches!(e, WeightsError::BadTensor { .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with("mem/ckpt.pt: tensor `t`: shape [2, 3]"),
        "{e}"
    );
}

#[test]
fn stride_or_offset_out_of_range() {
    for (offset, stride) in [(0, [3, 2]), (1, [3, 1]), (0, [1, 6])] {
        let pkl = one_tensor_pickle("FloatStorage", 6, offset, &[2, 3], &stride);
        let e = read_default(&archive(&pkl, &[("0", &f32_bytes(&[0.0; 6]))])).unwrap_err();
        assert!(
            matches!(e, WeightsError::BadTensor { .. }),
            "{offset} {stride:?}: {e}"
        );
    }
    // In range: a valid strided view.
    let pkl = one_tensor_pickle("FloatStorage", 6, 1, &[2, 2], &[3, 1]);
    let data = f32_bytes(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let sd = read_default(&archive(&pkl, &[("0", &data)])).unwrap();
    assert_eq!(f32s(sd.get("t").unwrap()), [1.0, 2.0, 4.0, 5.0]);
}

#[test]
fn huge_numel_overflow() {
    let big = i64::MAX / 2;
    for (numel, size, stride) in [
        (big, vec![big, big], vec![0, 0]),
        (6, vec![1 << 31, 1 << 31, 1 << 31], vec![0, 0, 0]),
        (big, vec![big], vec![1]),
    ] {
        let pkl = one_tensor_pickle("DoubleStorage", numel, 0, &size, &stride);
        let e = read_default(&archive(&pkl, &[("0", &[0u8; 48])])).unwrap_err();
        assert!(matches!(e, WeightsError::BadTensor { .. }), "{size:?}: {e}");
    }
}

#[test]
fn deeply_nested_marks() {
    let mut w = PickleWriter::new();
    for _ in 0..50_000 {
        w.op(b'(');
    }
    let e = read_default(&archive(&w.finish(), &[])).unwrap_err();
    assert!(matches!(e, WeightsError::Pickle { .. }), "{e}");
    assert!(e.to_string().contains("MARKs nested deeper than"), "{e}");
}

#[test]
fn unknown_opcode_is_named() {
    let mut w = PickleWriter::new();
    w.op(b'}').op(0x8f); // EMPTY_SET
    let e = read_default(&archive(&w.finish(), &[])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "mem/ckpt.pt: unsupported pickle opcode EMPTY_SET (0x8f) at byte 3 of `a/data.pkl`; \
         diffmon reads only the pickle subset that torch.save writes"
    );
}

#[test]
fn big_endian_checkpoint_is_refused() {
    let pkl = one_tensor_pickle("FloatStorage", 1, 0, &[1], &[1]);
    let bytes = zip_bytes(&[
        ("a/data.pkl", &pkl),
        ("a/byteorder", b"big"),
        ("a/data/0", &[0, 0, 0, 1]),
    ]);
    let e = read_default(&bytes).unwrap_err();
    assert!(matches!(e, WeightsError::ByteOrder { .. }), "{e}");
    assert!(e.to_string().contains("byte order is `big`"), "{e}");
}

#[test]
fn missing_storage_entry() {
    let pkl = one_tensor_pickle("FloatStorage", 1, 0, &[1], &[1]);
    let e = read_default(&archive(&pkl, &[])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "mem/ckpt.pt: zip archive has no entry `a/data/0` (storage of tensor `t`); the file is \
         incomplete or was not written by torch.save"
    );
}

#[test]
fn unsupported_dtype_is_named() {
    let pkl = one_tensor_pickle("ComplexFloatStorage", 1, 0, &[1], &[1]);
    let e = read_default(&archive(&pkl, &[("0", &[0u8; 8])])).unwrap_err();
    assert!(matches!(e, WeightsError::UnsupportedDtype { .. }), "{e}");
    assert!(e.to_string().contains("has dtype complex64"), "{e}");
}

#[test]
fn shared_storage_is_read_once_and_each_view_is_right() {
    // Three views of one storage; the last one takes the buffer over.
    let mut w = PickleWriter::new();
    w.ordered_dict().op(b'(');
    w.str("a").tensor_v2("FloatStorage", "s", 4, 0, &[4], &[1]);
    w.str("b")
        .tensor_v2("FloatStorage", "s", 4, 0, &[2, 2], &[1, 2]);
    w.str("c").tensor_v2("FloatStorage", "s", 4, 0, &[4], &[1]);
    w.op(b'u');
    let data = f32_bytes(&[1.0, 2.0, 3.0, 4.0]);
    let sd = read_default(&archive(&w.finish(), &[("s", &data)])).unwrap();
    assert_eq!(f32s(sd.get("a").unwrap()), [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(f32s(sd.get("b").unwrap()), [1.0, 3.0, 2.0, 4.0]);
    assert_eq!(f32s(sd.get("c").unwrap()), [1.0, 2.0, 3.0, 4.0]);
}

// ---------------------------------------------------------------------------------------------
// Robustness: mutated input never panics.

/// xorshift64*: deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut Rng, src: &[u8]) -> Vec<u8> {
    let mut v = src.to_vec();
    for _ in 0..1 + rng.below(4) {
        match rng.below(6) {
            0 => {
                let i = rng.below(v.len());
                if let Some(b) = v.get_mut(i) {
                    *b ^= 1 << rng.below(8);
                }
            }
            1 => {
                let i = rng.below(v.len());
                if let Some(b) = v.get_mut(i) {
                    *b = rng.next() as u8;
                }
            }
            2 => v.truncate(rng.below(v.len() + 1)),
            3 => {
                let i = rng.below(v.len() + 1);
                v.insert(i, rng.next() as u8);
            }
            4 if !v.is_empty() => {
                let i = rng.below(v.len());
                v.remove(i);
            }
            _ => {
                // Interesting values (lengths, indices) in 4 consecutive bytes.
                let i = rng.below(v.len());
                let val: [u8; 4] = match rng.below(4) {
                    0 => [0xff; 4],
                    1 => [0x7f, 0xff, 0xff, 0xff],
                    2 => [0, 0, 0, 0x80],
                    _ => (rng.next() as u32).to_le_bytes(),
                };
                for (k, b) in val.iter().enumerate() {
                    if let Some(x) = v.get_mut(i + k) {
                        *x = *b;
                    }
                }
            }
        }
    }
    v
}

#[test]
fn mutated_inputs_never_panic() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let opts = [ReadOptions::default(), key("ema"), key("state.ema")];
    let mut ok = 0;
    // Whole files: zip container, safetensors header.
    for src in [DTYPES_PT, NESTED_TWO_PT, MODEL_SAFETENSORS, TORCHSCRIPT_PT] {
        for i in 0..1000 {
            let bytes = mutate(&mut rng, src);
            ok += read(&bytes, &opts[i % 3]).is_ok() as usize;
            let _ = validate(&bytes);
            let _ = detect(&bytes);
        }
    }
    // The pickle itself (a mutated data.pkl in an otherwise valid archive, since the zip CRC
    // would reject most mutations above before the interpreter runs).
    for src in [DTYPES_PT, NESTED_TWO_PT, NESTED_ONE_PT] {
        let entries = unzip(src);
        let pkl_at = entries
            .iter()
            .position(|(n, _)| n.ends_with("data.pkl"))
            .unwrap();
        for i in 0..1500 {
            let mut entries = entries.clone();
            entries[pkl_at].1 = mutate(&mut rng, &entries[pkl_at].1);
            let refs: Vec<(&str, &[u8])> = entries
                .iter()
                .map(|(n, d)| (n.as_str(), d.as_slice()))
                .collect();
            let bytes = zip_bytes(&refs);
            if let Ok(sd) = read(&bytes, &opts[i % 3]) {
                ok += 1;
                for (_, t) in &sd.tensors {
                    assert_eq!(t.data.len(), t.numel() * t.dtype.size());
                }
            }
        }
    }
    // Some mutations are harmless; the test is that none of them panicked.
    assert!(ok > 0);
}

// ---------------------------------------------------------------------------------------------
// Findings of the fuzz targets in `fuzz/` (`make fuzz`), each with its minimized input.

/// Seen while reading the code during the fuzz runs, and reported by the `pickle` target as a
/// libFuzzer out-of-memory (`malloc(3221225472)`): a 194-byte data.pkl whose tensor broadcasts a
/// 1-byte storage (stride 0) to 3 GiB made the reader allocate and fill 3 GiB. What views
/// repeat beyond their storages is now bounded per state dict.
#[test]
fn fuzz_broadcast_view_is_bounded() {
    // (Without the bound the read succeeds: report its size, not its 3 GiB.)
    let refused = |pkl: &[u8]| match read_default(&archive(pkl, &[("0", &[7])])) {
        Ok(sd) => panic!(
            "read {:?}",
            sd.tensors.iter().map(|(n, t)| (n, t.data.len()))
        ),
        Err(e) => e,
    };
    let pkl = one_tensor_pickle("ByteStorage", 1, 0, &[3 << 30], &[0]);
    let e = refused(&pkl);
    assert!(matches!(e, WeightsError::BadTensor { .. }), "{e}");
    assert!(e.to_string().contains("repeat storage bytes"), "{e}");
    // Bounded across tensors too: 100 MiB is read, 100 + 450 MiB is refused before allocating.
    let mut w = PickleWriter::new();
    w.ordered_dict().op(b'(');
    w.str("a")
        .tensor_v2("ByteStorage", "0", 1, 0, &[100 << 20], &[0]);
    w.str("b")
        .tensor_v2("ByteStorage", "0", 1, 0, &[450 << 20], &[0]);
    let e = refused(&w.op(b'u').finish());
    assert!(e.to_string().contains("tensor `b`"), "{e}");
    // Small broadcasts and tied weights (two views of one storage) are still read.
    let pkl = one_tensor_pickle("ByteStorage", 1, 0, &[4, 3], &[0, 0]);
    let sd = read_default(&archive(&pkl, &[("0", &[7])])).unwrap();
    assert_eq!(sd.get("t").unwrap().data, [7; 12]);
    let mut w = PickleWriter::new();
    w.ordered_dict().op(b'(');
    w.str("w").tensor_v2("FloatStorage", "0", 4, 0, &[4], &[1]);
    w.str("tied")
        .tensor_v2("FloatStorage", "0", 4, 0, &[2, 2], &[2, 1]);
    let pkl = w.op(b'u').finish();
    let data = f32_bytes(&[1.0, 2.0, 3.0, 4.0]);
    let sd = read_default(&archive(&pkl, &[("0", &data)])).unwrap();
    assert_eq!(f32s(sd.get("tied").unwrap()), [1.0, 2.0, 3.0, 4.0]);
}

/// `{"a": {"w": t}, "b": {"w": t}}`: two state dicts under names no rule ranks.
#[test]
fn unranked_state_dicts_stay_ambiguous() {
    let mut w = PickleWriter::new();
    w.op(b'}').op(b'(');
    for k in ["a", "b"] {
        w.str(k).op(b'}').str("w");
        w.tensor_v2("FloatStorage", "0", 2, 0, &[2], &[1]);
        w.op(b's');
    }
    w.op(b'u');
    let data = f32_bytes(&[1.0, 2.0]);
    let e = read_default(&archive(&w.finish(), &[("0", &data)])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "mem/ckpt.pt: cannot tell which entry holds the weights: several entries hold weights \
         (a, b) (top-level keys: a, b); set `checkpoints.weights_key` to the entry to use"
    );
}

/// A module object as `torch.save(model)` pickles it at protocol 2: `cls` NEWOBJ, then BUILD of
/// its `__dict__` with `_parameters`, `_buffers`, `_non_persistent_buffers_set` (a
/// `__builtin__.set([...])`) and `_modules`.
fn module_obj(
    w: &mut PickleWriter,
    cls: (&str, &str),
    params: &[(&str, i64)],
    buffers: &[(&str, i64)],
    skip: &[&str],
    children: &mut dyn FnMut(&mut PickleWriter),
) {
    w.global(cls.0, cls.1).op(b')').op(0x81);
    w.op(b'}').op(b'(');
    w.str("training").op(0x88);
    for (field, list) in [("_parameters", params), ("_buffers", buffers)] {
        w.str(field).ordered_dict().op(b'(');
        for &(name, offset) in list {
            w.str(name);
            w.global("torch._utils", "_rebuild_parameter");
            w.tensor_v2("FloatStorage", "0", 4, offset, &[1], &[1]);
            w.op(0x88).ordered_dict().op(0x87).op(b'R');
        }
        w.op(b'u');
    }
    w.str("_non_persistent_buffers_set")
        .global("__builtin__", "set")
        .op(b']')
        .op(b'(');
    for s in skip {
        w.str(s);
    }
    w.op(b'e').op(0x85).op(b'R');
    w.str("hook")
        .global("os", "system")
        .str("touch /tmp/never")
        .op(0x85)
        .op(b'R');
    w.str("_modules").ordered_dict().op(b'(');
    children(w);
    w.op(b'u');
    w.op(b'u').op(b'b');
}

fn whole_module_pickle() -> Vec<u8> {
    let mut w = PickleWriter::new();
    module_obj(
        &mut w,
        ("__main__", "Net"),
        &[("w", 0)],
        &[("keep", 1), ("cache", 2)],
        &["cache"],
        &mut |w| {
            w.str("sub");
            module_obj(
                w,
                ("torch.nn.modules.linear", "Linear"),
                &[("weight", 3)],
                &[],
                &[],
                &mut |_| {},
            );
            w.str("none").op(b'N');
        },
    );
    w.finish()
}

#[test]
fn whole_module_pickle_is_read_in_inert_mode_only_as_a_fallback() {
    let data = f32_bytes(&[1.0, 2.0, 3.0, 4.0]);
    let bytes = archive(&whole_module_pickle(), &[("0", &data)]);
    let ck = read_weights_from(
        Cursor::new(&bytes),
        bytes.len() as u64,
        Path::new(MEM),
        &ReadOptions::default(),
    )
    .unwrap();
    assert_eq!(ck.naming, Naming::ByName);
    let names: Vec<&str> = ck.state.names().collect();
    // Parameters, persistent buffers, then children; the non-persistent buffer is skipped.
    assert_eq!(names, ["w", "keep", "sub.weight"]);
    assert_eq!(f32s(ck.state.get("sub.weight").unwrap()), [4.0]);
    assert_eq!(f32s(ck.state.get("keep").unwrap()), [2.0]);

    // A foreign global that yields no weights keeps the strict error (first global named).
    let mut w = PickleWriter::new();
    w.op(b'}')
        .str("x")
        .global("os", "system")
        .str("id")
        .op(0x85)
        .op(b'R')
        .op(b's');
    let e = read_default(&archive(&w.finish(), &[])).unwrap_err();
    assert_eq!(e.to_string(), forbidden_message("os.system"));
}

#[test]
fn inert_mode_never_calls_and_bounds_nesting() {
    // A module whose child is itself (a cycle) is walked once.
    let mut w = PickleWriter::new();
    w.global("__main__", "M").op(b')').op(0x81).op(b'q').op(9);
    w.op(b'}').op(b'(');
    w.str("_parameters").op(b'}').str("p");
    w.tensor_v2("FloatStorage", "0", 1, 0, &[1], &[1]);
    w.op(b's');
    w.str("_buffers").op(b'}');
    w.str("_modules").op(b'}').str("me").op(b'h').op(9).op(b's');
    w.op(b'u').op(b'b');
    let data = f32_bytes(&[5.0]);
    let sd = read_default(&archive(&w.finish(), &[("0", &data)])).unwrap();
    assert_eq!(sd.names().collect::<Vec<_>>(), ["p"]);

    // Inert objects: REDUCE and BUILD only record data, whatever the global.
    let mut w = PickleWriter::new();
    w.global("builtins", "eval").str("1/0").op(0x85).op(b'R');
    w.op(b'}').str("k").int(1).op(b's').op(b'b');
    let p = pickle::parse(&w.finish(), pickle::Classes::Inert).unwrap();
    let inst = p.instance(&p.root).unwrap();
    assert_eq!(&*inst.class, "builtins.eval");
    assert!(inst.state.is_some());
}

/// A legacy `torch.save(storage)` stream, as `torch.storage._load_from_bytes` receives it.
fn legacy_storage_bytes(values: &[f32], count: u64) -> Vec<u8> {
    let mut out = vec![
        0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19, b'.',
    ];
    let mut w = PickleWriter::new();
    w.op(b'M').0.extend_from_slice(&1001u16.to_le_bytes());
    out.extend(w.finish());
    let mut w = PickleWriter::new();
    w.op(b'}').str("little_endian").op(0x88).op(b's');
    out.extend(w.finish());
    let mut w = PickleWriter::new();
    w.op(b'(')
        .str("storage")
        .global("torch", "FloatStorage")
        .str("93")
        .str("cpu");
    w.long(values.len() as i64).op(b'N').op(b't').op(b'Q');
    out.extend(w.finish());
    let mut w = PickleWriter::new();
    w.op(b']').str("93").op(b'a');
    out.extend(w.finish());
    out.extend(count.to_le_bytes());
    out.extend(f32_bytes(values));
    out
}

/// `pickle.dump({"ema": <persistent module>, "loss": <object>})` with the storage inline.
fn snapshot_pickle(storage: &[u8]) -> Vec<u8> {
    let mut w = PickleWriter::new();
    w.op(b'}').str("ema");
    w.global("torch_utils.persistence", "_reconstruct_persistent_obj");
    w.op(b'}').op(b'(').str("type").str("class");
    w.str("module_src")
        .str("import os; os.system('touch /tmp/never')");
    w.str("state").op(b'}').op(b'(');
    w.str("_parameters").op(b'}').str("w");
    w.global("torch._utils", "_rebuild_tensor_v2").op(b'(');
    w.global("torch.storage", "_load_from_bytes").op(b'B');
    w.0.extend_from_slice(&(storage.len() as u32).to_le_bytes());
    w.0.extend_from_slice(storage);
    w.op(0x85).op(b'R');
    w.long(0)
        .int_tuple(&[2])
        .int_tuple(&[1])
        .op(0x89)
        .ordered_dict()
        .op(b't')
        .op(b'R');
    w.op(b's');
    w.str("_buffers").op(b'}').str("_modules").op(b'}');
    w.op(b'u').op(b'u').op(0x85).op(b'R');
    w.op(b's');
    w.str("loss")
        .global("training.loss", "Loss")
        .op(b')')
        .op(0x81)
        .op(b's');
    w.finish()
}

#[test]
fn plain_pickle_snapshot_with_inline_legacy_storages() {
    let bytes = snapshot_pickle(&legacy_storage_bytes(&[1.5, -2.0], 2));
    assert_eq!(detect(&bytes).unwrap(), CheckpointFormat::Pickle);
    assert_eq!(validate(&bytes).unwrap(), CheckpointFormat::Pickle);
    let ck = read_weights_from(
        Cursor::new(&bytes),
        bytes.len() as u64,
        Path::new(MEM),
        &ReadOptions::default(),
    )
    .unwrap();
    assert_eq!(ck.format, CheckpointFormat::Pickle);
    assert_eq!(ck.state.names().collect::<Vec<_>>(), ["w"]);
    assert_eq!(f32s(ck.state.get("w").unwrap()), [1.5, -2.0]);

    // A storage stream that declares more elements than it holds is an error, not a panic.
    let bad = snapshot_pickle(&legacy_storage_bytes(&[1.5, -2.0], 3));
    let e = read_default(&bad).unwrap_err();
    assert!(e.to_string().contains("_load_from_bytes"), "{e}");
    // Cut short: incomplete.
    let e = validate(&bytes[..bytes.len() - 3]).unwrap_err();
    assert!(e.is_incomplete(), "{e}");
    for cut in [3, bytes.len() / 2, bytes.len() - 1] {
        assert!(read_default(&bytes[..cut]).is_err());
    }
    // Random mutations never panic.
    let mut rng = Rng(11);
    for _ in 0..300 {
        let m = mutate(&mut rng, &bytes);
        let _ = read_default(&m);
    }
}

// ---------------------------------------------------------------------------------------------
// Issue #29: no recursion on file structure, links out of the folder, bounded memory.

/// Runs `f` on a thread with a small stack: a reader that recursed on the file's structure
/// would overflow it (and abort the whole test binary) instead of returning an error.
fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap()
}

#[test]
fn an_index_naming_itself_or_another_index_is_an_error_at_depth_one() {
    let dir = tempfile::tempdir().unwrap();
    // The 36-byte file of the issue: an index whose only shard is itself.
    let me = dir.path().join("ckpt_100.pt");
    std::fs::write(&me, br#"{"weight_map": {"a": "ckpt_100.pt"}}"#).unwrap();
    assert_eq!(std::fs::metadata(&me).unwrap().len(), 36);
    // Two indexes naming each other.
    let a = dir.path().join("a.safetensors.index.json");
    let b = dir.path().join("b.safetensors.index.json");
    std::fs::write(&a, br#"{"weight_map": {"w": "b.safetensors.index.json"}}"#).unwrap();
    std::fs::write(&b, br#"{"weight_map": {"w": "a.safetensors.index.json"}}"#).unwrap();
    let (me2, a2) = (me.clone(), a.clone());
    let errors = on_small_stack(move || {
        [
            validate_structure(&me2).unwrap_err(),
            read_checkpoint(&me2, &ReadOptions::default()).unwrap_err(),
            validate_structure(&a2).unwrap_err(),
            read_checkpoint(&a2, &ReadOptions::default()).unwrap_err(),
        ]
        .map(|e| e.to_string())
    });
    assert!(errors[0].contains("names itself"), "{}", errors[0]);
    assert!(errors[1].contains("names itself"), "{}", errors[1]);
    // The other index is read as a safetensors shard, and refused as one, naming it.
    for e in &errors[2..] {
        assert!(e.contains("b.safetensors.index.json"), "{e}");
        assert!(e.contains("implausible for a file of"), "{e}");
    }
}

/// `depth` modules, each the only child of the one before, the last with one parameter. Built
/// from the innermost out through the memo (`LONG_BINPUT`/`LONG_BINGET`), so the pickle itself
/// nests nothing: only the module tree is deep.
fn nested_modules(depth: usize) -> Vec<u8> {
    let mut w = PickleWriter::new();
    let put = |w: &mut PickleWriter, i: u32| {
        w.op(b'r');
        for b in i.to_le_bytes() {
            w.op(b);
        }
        w.op(b'0');
    };
    w.global("__main__", "M").op(b')').op(0x81);
    w.op(b'}');
    w.str("_parameters").op(b'}').str("p");
    w.tensor_v2("FloatStorage", "0", 1, 0, &[1], &[1]);
    w.op(b's').op(b's');
    w.str("_buffers").op(b'}').op(b's');
    w.str("_modules").op(b'}').op(b's');
    w.op(b'b');
    put(&mut w, 0);
    for i in 1..=depth as u32 {
        w.global("__main__", "M").op(b')').op(0x81);
        w.op(b'}');
        w.str("_parameters").op(b'}').op(b's');
        w.str("_buffers").op(b'}').op(b's');
        w.str("_modules").op(b'}').str("c").op(b'j');
        for b in (i - 1).to_le_bytes() {
            w.op(b);
        }
        w.op(b's').op(b's');
        w.op(b'b');
        put(&mut w, i);
    }
    w.op(b'j');
    for b in (depth as u32).to_le_bytes() {
        w.op(b);
    }
    w.finish()
}

#[test]
fn module_trees_are_walked_without_recursion_and_bounded_in_depth() {
    let data = f32_bytes(&[5.0]);
    let shallow = archive(&nested_modules(200), &[("0", &data)]);
    let deep_pickle = nested_modules(5000);
    let deep = archive(&deep_pickle, &[("0", &data)]);
    let (sd, read_deep, selected_deep) = on_small_stack(move || {
        let bad = |d: String| WeightsError::NotAStateDict {
            path: MEM.into(),
            what: d,
        };
        let p = pickle::parse(&deep_pickle, pickle::Classes::Inert).unwrap();
        (
            read_default(&shallow).map(|sd| sd.names().map(String::from).collect::<Vec<_>>()),
            read_default(&deep).is_err(),
            select::select(&p, &ReadOptions::default(), Path::new(MEM), &bad)
                .map(|s| s.tensors.len())
                .map_err(|e| e.to_string()),
        )
    });
    assert_eq!(sd.unwrap(), [format!("{}p", "c.".repeat(200))]);
    assert!(read_deep);
    let e = selected_deep.unwrap_err();
    assert!(e.contains("nested deeper than 256"), "{e}");
}

#[test]
fn shards_linked_outside_their_folder_are_refused_and_content_never_shown() {
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let secret = elsewhere.path().join("shadow");
    let content = b"root:*:20000:0:99999:7:::\nTOPSECRET-4242\n";
    std::fs::write(&secret, content).unwrap();
    let as_number = u64::from_le_bytes(content[..8].try_into().unwrap()).to_string();
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        br#"{"weight_map": {"w": "model-00001-of-00001.safetensors"}}"#,
    )
    .unwrap();
    let shard = dir.path().join("model-00001-of-00001.safetensors");
    std::os::unix::fs::symlink(&secret, &shard).unwrap();
    for e in [
        validate_structure(&index).unwrap_err(),
        read_checkpoint(&index, &ReadOptions::default()).unwrap_err(),
    ] {
        let e = e.to_string();
        assert!(e.contains("outside the index's folder"), "{e}");
        assert!(!e.contains(&as_number) && !e.contains("TOPSECRET"), "{e}");
        assert!(!e.contains("root") && !e.contains("shadow"), "{e}");
    }
    // A link inside the folder is read as before.
    std::fs::remove_file(&shard).unwrap();
    let real = dir.path().join("real.safetensors");
    std::fs::write(&real, MODEL_SAFETENSORS).unwrap();
    std::os::unix::fs::symlink(&real, &shard).unwrap();
    let e = validate_structure(&index)
        .map(|_| ())
        .map_err(|e| e.to_string());
    assert_eq!(e, Ok(()));
    // The same bytes as a regular shard: the header length is judged, never quoted.
    std::fs::remove_file(&shard).unwrap();
    std::fs::write(&shard, content).unwrap();
    let e = validate_structure(&index).unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "the safetensors header length is implausible for a file of {} bytes",
            content.len()
        )),
        "{e}"
    );
    assert!(!e.contains(&as_number), "{e}");
    // A safetensors file cut inside its header: no length from the file in the message.
    let cut = &MODEL_SAFETENSORS[..20];
    let declared = u64::from_le_bytes(cut[..8].try_into().unwrap()).to_string();
    let e = validate(cut).unwrap_err().to_string();
    assert!(e.contains("runs past the end of the file (20 bytes"), "{e}");
    assert!(!e.contains(&declared), "{e}");
}

/// An architecture of `w: [2, 2]` and `b: [2]` (float32).
fn expected_wb() -> std::sync::Arc<Expected> {
    std::sync::Arc::new(Expected::new(
        [
            ("w".to_string(), vec![2, 2], 4),
            ("b".to_string(), vec![2], 4),
        ],
        2,
    ))
}

fn checked(max_total: u64) -> ReadOptions {
    ReadOptions {
        expected: Some(expected_wb()),
        max_total_bytes: Some(max_total),
        ..ReadOptions::default()
    }
}

/// A state dict whose tensors (name, storage numel, shape) each have a storage of `numel`
/// floats; every storage entry is 1 MiB of deflated zeros (a bomb if it were inflated).
fn declared_bombs(tensors: &[(&str, i64, &[i64])]) -> Vec<u8> {
    let mut w = PickleWriter::new();
    w.ordered_dict().op(b'(');
    for (i, (name, numel, shape)) in tensors.iter().enumerate() {
        let stride: Vec<i64> = match shape.len() {
            2 => vec![shape[1], 1],
            _ => vec![1],
        };
        w.str(name)
            .tensor_v2("FloatStorage", &i.to_string(), *numel, 0, shape, &stride);
    }
    w.op(b'u');
    let pkl = w.finish();
    let mut z = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let deflated = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    z.start_file("a/data.pkl", stored).unwrap();
    z.write_all(&pkl).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for i in 0..tensors.len() {
        z.start_file(format!("a/data/{i}"), deflated).unwrap();
        z.write_all(&zeros).unwrap();
    }
    z.finish().unwrap().into_inner()
}

#[test]
fn names_and_shapes_are_checked_against_the_architecture_before_inflating() {
    let one_gib = 1i64 << 28; // floats
    // Names the architecture does not have, each declaring 1 GiB: a mismatch, nothing read
    // (inflating would end in a CRC or size error instead).
    let foreign = declared_bombs(&[("x", one_gib, &[one_gib]), ("y", one_gib, &[one_gib])]);
    let e = read(&foreign, &checked(64 << 20)).unwrap_err();
    assert!(matches!(e, WeightsError::Mismatch { .. }), "{e}");
    assert!(e.to_string().contains("unexpected (2): x, y"), "{e}");
    // A wanted name of another shape.
    let shape = declared_bombs(&[("w", one_gib, &[one_gib]), ("b", one_gib, &[2])]);
    let e = read(&shape, &checked(64 << 20)).unwrap_err().to_string();
    assert!(
        e.contains("shape mismatch (1): w: checkpoint [268435456]"),
        "{e}"
    );
    // Wanted names and shapes whose storages declare 1 GiB: over the total, refused unread.
    let big = declared_bombs(&[("w", one_gib, &[2, 2]), ("b", 2, &[2])]);
    let e = read(&big, &checked(64 << 20)).unwrap_err();
    assert!(
        matches!(e, WeightsError::TooLargeInAll { limit, .. } if limit == 64 << 20),
        "{e}"
    );
    // Under `Model::load_weights`'s prefix rule: `module.w` is `w`.
    let prefixed = declared_bombs(&[("module.w", 4, &[2, 2]), ("module.b", 2, &[2])]);
    // (The checks pass: its storages are read, bounded by what they declare.)
    let e = read(&prefixed, &checked(64 << 20)).unwrap_err();
    assert!(matches!(e, WeightsError::EntryTooLarge { .. }), "read: {e}");

    // safetensors: a foreign name is refused before its bytes are read; within the total only.
    let e = read(MODEL_SAFETENSORS, &checked(1 << 20)).unwrap_err();
    assert!(matches!(e, WeightsError::Mismatch { .. }), "{e}");
    let opts = ReadOptions {
        expected: Some(std::sync::Arc::new(Expected::new(
            [
                ("w".to_string(), vec![2, 2], 4),
                ("b".to_string(), vec![1], 4),
            ],
            2,
        ))),
        max_total_bytes: Some(16),
        weights_key: Some("ema".into()),
        ..ReadOptions::default()
    };
    let e = read(MODEL_SAFETENSORS, &opts).unwrap_err();
    assert!(matches!(e, WeightsError::TooLargeInAll { .. }), "{e}");
    let opts = ReadOptions {
        max_total_bytes: Some(1 << 20),
        ..opts
    };
    assert_eq!(read(MODEL_SAFETENSORS, &opts).unwrap().len(), 2);

    // TorchScript: attributes the architecture does not have are skipped, never read.
    let opts = ReadOptions {
        expected: Some(std::sync::Arc::new(Expected::new(
            [("weight".to_string(), vec![1, 2], 4)],
            1,
        ))),
        max_total_bytes: Some(1 << 20),
        ..ReadOptions::default()
    };
    let sd = read(TORCHSCRIPT_PT, &opts).unwrap();
    assert_eq!(sd.names().collect::<Vec<_>>(), ["weight"]);
}
