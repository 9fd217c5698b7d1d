//! The bias–variance decomposition of students' errors against a teacher (`diffmon bias-variance`).

use super::error::PfdError;
use tch::{Kind, Tensor};

/// The offline bias–variance decomposition of E_gen over students trained on independent data
/// (docs/design.md §5, PFD paper App. B.3).
#[derive(Debug, Clone, serde::Serialize)]
pub struct BiasVariance {
    pub students: Vec<StudentError>,
    pub e_bias: f64,
    pub e_var: f64,
    /// `mean_k E_gen,k²`, which equals `E_bias² + E_var`.
    pub mean_e_gen_squared: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct StudentError {
    pub checkpoint: String,
    pub e_gen: f64,
}

/// `t`: teacher descriptors `[M,k]`; `students`: each student's `[M,k]` (float64, CPU).
pub fn bias_variance(t: &Tensor, students: &[(String, Tensor)]) -> Result<BiasVariance, PfdError> {
    if students.len() < 2 {
        return Err(PfdError::Invalid(
            "bias-variance needs at least two students".into(),
        ));
    }
    let m = t.size()[0] as f64;
    let k = students.len() as f64;
    let stacked = Tensor::stack(
        &students
            .iter()
            .map(|(_, f)| f.shallow_clone())
            .collect::<Vec<_>>(),
        0,
    );
    let mean = stacked.mean_dim(0, false, Kind::Double);
    let rows = students
        .iter()
        .map(|(name, f)| StudentError {
            checkpoint: name.clone(),
            e_gen: ((f - t).square().sum(Kind::Double).double_value(&[]) / m).sqrt(),
        })
        .collect::<Vec<_>>();
    let e_bias = ((t - &mean).square().sum(Kind::Double).double_value(&[]) / m).sqrt();
    let e_var = (stacked - mean.unsqueeze(0))
        .square()
        .sum(Kind::Double)
        .double_value(&[])
        / (m * k);
    let mean_e_gen_squared = rows.iter().map(|r| r.e_gen * r.e_gen).sum::<f64>() / k;
    Ok(BiasVariance {
        students: rows,
        e_bias,
        e_var,
        mean_e_gen_squared,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn bias_variance_identity_holds_on_random_features() {
        tch::manual_seed(1);
        let t = Tensor::randn([50, 7], (Kind::Double, Device::Cpu));
        let students: Vec<(String, Tensor)> = (0..4)
            .map(|k| {
                let f = &t + Tensor::randn([50, 7], (Kind::Double, Device::Cpu)) * 0.3 + 0.1;
                (format!("s{k}"), f)
            })
            .collect();
        let bv = bias_variance(&t, &students).unwrap();
        let rhs = bv.e_bias * bv.e_bias + bv.e_var;
        assert!(
            (bv.mean_e_gen_squared - rhs).abs() <= 1e-12 * rhs,
            "{} vs {rhs}",
            bv.mean_e_gen_squared
        );
    }
}
