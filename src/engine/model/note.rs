//! The exporter's note inside a TorchScript file that `diffmon-export` wrote
//! (`extra/diffmon.json`): the one contract between the exporter (`python/diffmon/export`) and
//! the daemon, typed here (docs/guide/model-contract.md, "The exporter's note"). It is read
//! bounded, and `Model::load` and `check-config` read it through [`export_note`].
//!
//! A note of version [`NOTE_VERSION`] names its version and kind, and a field this reader does
//! not know is an error (a renamed field on one side shows at once). A note without a version
//! comes from an exporter before the contract was versioned: it is read with the fields it has,
//! others ignored. A newer version is an error that says to upgrade diffmon.

use super::error::ModelError;
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The note's entry in the architecture archive.
const EXPORT_NOTE: &str = "extra/diffmon.json";
/// The most a note may be (the file is trusted, but the read is bounded all the same).
const MAX_NOTE_BYTES: u64 = 1 << 20;
/// The version of the note this diffmon reads and `diffmon-export` writes (`note_version`).
pub const NOTE_VERSION: u32 = 1;

/// What the exporter recorded: a network's note or an autoencoder's (`kind`).
#[derive(Debug, Clone, PartialEq)]
pub enum ExportNote {
    Network(NetworkNote),
    Vae(VaeNote),
}

/// A network's note: the conversion to the EDM denoiser, the condition held fixed, the feature
/// layer, the input shape of the trace, the buffers no checkpoint holds.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct NetworkNote {
    pub note_version: Option<u32>,
    /// `network` (absent from notes before the version).
    pub kind: Option<String>,
    pub torch: Option<String>,
    #[serde(default)]
    pub device_independent: bool,
    /// Buffers of the module that no `state_dict()` holds: checkpoints need not have them.
    #[serde(default)]
    pub non_persistent_buffers: Vec<String>,
    /// `[C, H, W]` of the trace (absent from files of older exporters).
    pub input_shape: Option<Vec<i64>>,
    pub feature_layer: Option<String>,
    /// A name of the exporter's parameterization table (`diffmon-export --help`).
    pub parameterization: Option<String>,
    #[serde(default)]
    pub learned_sigma: bool,
    /// `null` when the network gets nothing besides `(x, t)`.
    #[serde(default)]
    pub condition: Option<Condition>,
    pub family: Option<Family>,
    /// A flow-matching network's path (null for the other families).
    pub path: Option<FlowPath>,
    pub prediction: Option<String>,
    /// A VP network's noise schedule (`linear`, `cosine`, `alphas_cumprod`).
    pub schedule: Option<String>,
    /// A flow or continuous-VP network's time scale.
    pub t_scale: Option<f64>,
    /// A discrete VP schedule's highest noise level (absent from files of older exporters).
    pub sigma_max: Option<f64>,
    /// Fields this version does not know: refused in a versioned note.
    #[serde(flatten)]
    unknown: BTreeMap<String, Value>,
}

/// An autoencoder's note (`diffmon.export.export_vae`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct VaeNote {
    pub note_version: Option<u32>,
    /// Always `vae`.
    pub kind: String,
    pub torch: Option<String>,
    #[serde(default)]
    pub device_independent: bool,
    #[serde(default)]
    pub non_persistent_buffers: Vec<String>,
    pub scaling_factor: Option<f64>,
    pub shift_factor: Option<f64>,
    /// How `encode` reads the posterior (`posterior mean`).
    pub encode: Option<String>,
    pub image_shape: Option<Vec<i64>>,
    pub latent_shape: Option<Vec<i64>>,
    #[serde(flatten)]
    unknown: BTreeMap<String, Value>,
}

