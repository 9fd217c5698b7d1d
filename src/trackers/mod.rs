//! Experiment trackers diffmon writes a run's numbers into, beside the training job's own
//! curves (docs/design.md §21, docs/guide/trackers.md): TensorBoard event files
//! ([`tensorboard`], in the format of [`event_file`]) and an MLflow tracking server ([`mlflow`]),
//! each showing a run's [`timeline`].

pub mod event_file;
pub mod mlflow;
pub mod tensorboard;
pub mod timeline;
pub mod tracker;

pub use mlflow::Mlflow;
pub use tensorboard::Tensorboard;
pub use tracker::Tracker;
