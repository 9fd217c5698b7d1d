//! The checkpoint readers on arbitrary files: format detection (zip magic and archive layout,
//! safetensors header), the structure check and the reader, for torch.save zips, TorchScript
//! archives and safetensors files. Every input must give a result or an error: never a panic, an
//! overflow, a huge allocation or a hang.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|file: &[u8]| common::check_readers(file));