/// What the network is held at besides `(x, t)`, and the embeddings held next to it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Condition {
    /// No condition but the extra inputs.
    None {
        #[serde(default)]
        extra: Vec<Embedding>,
    },
    /// A class index (the null class of a classifier-free-guidance network by default).
    Class {
        keyword: String,
        label: i64,
        #[serde(default)]
        null_class: bool,
        /// How the null index was found (null when the label is not the null class).
        #[serde(default)]
        rule: Option<String>,
        /// Taken by default because the network is class-conditional.
        #[serde(default)]
        default: bool,
        #[serde(default)]
        extra: Vec<Embedding>,
    },
    /// A fixed embedding (a text encoder's output for the empty prompt): the keyword it is
    /// passed as, its file (basename) and SHA-256 when it came from one, its shape `[1, L, D]`.
    Embedding {
        keyword: String,
        #[serde(default)]
        file: Option<String>,
        #[serde(default)]
        sha256: Option<String>,
        shape: Vec<i64>,
        #[serde(default)]
        extra: Vec<Embedding>,
    },
}

/// An embedding held next to the condition (an SD3-style transformer's `pooled_projections`),
/// as the exporter records it: `kind` is always `embedding`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Embedding {
    #[serde(default)]
    pub kind: EmbeddingKind,
    pub keyword: String,
    #[serde(default)]
    pub file: Option<String>,
    #[serde(default)]
    pub sha256: Option<String>,
    pub shape: Vec<i64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmbeddingKind {
    #[default]
    Embedding,
}

/// How the network's output was converted to the EDM denoiser.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    Edm,
    Vp,
    Flow,
}

/// The flow-matching paths the exporter converts (`FLOW_PATHS` in
/// `python/diffmon/export/parameterization.py`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlowPath {
    RectifiedFlow,
    Cosine,
    SitLinear,
    SitGvp,
}

impl FlowPath {
    /// The path in words, with where its data and noise are.
    pub fn describe(self) -> &'static str {
        match self {
            FlowPath::RectifiedFlow => "rectified flow, x_t = (1 − t)·x + t·n",
            FlowPath::Cosine => "the cosine path, x_t = cos(πt/2)·x + sin(πt/2)·n",
            FlowPath::SitLinear => {
                "SiT's Linear path, x_t = t·x + (1 − t)·n (SiT's code: data at t = 1)"
            }
            FlowPath::SitGvp => {
                "SiT's GVP path, x_t = sin(πt/2)·x + cos(πt/2)·n (SiT's code: data at t = 1)"
            }
        }
    }

    /// The path's time at the EDM noise level `sigma` (= σ_t / α_t).
    pub fn time_at(self, sigma: f64) -> f64 {
        match self {
            FlowPath::RectifiedFlow => sigma / (1.0 + sigma),
            FlowPath::Cosine => sigma.atan() * std::f64::consts::FRAC_2_PI,
            FlowPath::SitLinear => 1.0 / (1.0 + sigma),
            FlowPath::SitGvp => (1.0 / sigma).atan() * std::f64::consts::FRAC_2_PI,
        }
    }

    /// The EDM noise level at the path's time `t`.
    pub fn sigma_at(self, t: f64) -> f64 {
        match self {
            FlowPath::RectifiedFlow => t / (1.0 - t),
            FlowPath::Cosine => (t * std::f64::consts::FRAC_PI_2).tan(),
            FlowPath::SitLinear => (1.0 - t) / t,
            FlowPath::SitGvp => 1.0 / (t * std::f64::consts::FRAC_PI_2).tan(),
        }
    }

    /// Whether the data is at t = 1 (SiT's code) rather than t = 0.
    pub fn data_at_one(self) -> bool {
        // Every path named: a new one must say where its data is.
        match self {
            FlowPath::SitLinear | FlowPath::SitGvp => true,
            FlowPath::RectifiedFlow | FlowPath::Cosine => false,
        }
    }
}

