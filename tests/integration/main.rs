//! Integration tests: real TorchScript models and checkpoints written by PyTorch (the project's
//! Python helpers, run in the project's virtual environment), real HDF5 files, the real binary.

mod bad_input;
mod chaos;
mod chaos_commands;
mod cli;
mod common;
mod compiled;
mod daemon;
mod data;
mod devices;
mod early_stop;
mod early_stop_training;
mod eval;
mod flow;
mod formats;
mod hostile;
mod hostile_files;
mod hostile_process;
mod icr;
mod keep_best;
mod latent;
mod model;
mod monitoring;
mod multifile;
mod pfd;
mod reliability;
mod report;
mod resume;
mod slurm;
mod slurm_cluster;
mod stacks;
mod state_folder;
mod sweep;
mod tail;
mod trackers;
mod units;
