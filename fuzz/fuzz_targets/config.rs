//! The configuration parser and the settings built from it, on arbitrary text: settings or
//! problems (or a parse error), never a panic, an overflow or a hang.
#![no_main]

use diffmon::config::ConfigFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ConfigFile::parse(text, "fuzz.yaml") {
        Ok(file) => match file.settings(true) {
            Ok(config) => {
                let _ = config.early_stop_resolved();
                let _ = config.state_dir();
                let _ = config.cost_summary();
            }
            Err(problems) => {
                for problem in problems {
                    let _ = problem.to_string();
                }
            }
        },
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
