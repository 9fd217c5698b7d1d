//! The science: what diffmon computes from a checkpoint, with no knowledge of the daemon around
//! it (docs/design.md §1). Each module is one step of an evaluation:
//!
//! - [`model`]: the network's runtime (libtorch through `tch`): the model contract, the device,
//!   weights swapped in per checkpoint;
//! - [`data`]: the training (and held-out) images, from HDF5; [`latent`]: a latent model's
//!   autoencoder and the training set's latents;
//! - [`icr`]: the ICR of the model's own features on augmented views (§1.1);
//! - [`sampler`]: the probability-flow ODE (Heun) of a model or of the training set's empirical
//!   flow; [`pfd`]: PFD against the teacher (E_gen) and the empirical flow (E_mem), the
//!   memorization ratio; [`tail`]: the tail metrics of those distances;
//! - [`detector`]: the early stop, a decision over the history of evaluations;
//! - [`eval`]: one evaluation of one checkpoint, every enabled metric, as a record;
//! - [`progress`]: progress reports of long computations.

pub mod data;
pub mod detector;
pub mod eval;
pub mod icr;
pub mod latent;
pub mod model;
pub mod pfd;
pub mod progress;
pub mod sampler;
pub mod tail;