impl ExportNote {
    /// The note of `text` (the JSON of `extra/diffmon.json`), checked against the contract.
    pub fn parse(text: &str) -> Result<ExportNote, String> {
        let value: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let version = match value.get("note_version") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| format!("note_version {v} is not a version number"))?,
            ),
        };
        if let Some(v) = version.filter(|v| *v > NOTE_VERSION) {
            return Err(format!(
                "note_version {v}: written by a newer diffmon-export than this diffmon reads \
                 (version {NOTE_VERSION}); upgrade diffmon, or export with this version's \
                 diffmon-export"
            ));
        }
        let kind = value.get("kind").and_then(Value::as_str).map(str::to_owned);
        let (note, unknown) = match kind.as_deref() {
            Some("vae") => {
                let n: VaeNote = serde_json::from_value(value).map_err(|e| e.to_string())?;
                let unknown = n.unknown.keys().cloned().collect::<Vec<_>>();
                (ExportNote::Vae(n), unknown)
            }
            None | Some("network") => {
                let n: NetworkNote = serde_json::from_value(value).map_err(|e| e.to_string())?;
                let unknown = n.unknown.keys().cloned().collect::<Vec<_>>();
                (ExportNote::Network(n), unknown)
            }
            Some(other) => return Err(format!("kind {other:?} is neither `network` nor `vae`")),
        };
        if version.is_some() && !unknown.is_empty() {
            return Err(format!(
                "fields this diffmon does not know: {} (a diffmon-export of another version?)",
                unknown.join(", ")
            ));
        }
        Ok(note)
    }

    /// The network's note (`None` for an autoencoder's).
    pub fn network(&self) -> Option<&NetworkNote> {
        match self {
            ExportNote::Network(n) => Some(n),
            ExportNote::Vae(_) => None,
        }
    }

    pub fn is_vae(&self) -> bool {
        matches!(self, ExportNote::Vae(_))
    }

    fn non_persistent_buffers(&self) -> &[String] {
        match self {
            ExportNote::Network(n) => &n.non_persistent_buffers,
            ExportNote::Vae(n) => &n.non_persistent_buffers,
        }
    }
}

/// The exporter's note of a TorchScript file: `Ok(None)` for a file without one (made
/// otherwise), an error naming the file for a note that breaks the contract (malformed, a
/// newer version, a field this version does not know). Read bounded (1 MiB).
pub fn export_note(path: &Path) -> Result<Option<ExportNote>, ModelError> {
    let note_error = |message: String| ModelError::Contract {
        path: path.to_path_buf(),
        message: format!("its exporter note ({EXPORT_NOTE}): {message}"),
    };
    // A file that is not a zip (or not there) has no note: loading it says what is wrong.
    let Some(mut zip) = std::fs::File::open(path)
        .ok()
        .and_then(|f| zip::ZipArchive::new(f).ok())
    else {
        return Ok(None);
    };
    let Some(name) = zip
        .file_names()
        .find(|n| n.ends_with(EXPORT_NOTE))
        .map(str::to_owned)
    else {
        return Ok(None);
    };
    let entry = zip.by_name(&name).map_err(|e| note_error(e.to_string()))?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(entry, MAX_NOTE_BYTES), &mut text)
        .map_err(|e| note_error(e.to_string()))?;
    ExportNote::parse(&text).map(Some).map_err(note_error)
}

/// The input shape `[C,H,W]` the exporter traced the network with (absent from files of older
/// exporters), for messages: a network may run at other shapes too.
pub(super) fn input_shape(path: &Path) -> Option<Vec<i64>> {
    let note = export_note(path).ok()??;
    let shape = note.network()?.input_shape.clone()?;
    (shape.len() == 3).then_some(shape)
}

/// Reads the note of `path` (a broken one is an error) and refuses a fixed condition embedding
/// with a zero-sized dimension (an older exporter accepted `[1,0,8]`): every forward would
/// condition on nothing. Returns the note.
pub(super) fn checked_note(path: &Path) -> Result<Option<ExportNote>, ModelError> {
    let note = export_note(path)?;
    if let Some(Condition::Embedding { shape, .. }) =
        note.as_ref().and_then(|n| n.network()?.condition.as_ref())
        && (shape.len() != 3 || shape.iter().any(|d| *d <= 0))
    {
        return Err(ModelError::Contract {
            path: path.to_path_buf(),
            message: format!(
                "its fixed condition embedding has shape {shape:?}: a zero-sized dimension \
                 (or not [1,L,D]); re-export it with an embedding of values"
            ),
        });
    }
    Ok(note)
}

