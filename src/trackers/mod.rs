//! Experiment trackers diffmon writes a run's numbers into, beside the training job's own
//! curves (docs/design.md §21, docs/guide/trackers.md): TensorBoard event files
//! ([`tensorboard`], in the format of [`event_file`]).

pub mod event_file;
pub mod tensorboard;

pub use tensorboard::Tensorboard;
