//! The safetensors reader on arbitrary headers. The input is the JSON header; the target writes
//! the length prefix and, when the `safetensors` crate accepts the header, the data section it
//! describes (up to 1 MiB), so that mutated headers are not stopped by a wrong length and reach
//! the reader's tensor loop. Then it reads the file as the `checkpoint` target does.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use safetensors::tensor::Metadata;

const MAX_DATA: usize = 1 << 20;

fuzz_target!(|header: &[u8]| {
    let data_len = serde_json::from_slice::<Metadata>(header)
        .ok()
        .map(|m| m.data_len())
        .filter(|&n| n <= MAX_DATA)
        .unwrap_or(0);
    let mut file = Vec::with_capacity(8 + header.len() + data_len);
    file.extend_from_slice(&(header.len() as u64).to_le_bytes());
    file.extend_from_slice(header);
    file.extend((0..data_len).map(|i| i as u8));
    common::check_readers(&file);
});
