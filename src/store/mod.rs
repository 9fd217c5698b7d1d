//! What diffmon keeps on disk, and how it touches folders that someone else may write
//! (docs/design.md §1.8): the daemon's support, used by the daemon's stages and the evaluator.
//!
//! - [`safe_fs`]: writes that follow no link, atomic replacement, bounded reads, names of
//!   untrusted entries escaped for logs;
//! - [`state_dir`]: the state folder, held by a handle so a swapped path is not followed;
//!   [`lock`]: one daemon per state folder;
//! - [`history`]: the journal of every outcome (`history.jsonl`, `history.h5`);
//! - [`crash`]: the crash marker, so a checkpoint that killed the process is recorded, not
//!   evaluated again; [`package_trial`]: a compiled package that killed the starts is refused;
//! - [`unit`]: what a checkpoint is in a run folder (a file, or a folder and its weights);
//! - [`keep_best`]: the keeper of the best checkpoints; [`pin`]: checkpoints pinned against
//!   rotation from when they are found complete until their outcome is recorded; [`restore`]:
//!   the kept best put back for `diffmon resume`, and its copies recognized;
//! - [`parameterization`]: the parameterization check's warning while it stands.

pub mod crash;
pub mod history;
pub mod keep_best;
pub mod lock;
pub mod package_trial;
pub mod parameterization;
pub mod pin;
pub mod restore;
pub mod safe_fs;
pub mod state_dir;
pub mod unit;
