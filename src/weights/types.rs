//! The readers' shared types: tensors ([`DType`], [`RawTensor`], [`StateDict`]), what was read
//! ([`CheckpointFormat`], [`Naming`], [`Checkpoint`]) and how to read it ([`ReadOptions`], the
//! architecture's [`Expected`] names and shapes, the default bounds).

use std::fmt;

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Bool,
    U8,
    I8,
    I16,
    I32,
    I64,
    F16,
    BF16,
    F32,
    F64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The dtype of a torch name ([`DType::name`]'s inverse).
    pub fn from_name(name: &str) -> Option<DType> {
        use DType::*;
        [Bool, U8, I8, I16, I32, I64, F16, BF16, F32, F64]
            .into_iter()
            .find(|d| d.name() == name)
    }

    /// The torch name (`float32`, `bfloat16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor's bytes: contiguous, row-major, little-endian, exactly `numel * dtype.size()` bytes
/// (a 0-d tensor has an empty `shape` and one element).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl RawTensor {
    /// Number of elements (product of `shape`; 1 for a 0-d tensor).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Named tensors in file order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateDict {
    pub tensors: Vec<(String, RawTensor)>,
}

impl StateDict {
    /// The tensor called `name`, if any.
    pub fn get(&self, name: &str) -> Option<&RawTensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Tensor names in file order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|(n, _)| n.as_str())
    }
}

/// Container format of a checkpoint file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CheckpointFormat {
    /// A `torch.save` zip archive (`<archive>/data.pkl` + `<archive>/data/<key>`).
    TorchZip,
    /// A safetensors file.
    SafeTensors,
    /// A TorchScript archive (`torch.jit.save`): also a zip, with `constants.pkl` / `code/`.
    TorchScript,
    /// A plain pickle stream (`pickle.dump`, e.g. an EDM `network-snapshot-*.pkl`).
    Pickle,
    /// A sharded safetensors checkpoint, named by its `*.safetensors.index.json`.
    ShardedSafeTensors,
    /// A PyTorch Distributed Checkpoint folder, named by its `.metadata` file.
    Distributed,
}

impl fmt::Display for CheckpointFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CheckpointFormat::TorchZip => "torch.save zip",
            CheckpointFormat::SafeTensors => "safetensors",
            CheckpointFormat::TorchScript => "TorchScript",
            CheckpointFormat::Pickle => "pickle",
            CheckpointFormat::ShardedSafeTensors => "sharded safetensors",
            CheckpointFormat::Distributed => "distributed checkpoint",
        })
    }
}

/// How to pick the weights out of a checkpoint (config keys `checkpoints.weights_key`,
/// `checkpoints.strip_prefix` and `checkpoints.max_entry_mib`). See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOptions {
    /// Entry of the top-level dict holding the state dict (`ema`, `model`, `state.ema`).
    pub weights_key: Option<String>,
    /// Prefix removed from every tensor name that has it (`module.`).
    pub strip_prefix: Option<String>,
    /// The most bytes any one zip entry of a checkpoint may inflate to.
    pub max_entry_bytes: u64,
    /// Where a checkpoint holds both EMA and raw weights (an `ema` entry beside the model's,
    /// Lightning's weight averaging, diffusers' `unet_ema/` folder), take the EMA ones
    /// (config key `checkpoints.prefer_ema`).
    pub prefer_ema: bool,
    /// The most bytes the selected tensors of one checkpoint may take in memory in all, checked
    /// from the checkpoint's metadata before any tensor byte is read (config key
    /// `checkpoints.max_total_mib`). `None`: no total bound here; `Model::load_weights` then
    /// uses [`default_max_total_bytes`] of the architecture.
    pub max_total_bytes: Option<u64>,
    /// The architecture's parameters and buffers: with it, the selected tensors' names and
    /// shapes are checked before any of their bytes is read (see "Bounded memory").
    pub expected: Option<std::sync::Arc<Expected>>,
}

/// The names and shapes a checkpoint's tensors must have: the architecture's parameters and
/// buffers (and the parameters in order, for an ordered `shadow_params` list).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    pub(super) shapes: std::collections::HashMap<String, Vec<u64>>,
    /// The parameters in order: name and shape.
    pub(super) params: Vec<(String, Vec<u64>)>,
    bytes: u64,
}

impl Expected {
    /// `tensors`: (name, shape, bytes per element) of every parameter and buffer, the first
    /// `params` of them the parameters in order.
    pub fn new(tensors: impl IntoIterator<Item = (String, Vec<u64>, u64)>, params: usize) -> Self {
        let mut e = Expected::default();
        for (i, (name, shape, elem)) in tensors.into_iter().enumerate() {
            let numel = shape.iter().fold(1u64, |a, &d| a.saturating_mul(d));
            e.bytes = e.bytes.saturating_add(numel.saturating_mul(elem));
            if i < params {
                e.params.push((name.clone(), shape.clone()));
            }
            e.shapes.insert(name, shape);
        }
        e
    }

    /// Bytes the architecture's parameters and buffers take.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The architecture's shape for a checkpoint name: the name itself, or what follows one of
    /// its dots (a prefix such as `module.` or `model.`, which `Model::load_weights` removes),
    /// preferring one of the same shape.
    pub(super) fn shape_for(&self, name: &str, shape: &[u64]) -> Option<(&str, &[u64])> {
        let mut found: Option<(&str, &[u64])> = None;
        let tails =
            std::iter::once(name).chain(name.match_indices('.').map(|(i, _)| &name[i + 1..]));
        for tail in tails {
            if let Some((k, want)) = self.shapes.get_key_value(tail) {
                if want.as_slice() == shape {
                    return Some((k, want));
                }
                found.get_or_insert((k, want));
            }
        }
        found
    }
}

/// Default of the total bound when `checkpoints.max_total_mib` is not set: 4 times what the
/// architecture's parameters and buffers take (a checkpoint in float64 for a float32 model,
/// with room for storages its tensors share), and at least 64 MiB.
pub fn default_max_total_bytes(expected: &Expected) -> u64 {
    expected.bytes().saturating_mul(4).max(64 << 20)
}

/// Default of `checkpoints.max_entry_mib`: 16 GiB, more than any one storage of real models.
pub const DEFAULT_MAX_ENTRY_MIB: u64 = 16 << 10;

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            weights_key: None,
            strip_prefix: None,
            max_entry_bytes: DEFAULT_MAX_ENTRY_MIB << 20,
            prefer_ema: true,
            max_total_bytes: None,
            expected: None,
        }
    }
}

/// How a checkpoint's tensor names are to be matched to the architecture's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// `state_dict()` names (a state dict, safetensors, a pickled module tree): exactly the
    /// architecture's parameters and buffers.
    ByName,
    /// Attribute paths of a TorchScript archive: every parameter and buffer of the architecture
    /// must be found; other tensor attributes are ignored.
    AttributePaths,
    /// A list in `model.parameters()` order (diffusers' `EMAModel` `shadow_params`); the names
    /// are `<key>.<index>` and only say where a tensor came from. Mapped onto the
    /// architecture's parameters by position.
    Ordered,
}

/// A checkpoint's tensors, its format and how its names are matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub format: CheckpointFormat,
    pub state: StateDict,
    pub naming: Naming,
}