/// The names of the non-persistent buffers the exporter listed (none without a note).
pub(super) fn non_persistent_buffers(note: Option<&ExportNote>) -> Vec<String> {
    note.map(|n| n.non_persistent_buffers().to_vec())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_versioned_note_refuses_fields_it_does_not_know() {
        let ok = r#"{"note_version": 1, "kind": "network", "parameterization": "eps",
                     "family": "vp", "path": null, "prediction": "eps", "schedule": "linear",
                     "condition": null, "input_shape": [1, 16, 16]}"#;
        let note = ExportNote::parse(ok).unwrap();
        let n = note.network().unwrap();
        assert_eq!(n.parameterization.as_deref(), Some("eps"));
        assert_eq!(n.family, Some(Family::Vp));
        assert_eq!(n.input_shape, Some(vec![1, 16, 16]));
        let renamed = ok.replace("\"schedule\"", "\"noise_schedule\"");
        let e = ExportNote::parse(&renamed).unwrap_err();
        assert!(e.contains("noise_schedule"), "{e}");
        // Without a version (an older exporter): read, the unknown field ignored.
        let old = renamed.replace("\"note_version\": 1, \"kind\": \"network\",", "");
        assert!(ExportNote::parse(&old).is_ok());
    }

    #[test]
    fn a_newer_version_or_a_wrong_type_is_an_error_that_says_why() {
        let e = ExportNote::parse(r#"{"note_version": 2, "kind": "network"}"#).unwrap_err();
        assert!(
            e.contains("newer diffmon-export") && e.contains("upgrade"),
            "{e}"
        );
        let e = ExportNote::parse(r#"{"note_version": 1, "family": "vq"}"#).unwrap_err();
        assert!(e.contains("vq"), "{e}");
        let e = ExportNote::parse(r#"{"note_version": 1, "kind": "tokenizer"}"#).unwrap_err();
        assert!(e.contains("tokenizer"), "{e}");
        // A condition's unknown field is refused at any version: conditions are typed whole.
        let e = ExportNote::parse(
            r#"{"condition": {"kind": "class", "keyword": "y", "label": 3, "guidance": 4}}"#,
        )
        .unwrap_err();
        assert!(e.contains("guidance"), "{e}");
    }

    #[test]
    fn conditions_and_the_autoencoder_are_read_as_the_exporter_writes_them() {
        let sd3 = r#"{"note_version": 1, "kind": "network", "condition": {"kind": "embedding",
            "keyword": "encoder_hidden_states", "file": "e.pt", "sha256": "ab", "shape": [1, 4, 8],
            "extra": [{"kind": "embedding", "keyword": "pooled_projections", "file": null,
                       "sha256": null, "shape": [1, 16]}]}}"#;
        let note = ExportNote::parse(sd3).unwrap();
        let Some(Condition::Embedding { shape, extra, .. }) = &note.network().unwrap().condition
        else {
            panic!("{note:?}")
        };
        assert_eq!(shape, &vec![1, 4, 8]);
        assert_eq!(extra[0].keyword, "pooled_projections");
        let vae = r#"{"note_version": 1, "kind": "vae", "scaling_factor": 0.18215,
            "shift_factor": 0.0, "encode": "posterior mean", "image_shape": [3, 32, 32],
            "latent_shape": [4, 4, 4], "non_persistent_buffers": [], "device_independent": true,
            "torch": "2.13.0"}"#;
        let note = ExportNote::parse(vae).unwrap();
        assert!(note.is_vae() && note.network().is_none());
    }
}
