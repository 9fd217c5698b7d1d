//! Experiment trackers diffmon writes a run's numbers into, beside the training job's own
//! curves (docs/design.md §21, docs/guide/trackers.md): TensorBoard event files
//! ([`tensorboard`], in the format of [`event_file`]) and an MLflow tracking server ([`mlflow`]),
//! each showing a run's [`timeline`].

pub mod event_file;
pub mod mlflow;
pub mod tensorboard;
pub mod timeline;

pub use mlflow::Mlflow;
pub use tensorboard::Tensorboard;

use crate::alerts::Event;
use crate::engine::detector::DetectorState;
use crate::record::Evaluation;
use crate::store::history::CheckpointKey;

/// A tracker as the daemon's outputs drive it (`daemon/outputs.rs`): the replay's events once at
/// start-up (placed among the history's items, then the history is written), then each live
/// evaluation and event, then the stop.
pub trait Tracker: Send {
    fn replayed(&mut self, events: &[Event]);
    fn evaluation(&mut self, record: &Evaluation, key: &CheckpointKey, state: &DetectorState);
    fn event(&mut self, event: &Event);
    /// The daemon stops: finish what is under way, in a bounded time.
    fn close(self: Box<Self>, _runtime: &tokio::runtime::Runtime) {}
}
