//! `diffmon bias-variance`: E_gen per student, E_bias and E_var.

use crate::config::Config;
use crate::engine::model::Model;
use crate::engine::pfd::{self, PfdProbe};
use anyhow::Result;
use std::path::{Path, PathBuf};

/// `diffmon bias-variance`: E_gen of each student against the teacher, and its decomposition.
pub fn bias_variance(config_path: &Path, students: &[PathBuf]) -> Result<()> {
    let config = Config::load_without_secrets(config_path)?;
    if config.pfd.teacher.is_none() {
        anyhow::bail!(
            "{}: pfd.teacher: bias-variance needs a teacher model",
            config_path.display()
        );
    }
    if let Some(n) = config.cpu_threads {
        tch::set_num_threads(n as i32);
    }
    let device = crate::engine::model::select_device(config.device)?;
    let train = crate::engine::data::ImageSet::open(&config.data.path, &config.data.dataset)?;
    let vae = match &config.model.vae {
        Some(p) => Some(crate::engine::latent::Vae::load(
            p,
            device,
            config.pfd.batch_size,
        )?),
        None => None,
    };
    let shape: Vec<i64> = crate::engine::latent::input_shape(&config, vae.as_ref(), &train)?
        .iter()
        .map(|&d| d as i64)
        .collect();
    let mut model = Model::load(&config.model.architecture, device)?;
    model.check_contract(&shape)?;
    // A teacher-only probe needs the network's input shape, not the training set.
    let mut one = vec![1];
    one.extend_from_slice(&shape);
    let first = tch::Tensor::zeros(one.as_slice(), (tch::Kind::Float, device));
    let probe = PfdProbe::teacher_only(&config, &first, device)?;
    let opts = crate::engine::eval::read_options(&config.checkpoints);
    let mut features = Vec::new();
    for path in students {
        model.load_weights(path, &opts)?;
        let what = path.display().to_string();
        features.push((what.clone(), probe.student_features(&model, &what)?));
    }
    let teacher = probe
        .teacher_features()
        .expect("a teacher is configured")
        .to_device(tch::Device::Cpu);
    let bv = pfd::bias_variance(&teacher, &features)?;
    super::output::line(serde_json::to_string(&bv)?)?;
    Ok(())
}
