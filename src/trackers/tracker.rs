//! What every tracker is to the daemon's outputs.

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
