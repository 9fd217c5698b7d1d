//! diffmon: a monitoring daemon for diffusion-model training. What it computes and promises is
//! `docs/design.md` (cited as `docs/design.md §N`); how it is built is `ARCHITECTURE.md`; the
//! README and `docs/guide/` are the user guide. The tree: the science in `engine`, the daemon's
//! stages in `daemon`, the checkpoint readers in `weights`, the files it keeps and how it touches
//! run folders in `store` (ARCHITECTURE.md, "Modules").

#[macro_use]
mod labels;

pub mod alerts;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod engine;
pub mod metrics;
pub mod record;
pub mod report;
pub mod sign;
pub mod store;
pub mod trackers;
pub mod weights;
