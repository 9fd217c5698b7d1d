//! The TensorBoard event-file reader on arbitrary bytes (what the writer reads back from its
//! run folder at start-up, docs/design.md §21): records and event heads, or an error, never a
//! panic, an overflow or an allocation beyond the input.
#![no_main]

use diffmon::trackers::event_file::{decode, records};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The bytes as a file of records, and as one record's protocol buffer.
    if let Ok((records, _torn)) = records(data) {
        for record in records {
            let _ = decode(record);
        }
    }
    let _ = decode(data);
});
