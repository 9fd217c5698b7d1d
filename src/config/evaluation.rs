//! The `evaluation` section: where checkpoints are evaluated (the daemon's evaluator thread or
//! Slurm jobs) and the Slurm jobs' options; as written ([`Evaluation`]) and as settings
//! ([`EvaluationConfig`]), built and checked by [`evaluation`].

use super::validate::Validator;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// `evaluation.executor`: where checkpoints are evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExecutorKind {
    /// The evaluator thread of the daemon, one checkpoint at a time.
    #[default]
    Local,
    /// One Slurm job per checkpoint, `diffmon eval --json` on a compute node.
    Slurm,
}

/// `evaluation.precision`: the arithmetic of the network's forward passes (docs/design.md §11,
/// "Precision"). Everything after the network (moments, eigenproblems, the PF-ODE state) stays
/// in float64/float32 as before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// float32 everywhere, TF32 off: the same numbers on the CPU and the GPU.
    #[default]
    Fp32,
    /// float32 tensors, TF32 allowed in cuDNN convolutions and cuBLAS products (CUDA only; on
    /// the CPU the same as fp32).
    Tf32,
    /// bfloat16 autocast of the forward pass (libtorch's autocast, on the CPU and CUDA): matrix
    /// products and convolutions in bfloat16, the outputs back to float32.
    Bf16,
}

impl Precision {
    /// Its name, as the config writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// `evaluation`: the executor and its settings.
#[derive(Debug, Clone, PartialEq)]
pub struct EvaluationConfig {
    pub executor: ExecutorKind,
    /// `evaluation.precision`.
    pub precision: Precision,
    /// `evaluation.gpu_share`: the share of the GPU's time the forward passes may take, in
    /// (0, 1] (CUDA only).
    pub gpu_share: f64,
    /// `evaluation.gpu_memory_mib`: the most memory CUDA's caching allocator may reserve for an
    /// evaluation, in MiB (CUDA only; none: no cap).
    pub gpu_memory_mib: Option<u64>,
    /// Jobs in flight at once (Slurm).
    pub max_in_flight: usize,
    /// Resubmissions of a job that failed, timed out, was cancelled or lost (Slurm).
    pub retries: usize,
    pub slurm: SlurmConfig,
}

/// `evaluation.slurm`.
#[derive(Debug, Clone, PartialEq)]
pub struct SlurmConfig {
    pub partition: Option<String>,
    pub account: Option<String>,
    /// `--time`, in Slurm's format (`30`, `1:00:00`, `1-0`).
    pub time_limit: Option<String>,
    pub gres: Option<String>,
    /// More `sbatch` options, each one argument.
    pub sbatch_args: Vec<String>,
    /// Set in `sbatch`'s environment, which the job inherits (Slurm's `--export=ALL`).
    pub env: std::collections::BTreeMap<String, String>,
    pub poll: Duration,
    /// The `diffmon` the job runs (default: this process's executable).
    pub binary: Option<PathBuf>,
}

impl Default for EvaluationConfig {
    fn default() -> Self {
        evaluation(&mut Validator::default(), &Evaluation::default())
            .expect("the default evaluation section is valid")
    }
}

/// `evaluation`: where checkpoints are evaluated.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Evaluation {
    #[serde(default)]
    pub(super) executor: ExecutorKind,
    #[serde(default)]
    pub(super) precision: Precision,
    #[serde(default = "default_gpu_share")]
    pub(super) gpu_share: f64,
    #[serde(default)]
    pub(super) gpu_memory_mib: Option<u64>,
    #[serde(default = "default_max_in_flight")]
    pub(super) max_in_flight: usize,
    #[serde(default = "default_retries")]
    pub(super) retries: usize,
    #[serde(default)]
    pub(super) slurm: Slurm,
}

fn default_max_in_flight() -> usize {
    4
}

/// Half of the GPU's time while an evaluation runs: a training job on the same GPU keeps most of
/// its speed, and on a GPU of its own `gpu_share: 1` runs at full speed (docs/guide/cost-and-gpu.md).
fn default_gpu_share() -> f64 {
    0.5
}

impl Default for Evaluation {
    fn default() -> Self {
        Evaluation {
            executor: ExecutorKind::Local,
            precision: Precision::Fp32,
            gpu_share: default_gpu_share(),
            gpu_memory_mib: None,
            max_in_flight: default_max_in_flight(),
            retries: default_retries(),
            slurm: Slurm::default(),
        }
    }
}

