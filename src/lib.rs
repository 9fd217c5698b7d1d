//! diffmon: a monitoring daemon for diffusion-model training. What it computes and promises is
//! `docs/design.md` (cited as `docs/design.md §N`); how it is built is `ARCHITECTURE.md`; the
//! README is the user guide. One module per pipeline stage.

pub mod alerts;
pub mod cli;
pub mod config;
pub mod crash;
pub mod daemon;
pub mod data;
pub mod detector;
pub mod eval;
pub mod history;
pub mod http;
pub mod icr;
pub mod init;
pub mod keep_best;
pub mod lock;
pub mod metrics;
pub mod model;
pub mod pfd;
pub mod progress;
pub mod record;
pub mod report;
pub mod safe_fs;
pub mod sampler;
pub mod sign;
pub mod state_dir;
pub mod tail;
pub mod unit;
pub mod watcher;
pub mod weights;
