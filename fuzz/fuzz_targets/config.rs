//! The configuration parser and validation on arbitrary text: a `Config` or an error, never a
//! panic, an overflow or a hang.
#![no_main]

use diffmon::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Config::parse(text, "fuzz.yaml") {
        Ok(config) => {
            for problem in config.validate() {
                let _ = problem.to_string();
            }
            let _ = config.early_stop_resolved();
            let _ = config.state_dir();
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