/// `evaluation.slurm`: the jobs' `sbatch` options.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Slurm {
    #[serde(default)]
    pub(super) partition: Option<String>,
    #[serde(default)]
    pub(super) account: Option<String>,
    #[serde(default)]
    pub(super) time_limit: Option<String>,
    #[serde(default)]
    pub(super) gres: Option<String>,
    #[serde(default)]
    pub(super) sbatch_args: Vec<String>,
    #[serde(default)]
    pub(super) env: std::collections::BTreeMap<String, String>,
    #[serde(default = "default_slurm_poll_secs")]
    pub(super) poll_secs: f64,
    #[serde(default)]
    pub(super) binary: Option<PathBuf>,
}

fn default_slurm_poll_secs() -> f64 {
    5.0
}

fn default_retries() -> usize {
    1
}

impl Default for Slurm {
    fn default() -> Self {
        Slurm {
            partition: None,
            account: None,
            time_limit: None,
            gres: None,
            sbatch_args: Vec::new(),
            env: Default::default(),
            poll_secs: default_slurm_poll_secs(),
            binary: None,
        }
    }
}

/// The `evaluation` section's settings; `None` when a value is refused.
pub(super) fn evaluation(v: &mut Validator, e: &Evaluation) -> Option<EvaluationConfig> {
    v.count("evaluation.max_in_flight", e.max_in_flight, 1..=1024);
    v.positive("evaluation.gpu_share", e.gpu_share, 1.0);
    if let Some(mib) = e.gpu_memory_mib {
        // Below 64 MiB no network of the contract fits beside its inputs; above 16 TiB is a typo.
        v.check(
            (64..=1 << 24).contains(&mib),
            "evaluation.gpu_memory_mib",
            format!("must be between 64 and 16777216 (MiB), got {mib}"),
        );
    }
    let s = &e.slurm;
    // One word each: they become single sbatch arguments.
    let word = |x: &str| {
        !x.is_empty() && x.len() <= 256 && !x.chars().any(|c| c.is_whitespace() || c.is_control())
    };
    for (key, value) in [
        ("evaluation.slurm.partition", &s.partition),
        ("evaluation.slurm.account", &s.account),
        ("evaluation.slurm.gres", &s.gres),
    ] {
        if let Some(x) = value {
            v.check(
                word(x),
                key,
                format!("must be one word without spaces, got `{x}`"),
            );
        }
    }
    if let Some(t) = &s.time_limit {
        let ok = !t.is_empty()
            && t.len() <= 32
            && t.chars()
                .all(|c| c.is_ascii_digit() || c == ':' || c == '-')
            && t.starts_with(|c: char| c.is_ascii_digit());
        v.check(
            ok,
            "evaluation.slurm.time_limit",
            format!("must be a Slurm time such as `30`, `1:00:00` or `1-0`, got `{t}`"),
        );
    }
    v.check(
        s.sbatch_args.len() <= 64,
        "evaluation.slurm.sbatch_args",
        format!("lists {} options; at most 64", s.sbatch_args.len()),
    );
    for (k, a) in s.sbatch_args.iter().enumerate() {
        v.check(
            a.starts_with('-') && a.len() <= 1024 && !a.chars().any(|c| c.is_control()),
            &format!("evaluation.slurm.sbatch_args[{k}]"),
            format!("must be one sbatch option starting with `-`, got `{a}`"),
        );
    }
    v.check(
        s.env.len() <= 256,
        "evaluation.slurm.env",
        format!("sets {} variables; at most 256", s.env.len()),
    );
    for (name, value) in &s.env {
        let ok = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        v.check(
            ok,
            &format!("evaluation.slurm.env.{name}"),
            "must be a variable name (letters, digits, `_`)",
        );
        v.check(
            !value.contains('\0') && value.len() <= 4096,
            &format!("evaluation.slurm.env.{name}"),
            "must be at most 4096 bytes without NUL",
        );
    }
    let poll = v.secs("evaluation.slurm.poll_secs", s.poll_secs, 0.1..=3600.0);
    v.check(
        e.retries <= 100,
        "evaluation.retries",
        format!("must be between 0 and 100, got {}", e.retries),
    );
    // The compute node's path: not checked here, where it may not exist.
    Some(EvaluationConfig {
        executor: e.executor,
        precision: e.precision,
        gpu_share: e.gpu_share,
        gpu_memory_mib: e.gpu_memory_mib,
        max_in_flight: e.max_in_flight,
        retries: e.retries,
        slurm: SlurmConfig {
            partition: s.partition.clone(),
            account: s.account.clone(),
            time_limit: s.time_limit.clone(),
            gres: s.gres.clone(),
            sbatch_args: s.sbatch_args.clone(),
            env: s.env.clone(),
            poll: poll?,
            binary: s.binary.clone(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{MINIMAL, settings};
    use super::*;

    /// `evaluation`: the defaults are today's local evaluator; the Slurm settings arrive as
    /// written, the binary resolved against the config's folder.
    #[test]
    fn the_evaluation_section_defaults_to_local_and_reads_the_slurm_options() {
        let c = settings(MINIMAL);
        assert_eq!(c.evaluation.executor, ExecutorKind::Local);
        assert_eq!(c.evaluation.max_in_flight, 4);
        assert_eq!(c.evaluation.slurm.poll, Duration::from_secs(5));
        assert_eq!(c.evaluation.retries, 1);
        assert_eq!(c.evaluation, EvaluationConfig::default());
        let c = settings(&format!(
            "{MINIMAL}evaluation:\n  executor: slurm\n  max_in_flight: 8\n  retries: 0\n  slurm:\n    \
             partition: gpu\n    account: lab\n    time_limit: \"1-0\"\n    gres: \"gpu:1\"\n    \
             sbatch_args: [\"--mem=16G\"]\n    env: {{OMP_NUM_THREADS: \"4\"}}\n    \
             poll_secs: 0.5\n    binary: bin/diffmon\n"
        ));
        let (e, s) = (&c.evaluation, &c.evaluation.slurm);
        assert_eq!((e.executor, e.max_in_flight), (ExecutorKind::Slurm, 8));
        assert_eq!(s.partition.as_deref(), Some("gpu"));
        assert_eq!(s.account.as_deref(), Some("lab"));
        assert_eq!(s.time_limit.as_deref(), Some("1-0"));
        assert_eq!(s.gres.as_deref(), Some("gpu:1"));
        assert_eq!(s.sbatch_args, ["--mem=16G"]);
        assert_eq!(s.env["OMP_NUM_THREADS"], "4");
        assert_eq!((s.poll, e.retries), (Duration::from_millis(500), 0));
        let binary = s.binary.as_ref().unwrap();
        assert!(
            binary.is_absolute() && binary.ends_with("bin/diffmon"),
            "{binary:?}"
        );
    }

    /// `evaluation.precision`: fp32 by default; the three values read; another is refused with
    /// its key and the values it may take.
    #[test]
    fn the_precision_is_fp32_unless_set() {
        assert_eq!(settings(MINIMAL).evaluation.precision, Precision::Fp32);
        for (text, p) in [
            ("fp32", Precision::Fp32),
            ("tf32", Precision::Tf32),
            ("bf16", Precision::Bf16),
        ] {
            let c = settings(&format!("{MINIMAL}evaluation: {{precision: {text}}}\n"));
            assert_eq!((c.evaluation.precision, p.as_str()), (p, text));
        }
        let e = crate::config::file::ConfigFile::parse(
            &format!("{MINIMAL}evaluation: {{precision: fp16}}\n"),
            "c.yaml",
        )
        .map(|_| ())
        .expect_err("fp16 refused")
        .to_string();
        assert!(
            e.contains("evaluation.precision") && e.contains("bf16"),
            "{e}"
        );
    }

    /// `evaluation.gpu_share` and `gpu_memory_mib`: half of the GPU and no cap by default; a
    /// share outside (0, 1] and a cap below 64 MiB are refused, naming the key.
    #[test]
    fn the_gpu_share_is_a_half_and_memory_is_not_capped_unless_set() {
        let c = settings(MINIMAL);
        assert_eq!(
            (c.evaluation.gpu_share, c.evaluation.gpu_memory_mib),
            (0.5, None)
        );
        let c = settings(&format!(
            "{MINIMAL}evaluation: {{gpu_share: 0.25, gpu_memory_mib: 4096}}\n"
        ));
        assert_eq!(
            (c.evaluation.gpu_share, c.evaluation.gpu_memory_mib),
            (0.25, Some(4096))
        );
        for (body, key, says) in [
            ("gpu_share: 0", "evaluation.gpu_share", "> 0"),
            ("gpu_share: 1.5", "evaluation.gpu_share", "≤ 1"),
            (
                "gpu_memory_mib: 10",
                "evaluation.gpu_memory_mib",
                "between 64",
            ),
        ] {
            let mut file = crate::config::file::ConfigFile::parse(
                &format!("{MINIMAL}evaluation: {{{body}}}\n"),
                "c.yaml",
            )
            .unwrap();
            let dir = tempfile::tempdir().unwrap();
            file.resolve_paths(dir.path());
            let problems = file.settings(false).map(|_| ()).expect_err(body);
            let e = problems.iter().map(|p| p.to_string()).collect::<String>();
            assert!(e.contains(key) && e.contains(says), "{body}: {e}");
        }
    }
}
