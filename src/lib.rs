//! diffmon: a monitoring daemon for diffusion-model training (see DESIGN.md in the project's
//! shared folder and the README). One module per pipeline stage.

pub mod cli;
pub mod config;
pub mod data;
pub mod eval;
pub mod icr;
pub mod model;
pub mod record;
pub mod weights;
