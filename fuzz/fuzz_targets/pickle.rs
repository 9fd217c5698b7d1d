//! The pickle interpreter, state-dict selection and tensor materialization. The input is a
//! `data.pkl`; the target wraps it in a well-formed torch.save zip (so that no mutation is
//! stopped by a zip CRC) whose storages `0` to `15` hold 4096 bytes each, then reads it as the
//! `checkpoint` target does.
#![no_main]

mod common;

use std::io::{Cursor, Write};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use zip::write::SimpleFileOptions;
use zip::{CompressionMethod, ZipWriter};

const STORAGES: usize = 16;
const STORAGE_BYTES: usize = 4096;

/// A torch.save archive holding `pickle` as its `data.pkl`.
fn archive(pickle: &[u8]) -> Vec<u8> {
    static STORAGE: OnceLock<Vec<u8>> = OnceLock::new();
    let storage = STORAGE.get_or_init(|| (0..STORAGE_BYTES).map(|i| i as u8).collect());
    let mut zip = ZipWriter::new(Cursor::new(Vec::new()));
    let stored = SimpleFileOptions::default().compression_method(CompressionMethod::Stored);
    let mut add = |name: &str, bytes: &[u8]| {
        zip.start_file(name, stored).expect("zip entry");
        zip.write_all(bytes).expect("zip write");
    };
    add("archive/data.pkl", pickle);
    add("archive/byteorder", b"little");
    for key in 0..STORAGES {
        add(&format!("archive/data/{key}"), storage);
    }
    zip.finish().expect("zip finish").into_inner()
}

fuzz_target!(|pickle: &[u8]| common::check_readers(&archive(pickle)));
