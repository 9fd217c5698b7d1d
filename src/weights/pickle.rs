//! A safe interpreter for the subset of the pickle protocol that `torch.save` writes.
//!
//! Nothing is ever called: the interpreter knows a short allow-list of globals and builds plain
//! data for them (dicts, tensor descriptions, storage references). Any other global stops the
//! run with [`PickleError::Forbidden`] the moment it is read, unless the [`Classes`] policy of
//! the run makes it an inert *placeholder class* (TorchScript archives pickle their modules as
//! `__torch__.<...>` classes): creating an instance of a placeholder (NEWOBJ, REDUCE) records the
//! class name and the arguments, and BUILD keeps the state (a module's attribute dict) as data;
//! no `__setstate__`, no constructor, nothing of the class is ever looked up or run. Objects live in an arena and are
//! referred to by index, so shared references (memo) behave like Python's, self-references
//! cannot build recursive Rust values, and dropping the result never recurses. Every quantity
//! that grows with the input (stack, marks, memo, objects, container items) is bounded.

use std::collections::HashMap;
use std::rc::Rc;

use super::types::DType;

/// Largest data.pkl accepted (real state dicts are a few MiB at most).
pub(crate) const MAX_PICKLE_BYTES: u64 = 128 << 20;
const MAX_STACK: usize = 1 << 20;
const MAX_MARKS: usize = 1000;
const MAX_MEMO: usize = 1 << 22;
const MAX_OBJS: usize = 1 << 22;
const MAX_ITEMS: usize = 1 << 23;
const MAX_GLOBAL_LINE: usize = 512;

/// A pickled value. Compound values live in the [`Pickle`] arena.
#[derive(Clone, Debug)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer outside i64 (kept only so that a checkpoint holding one can still be read).
    BigInt,
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Obj(ObjId),
}

/// Index of an object in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ObjId(usize);

#[derive(Debug)]
pub(crate) enum Obj {
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Dict),
    Global(Global),
    Storage(StorageRef),
    Tensor(TensorMeta),
    /// A placeholder class the [`Classes`] policy admits (`module.name`, sanitized).
    Class(Rc<str>),
    /// An instance of a placeholder class: data only.
    Instance(Instance),
    /// A `set` or `frozenset` (protocol 4 opcodes), in insertion order.
    Set(Vec<Value>),
}

/// An object of a placeholder class, as the pickle describes it. Nothing of the class runs:
/// `args` are what NEWOBJ/REDUCE passed, `state` what BUILD set (for a module, the dict of its
/// attributes: submodules, tensors, `training`, ...).
#[derive(Debug)]
pub(crate) struct Instance {
    pub(crate) class: Rc<str>,
    pub(crate) args: Vec<Value>,
    pub(crate) state: Option<Value>,
}

/// Which globals outside the fixed allow-list a pickle may name, as inert placeholders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Classes {
    /// None: `torch.save` state dicts (the strict allow-list only).
    None,
    /// A TorchScript archive's `data.pkl`: classes of the `__torch__` namespace (the archive's
    /// own compiled modules and classes) are placeholders, and the `torch.jit._pickle` list and
    /// type-tag helpers (identities) are allowed. Anything else is still refused.
    TorchScript,
    /// Every global outside the allow-list is an inert placeholder (`torch.save(model)`,
    /// Lightning's hyper-parameters, EDM's network snapshots): calling one records an
    /// [`Instance`], BUILD records its state, nothing is ever looked up or run. The copyreg
    /// helpers that pickle objects (`copyreg._reconstructor`, `copyreg.__newobj__`,
    /// `copyreg.__newobj_ex__`) instantiate the placeholder class they name, and
    /// `torch.storage._load_from_bytes(bytes)` (how a plain pickle stores a tensor's storage) is
    /// read as a legacy `torch.save` stream of one storage, by [`legacy_storage`], as data.
    Inert,
}

impl Classes {
    fn admits_class(self, module: &str) -> bool {
        match self {
            Classes::None => false,
            Classes::TorchScript => module == "__torch__" || module.starts_with("__torch__."),
            Classes::Inert => true,
        }
    }
}

/// A dict or `collections.OrderedDict`, in insertion order.
#[derive(Debug, Default)]
pub(crate) struct Dict {
    pub(crate) ordered: bool,
    items: Vec<(Value, Value)>,
    index: HashMap<DictKey, usize>,
}

#[derive(Debug, Hash, PartialEq, Eq)]
enum DictKey {
    None,
    Int(i64),
    Float(u64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
}

impl Dict {
    fn insert(&mut self, key: Value, value: Value) {
        let hashable = match &key {
            Value::None => Some(DictKey::None),
            Value::Bool(b) => Some(DictKey::Int(i64::from(*b))),
            Value::Int(i) => Some(DictKey::Int(*i)),
            // Python: 1.0 == 1, so integral floats share the int's slot.
            Value::Float(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => {
                Some(DictKey::Int(*f as i64))
            }
            Value::Float(f) => Some(DictKey::Float(f.to_bits())),
            Value::Str(s) => Some(DictKey::Str(s.clone())),
            Value::Bytes(b) => Some(DictKey::Bytes(b.clone())),
            // Tuples and other keys are kept without de-duplication; diffmon only looks up
            // string keys.
            Value::BigInt | Value::Obj(_) => None,
        };
        match hashable {
            Some(k) => match self.index.get(&k) {
                Some(&i) => {
                    if let Some(slot) = self.items.get_mut(i) {
                        slot.1 = value;
                    }
                }
                None => {
                    self.index.insert(k, self.items.len());
                    self.items.push((key, value));
                }
            },
            None => self.items.push((key, value)),
        }
    }

    pub(crate) fn items(&self) -> &[(Value, Value)] {
        &self.items
    }

    pub(crate) fn get_str(&self, key: &str) -> Option<&Value> {
        self.items.iter().find_map(|(k, v)| match k {
            Value::Str(s) if &**s == key => Some(v),
            _ => None,
        })
    }
}

/// The globals a checkpoint may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Global {
    OrderedDict,
    RebuildTensorV2,
    RebuildTensorV3,
    RebuildParameter,
    RebuildParameterWithState,
    /// `_codecs.encode(str, "latin1")`: how pickle protocol 2 writes `bytes` objects.
    CodecsEncode,
    /// `torch.FloatStorage` and friends (legacy typed storages).
    StorageType(ElemType),
    /// `torch.storage.UntypedStorage` (bytes; the dtype comes from `_rebuild_tensor_v3`).
    UntypedStorage,
    /// `torch.float32` and friends.
    Dtype(ElemType),
    /// `torch.jit._pickle.build_{int,double,bool,tensor}list` and `restore_type_tag`: return
    /// their first argument (TorchScript archives only).
    JitIdentity,
    /// `torch.storage._load_from_bytes(bytes)`: a storage in a plain pickle (inert mode only;
    /// the bytes are parsed as data, never loaded by torch).
    LoadFromBytes,
}

/// Element type of a storage or tensor: one diffmon reads, or another torch dtype (kept by name
/// so that a checkpoint holding e.g. complex optimizer state can still be read as long as the
/// selected weights are supported).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ElemType {
    Known(DType),
    Other(&'static str),
}

#[derive(Clone, Debug)]
pub(crate) struct StorageRef {
    /// Name of the `data/<key>` entry.
    pub(crate) key: Rc<str>,
    pub(crate) kind: StorageKind,
    /// Elements (typed storage) or bytes (untyped storage), as recorded by torch.
    pub(crate) numel: u64,
    /// The storage's bytes when the pickle itself holds them (a plain pickle's
    /// `_load_from_bytes`); `None` for a zip archive's `data/<key>` entry.
    pub(crate) inline: Option<Rc<[u8]>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StorageKind {
    Typed(ElemType),
    Untyped,
}

/// A tensor as described by `_rebuild_tensor_v2/v3`: a strided view of a storage.
#[derive(Clone, Debug)]
pub(crate) struct TensorMeta {
    pub(crate) storage: StorageRef,
    pub(crate) dtype: ElemType,
    /// In elements of `dtype`.
    pub(crate) offset: u64,
    pub(crate) size: Vec<u64>,
    /// In elements of `dtype`.
    pub(crate) stride: Vec<u64>,
}

/// Why a pickle was not read.
#[derive(Debug, PartialEq)]
pub(crate) enum PickleError {
    /// A global outside the allow-list (`module.name`, sanitized).
    Forbidden(String),
    /// An opcode outside the supported subset.
    Opcode { offset: usize, code: u8 },
    /// Malformed stream, type mismatch or resource limit.
    Malformed { offset: usize, detail: String },
}

/// The result of running a pickle: the object arena and the unpickled root value.
#[derive(Debug)]
pub(crate) struct Pickle {
    objs: Vec<Obj>,
    pub(crate) root: Value,
}

impl Pickle {
    pub(crate) fn obj(&self, v: &Value) -> Option<&Obj> {
        match v {
            Value::Obj(id) => self.objs.get(id.0),
            _ => None,
        }
    }

    pub(crate) fn dict(&self, v: &Value) -> Option<&Dict> {
        match self.obj(v) {
            Some(Obj::Dict(d)) => Some(d),
            _ => None,
        }
    }

    pub(crate) fn tensor(&self, v: &Value) -> Option<&TensorMeta> {
        match self.obj(v) {
            Some(Obj::Tensor(t)) => Some(t),
            _ => None,
        }
    }

    pub(crate) fn instance(&self, v: &Value) -> Option<&Instance> {
        match self.obj(v) {
            Some(Obj::Instance(i)) => Some(i),
            _ => None,
        }
    }

    /// "an int", "a dict", ... for messages.
    pub(crate) fn describe(&self, v: &Value) -> &'static str {
        describe(&self.objs, v)
    }
}

fn describe(objs: &[Obj], v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::Int(_) | Value::BigInt => "an int",
        Value::Float(_) => "a float",
        Value::Str(_) => "a str",
        Value::Bytes(_) => "a bytes object",
        Value::Obj(id) => match objs.get(id.0) {
            Some(Obj::Tuple(_)) => "a tuple",
            Some(Obj::List(_)) => "a list",
            Some(Obj::Dict(d)) if d.ordered => "an OrderedDict",
            Some(Obj::Dict(_)) => "a dict",
            Some(Obj::Global(_)) => "a type or function",
            Some(Obj::Storage(_)) => "a storage",
            Some(Obj::Tensor(_)) => "a tensor",
            Some(Obj::Class(_)) => "a class",
            Some(Obj::Instance(_)) => "an object",
            Some(Obj::Set(_)) => "a set",
            None => "an unknown object",
        },
    }
}

/// Most `copyreg` helpers followed for one instantiation (`__newobj__` naming `__newobj__` ...).
const MAX_HELPER_HOPS: usize = 64;

/// Runs `data` (a whole data.pkl) and returns the unpickled value.
pub(crate) fn parse(data: &[u8], classes: Classes) -> Result<Pickle, PickleError> {
    Ok(parse_prefix(data, classes)?.0)
}

/// Runs the pickle at the start of `data` and returns it with the number of bytes it spans
/// (up to and including its STOP); what follows is not looked at.
pub(crate) fn parse_prefix(data: &[u8], classes: Classes) -> Result<(Pickle, usize), PickleError> {
    let mut vm = Vm {
        data,
        classes,
        pos: 0,
        op_start: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        objs: Vec::new(),
        items: 0,
    };
    let root = vm.run()?;
    let end = vm.pos;
    Ok((
        Pickle {
            objs: vm.objs,
            root,
        },
        end,
    ))
}

/// The magic number pickle that starts a legacy (pre-zip) `torch.save` stream:
/// `0x1950a86a20f9469cfc6c` as a protocol 2 LONG1.
const LEGACY_MAGIC: &[u8] = &[
    0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19, b'.',
];
/// The only legacy protocol version torch writes.
const LEGACY_PROTOCOL: i64 = 1001;

/// A storage saved by `torch.save(storage, _use_new_zipfile_serialization=False)`, which is
/// what `torch.storage._load_from_bytes` receives in a plain pickle. The stream is five pickles
/// and raw bytes: the magic number, the protocol version (1001), a dict of system info
/// (`little_endian` must be true), the object (here a persistent id naming the storage, with a
/// sixth view-metadata field), the list of storage keys (one), then per storage an 8-byte
/// little-endian element count and the elements. Every pickle runs under the strict allow-list;
/// sizes are checked against the bytes given. Returns the storage's kind, element count and
/// bytes.
pub(crate) fn legacy_storage(b: &[u8]) -> Result<(StorageKind, u64, Vec<u8>), String> {
    let rest = b
        .strip_prefix(LEGACY_MAGIC)
        .ok_or("not a legacy torch.save stream (no magic number)")?;
    let sub = |data: &[u8], what: &str| -> Result<(Pickle, usize), String> {
        parse_prefix(data, Classes::None).map_err(|e| match e {
            PickleError::Forbidden(g) => format!("{what} names global `{g}`"),
            PickleError::Opcode { offset, code } => {
                format!("{what}: opcode {} at byte {offset}", opcode_name(code))
            }
            PickleError::Malformed { offset, detail } => {
                format!("{what} at byte {offset}: {detail}")
            }
        })
    };
    let (version, n) = sub(rest, "protocol version")?;
    if !matches!(version.root, Value::Int(LEGACY_PROTOCOL)) {
        return Err("unknown legacy protocol version".into());
    }
    let rest = &rest[n..];
    let (info, n) = sub(rest, "system info")?;
    let little = info
        .dict(&info.root)
        .and_then(|d| d.get_str("little_endian"))
        .is_some_and(|v| matches!(v, Value::Bool(true)));
    if !little {
        return Err("written on a big-endian machine (only little-endian is read)".into());
    }
    let rest = &rest[n..];
    let (obj, n) = sub(rest, "storage pickle")?;
    let storage = match obj.obj(&obj.root) {
        Some(Obj::Storage(s)) => s.clone(),
        _ => {
            return Err(format!(
                "holds {}, not a storage",
                describe(&obj.objs, &obj.root)
            ));
        }
    };
    let rest = &rest[n..];
    let (keys, n) = sub(rest, "storage key list")?;
    match keys.obj(&keys.root) {
        Some(Obj::List(k)) if k.len() == 1 => {}
        _ => return Err("the storage key list does not hold exactly one key".into()),
    }
    let rest = &rest[n..];
    let (count, data) = rest
        .split_first_chunk::<8>()
        .ok_or("the storage's element count is missing")?;
    let count = u64::from_le_bytes(*count);
    let elem = match storage.kind {
        StorageKind::Typed(t) => elem_size(t),
        StorageKind::Untyped => 1,
    };
    let nbytes = count
        .checked_mul(elem)
        .filter(|&n| n <= data.len() as u64)
        .ok_or_else(|| {
            // The count is raw bytes of the stream: judged, never quoted.
            format!(
                "the storage declares more elements of {elem} bytes than the {} bytes that follow",
                data.len()
            )
        })?;
    if count != storage.numel {
        return Err(format!(
            "the storage's element count differs from the {} its pickle declares",
            storage.numel
        ));
    }
    Ok((storage.kind, count, data[..nbytes as usize].to_vec()))
}

/// Bytes per element of a storage type (also of those diffmon does not convert).
fn elem_size(t: ElemType) -> u64 {
    match t {
        ElemType::Known(d) => d.size() as u64,
        ElemType::Other("complex128") => 16,
        ElemType::Other("complex64") => 8,
        ElemType::Other("qint32") => 4,
        ElemType::Other(_) => 1,
    }
}

// Opcodes (names as in Python's pickletools).
const MARK: u8 = b'(';
const STOP: u8 = b'.';
const POP: u8 = b'0';
const POP_MARK: u8 = b'1';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const NONE: u8 = b'N';
const BINPERSID: u8 = b'Q';
const REDUCE: u8 = b'R';
const BINUNICODE: u8 = b'X';
const APPEND: u8 = b'a';
const BUILD: u8 = b'b';
const GLOBAL: u8 = b'c';
const EMPTY_DICT: u8 = b'}';
const APPENDS: u8 = b'e';
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const EMPTY_LIST: u8 = b']';
const BINPUT: u8 = b'q';
const LONG_BINPUT: u8 = b'r';
const SETITEM: u8 = b's';
const TUPLE: u8 = b't';
const EMPTY_TUPLE: u8 = b')';
const SETITEMS: u8 = b'u';
const BINFLOAT: u8 = b'G';
const BINBYTES: u8 = b'B';
const SHORT_BINBYTES: u8 = b'C';
const PROTO: u8 = 0x80;
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const LONG1: u8 = 0x8a;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE8: u8 = 0x8d;
const STACK_GLOBAL: u8 = 0x93;
const MEMOIZE: u8 = 0x94;
const FRAME: u8 = 0x95;
const NEWOBJ: u8 = 0x81;
const LONG4: u8 = 0x8b;
const BINBYTES8: u8 = 0x8e;
const EMPTY_SET: u8 = 0x8f;
const ADDITEMS: u8 = 0x90;
const FROZENSET: u8 = 0x91;
const NEWOBJ_EX: u8 = 0x92;

/// The pickletools name of any opcode byte, for error messages.
pub(crate) fn opcode_name(code: u8) -> &'static str {
    match code {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => "<unknown>",
    }
}

/// Maps `module`, `name` to an allowed global, or `None` (refused).
fn resolve_global(module: &str, name: &str, classes: Classes) -> Option<Global> {
    Some(match (module, name) {
        (
            "torch.jit._pickle",
            "build_intlist" | "build_doublelist" | "build_boollist" | "build_tensorlist"
            | "restore_type_tag",
        ) if classes == Classes::TorchScript => Global::JitIdentity,
        ("torch.storage", "_load_from_bytes") if classes == Classes::Inert => Global::LoadFromBytes,
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
        ("torch._utils", "_rebuild_tensor_v3") => Global::RebuildTensorV3,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("torch._utils", "_rebuild_parameter_with_state") => Global::RebuildParameterWithState,
        ("_codecs", "encode") => Global::CodecsEncode,
        ("torch.storage", "UntypedStorage") | ("torch", "UntypedStorage") => Global::UntypedStorage,
        ("torch", n) => {
            if let Some(t) = storage_elem(n) {
                Global::StorageType(t)
            } else {
                Global::Dtype(dtype_elem(n)?)
            }
        }
        _ => return None,
    })
}

fn storage_elem(name: &str) -> Option<ElemType> {
    use ElemType::{Known, Other};
    Some(match name {
        "FloatStorage" => Known(DType::F32),
        "DoubleStorage" => Known(DType::F64),
        "HalfStorage" => Known(DType::F16),
        "BFloat16Storage" => Known(DType::BF16),
        "LongStorage" => Known(DType::I64),
        "IntStorage" => Known(DType::I32),
        "ShortStorage" => Known(DType::I16),
        "CharStorage" => Known(DType::I8),
        "ByteStorage" => Known(DType::U8),
        "BoolStorage" => Known(DType::Bool),
        "ComplexFloatStorage" => Other("complex64"),
        "ComplexDoubleStorage" => Other("complex128"),
        "QInt8Storage" => Other("qint8"),
        "QUInt8Storage" => Other("quint8"),
        "QInt32Storage" => Other("qint32"),
        "QUInt4x2Storage" => Other("quint4x2"),
        "QUInt2x4Storage" => Other("quint2x4"),
        _ => return None,
    })
}

/// torch dtypes that are data, not code, but that diffmon does not convert.
const OTHER_DTYPES: &[&str] = &[
    "uint16",
    "uint32",
    "uint64",
    "complex32",
    "complex64",
    "complex128",
    "chalf",
    "cfloat",
    "cdouble",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
];

fn dtype_elem(name: &str) -> Option<ElemType> {
    Some(ElemType::Known(match name {
        "float32" | "float" => DType::F32,
        "float64" | "double" => DType::F64,
        "float16" | "half" => DType::F16,
        "bfloat16" => DType::BF16,
        "int64" | "long" => DType::I64,
        "int32" | "int" => DType::I32,
        "int16" | "short" => DType::I16,
        "int8" => DType::I8,
        "uint8" => DType::U8,
        "bool" => DType::Bool,
        other => {
            return OTHER_DTYPES
                .iter()
                .find(|&&d| d == other)
                .map(|&d| ElemType::Other(d));
        }
    }))
}

/// `module.name` made safe to print: printable, at most 200 characters.
fn sanitize_global(module: &str, name: &str) -> String {
    let full = format!("{module}.{name}");
    let mut out: String = full
        .chars()
        .take(200)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if full.chars().count() > 200 {
        out.push('…');
    }
    out
}

struct Vm<'a> {
    data: &'a [u8],
    classes: Classes,
    pos: usize,
    op_start: usize,
    stack: Vec<Value>,
    /// Stack lengths at each MARK.
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
    objs: Vec<Obj>,
    /// Items stored in containers so far.
    items: usize,
}

type R<T> = Result<T, PickleError>;

impl<'a> Vm<'a> {
    fn err<T>(&self, detail: impl Into<String>) -> R<T> {
        Err(PickleError::Malformed {
            offset: self.op_start,
            detail: detail.into(),
        })
    }

    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let data: &'a [u8] = self.data;
        match self
            .pos
            .checked_add(n)
            .and_then(|end| data.get(self.pos..end))
        {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => self.err(format!(
                "needs {n} more bytes but the stream ends (truncated file?)"
            )),
        }
    }

    fn array<const N: usize>(&mut self) -> R<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn byte(&mut self) -> R<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn len_u32(&mut self) -> R<usize> {
        let n = u32::from_le_bytes(self.array()?);
        usize::try_from(n).or_else(|_| self.err("length too large"))
    }

    fn len_u64(&mut self) -> R<usize> {
        let n = u64::from_le_bytes(self.array()?);
        usize::try_from(n).or_else(|_| self.err("length too large"))
    }

    fn line(&mut self) -> R<&'a str> {
        let data: &'a [u8] = self.data;
        let rest = data.get(self.pos..).unwrap_or_default();
        let limit = rest.len().min(MAX_GLOBAL_LINE);
        let Some(nl) = rest[..limit].iter().position(|&b| b == b'\n') else {
            return self.err("GLOBAL name is not newline-terminated within 512 bytes");
        };
        self.pos += nl + 1;
        std::str::from_utf8(&rest[..nl]).or_else(|_| self.err("GLOBAL name is not UTF-8"))
    }

    fn frame_base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn push(&mut self, v: Value) -> R<()> {
        if self.stack.len() >= MAX_STACK {
            return self.err(format!("stack deeper than {MAX_STACK} values"));
        }
        self.stack.push(v);
        Ok(())
    }

    fn pop(&mut self) -> R<Value> {
        if self.stack.len() <= self.frame_base() {
            return self.err("stack underflow");
        }
        match self.stack.pop() {
            Some(v) => Ok(v),
            None => self.err("stack underflow"),
        }
    }

    fn top(&self) -> R<&Value> {
        if self.stack.len() <= self.frame_base() {
            return self.err("stack underflow");
        }
        match self.stack.last() {
            Some(v) => Ok(v),
            None => self.err("stack underflow"),
        }
    }

    fn pop_mark(&mut self) -> R<Vec<Value>> {
        match self.marks.pop() {
            Some(m) if m <= self.stack.len() => Ok(self.stack.split_off(m)),
            _ => self.err("no MARK on the stack"),
        }
    }

    fn count_items(&mut self, n: usize) -> R<()> {
        self.items = self.items.saturating_add(n);
        if self.items > MAX_ITEMS {
            return self.err(format!("more than {MAX_ITEMS} container items"));
        }
        Ok(())
    }

    fn new_obj(&mut self, o: Obj) -> R<Value> {
        if self.objs.len() >= MAX_OBJS {
            return self.err(format!("more than {MAX_OBJS} objects"));
        }
        self.objs.push(o);
        Ok(Value::Obj(ObjId(self.objs.len() - 1)))
    }

    fn obj(&self, v: &Value) -> Option<&Obj> {
        match v {
            Value::Obj(id) => self.objs.get(id.0),
            _ => None,
        }
    }

    fn kind(&self, v: &Value) -> &'static str {
        describe(&self.objs, v)
    }

    fn memo_put(&mut self, idx: u32) -> R<()> {
        let v = self.top()?.clone();
        if self.memo.len() >= MAX_MEMO && !self.memo.contains_key(&idx) {
            return self.err(format!("more than {MAX_MEMO} memo entries"));
        }
        self.memo.insert(idx, v);
        Ok(())
    }

    fn memo_get(&mut self, idx: u32) -> R<()> {
        match self.memo.get(&idx) {
            Some(v) => {
                let v = v.clone();
                self.push(v)
            }
            None => self.err(format!("memo entry {idx} is not defined")),
        }
    }

    fn string(&mut self, n: usize) -> R<()> {
        let s = self.take(n)?;
        // Python writes lone surrogates with `surrogatepass`; such names are replaced, not fatal.
        let s: Rc<str> = Rc::from(String::from_utf8_lossy(s));
        self.push(Value::Str(s))
    }

    fn bytes(&mut self, n: usize) -> R<()> {
        let b = self.take(n)?;
        self.push(Value::Bytes(Rc::from(b)))
    }

    fn global(&mut self, module: &str, name: &str) -> R<()> {
        match resolve_global(module, name, self.classes) {
            Some(g) => {
                let v = self.new_obj(Obj::Global(g))?;
                self.push(v)
            }
            None if self.classes.admits_class(module) => {
                let v = self.new_obj(Obj::Class(Rc::from(sanitize_global(module, name))))?;
                self.push(v)
            }
            None => Err(PickleError::Forbidden(sanitize_global(module, name))),
        }
    }

    /// A placeholder instance of the class `cls` (NEWOBJ, or REDUCE on a class): data only.
    /// The copyreg helpers that pickle protocols use to create objects instantiate the class
    /// they are given instead.
    fn instantiate(&mut self, cls: &Value, args: Vec<Value>) -> R<Value> {
        // `copyreg` helpers name the class to instantiate: followed in a loop (each step drops
        // an argument), never by recursion.
        let (mut cls, mut args) = (cls.clone(), args);
        let mut hops = 0usize;
        while let Some(Obj::Class(c)) = self.obj(&cls) {
            hops += 1;
            if hops > MAX_HELPER_HOPS {
                return self.err(format!(
                    "more than {MAX_HELPER_HOPS} copyreg helpers naming each other"
                ));
            }
            let helper = c.strip_prefix("copyreg.").or(c.strip_prefix("copy_reg."));
            let target = args.first().cloned();
            let target_is_class = matches!(
                target.as_ref().and_then(|t| self.obj(t)),
                Some(Obj::Class(_))
            );
            if let (Some(helper), Some(target), true) = (helper, target, target_is_class) {
                let rest = match helper {
                    // _reconstructor(cls, base, state): the state is a base-class value.
                    "_reconstructor" => Some(Vec::new()),
                    "__newobj__" => Some(args[1..].to_vec()),
                    "__newobj_ex__" => Some(match args.get(1) {
                        Some(a) => self.tuple_items(a, "__newobj_ex__ arguments")?,
                        None => Vec::new(),
                    }),
                    _ => None,
                };
                if let Some(rest) = rest {
                    (cls, args) = (target, rest);
                    continue;
                }
            }
            break;
        }
        let cls = &cls;
        let class = match self.obj(cls) {
            Some(Obj::Class(c)) => c.clone(),
            _ => {
                let kind = self.kind(cls);
                return self.err(format!(
                    "NEWOBJ on {kind}; only the archive's own classes can be instantiated"
                ));
            }
        };
        self.count_items(args.len())?;
        self.new_obj(Obj::Instance(Instance {
            class,
            args,
            state: None,
        }))
    }

    fn tuple(&mut self, items: Vec<Value>) -> R<()> {
        self.count_items(items.len())?;
        let v = self.new_obj(Obj::Tuple(items))?;
        self.push(v)
    }

    fn pop_n(&mut self, n: usize) -> R<Vec<Value>> {
        let mut items = vec![Value::None; n];
        for slot in items.iter_mut().rev() {
            *slot = self.pop()?;
        }
        Ok(items)
    }

    /// In inert mode, items appended or set on a placeholder object (a list or dict subclass
    /// such as Lightning's `AttributeDict`) are counted and dropped: true when `what` targets one.
    fn drops_items(&self) -> R<bool> {
        Ok(self.classes == Classes::Inert
            && matches!(self.obj(self.top()?), Some(Obj::Instance(_))))
    }

    fn list_mut(&mut self, what: &str) -> R<&mut Vec<Value>> {
        let top = self.top()?.clone();
        let (offset, kind) = (self.op_start, self.kind(&top));
        if let Value::Obj(id) = top
            && let Some(Obj::List(l)) = self.objs.get_mut(id.0)
        {
            return Ok(l);
        }
        Err(PickleError::Malformed {
            offset,
            detail: format!("{what} on {kind}, expected a list"),
        })
    }

    fn dict_mut(&mut self, what: &str) -> R<&mut Dict> {
        let top = self.top()?.clone();
        let (offset, kind) = (self.op_start, self.kind(&top));
        if let Value::Obj(id) = top
            && let Some(Obj::Dict(d)) = self.objs.get_mut(id.0)
        {
            return Ok(d);
        }
        Err(PickleError::Malformed {
            offset,
            detail: format!("{what} on {kind}, expected a dict"),
        })
    }

    fn run(&mut self) -> R<Value> {
        loop {
            self.op_start = self.pos;
            let Some(&code) = self.data.get(self.pos) else {
                return self.err("stream ends without STOP (truncated file?)");
            };
            self.pos += 1;
            match code {
                PROTO => {
                    let v = self.byte()?;
                    if v > 5 {
                        return self.err(format!("unknown pickle protocol {v}"));
                    }
                }
                FRAME => {
                    self.take(8)?;
                }
                STOP => return self.pop(),
                MARK => {
                    if self.marks.len() >= MAX_MARKS {
                        return self.err(format!("MARKs nested deeper than {MAX_MARKS}"));
                    }
                    self.marks.push(self.stack.len());
                }
                POP => {
                    self.pop()?;
                }
                POP_MARK => {
                    self.pop_mark()?;
                }
                EMPTY_DICT => {
                    let v = self.new_obj(Obj::Dict(Dict::default()))?;
                    self.push(v)?;
                }
                EMPTY_LIST => {
                    let v = self.new_obj(Obj::List(Vec::new()))?;
                    self.push(v)?;
                }
                EMPTY_TUPLE => self.tuple(Vec::new())?,
                TUPLE => {
                    let items = self.pop_mark()?;
                    self.tuple(items)?;
                }
                TUPLE1 | TUPLE2 | TUPLE3 => {
                    let items = self.pop_n(usize::from(code - TUPLE1 + 1))?;
                    self.tuple(items)?;
                }
                APPEND => {
                    let v = self.pop()?;
                    self.count_items(1)?;
                    if !self.drops_items()? {
                        self.list_mut("APPEND")?.push(v);
                    }
                }
                APPENDS => {
                    let items = self.pop_mark()?;
                    self.count_items(items.len())?;
                    if !self.drops_items()? {
                        self.list_mut("APPENDS")?.extend(items);
                    }
                }
                SETITEM => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.count_items(1)?;
                    if !self.drops_items()? {
                        self.dict_mut("SETITEM")?.insert(k, v);
                    }
                }
                SETITEMS => {
                    let items = self.pop_mark()?;
                    if items.len() % 2 != 0 {
                        return self.err("SETITEMS with an odd number of values");
                    }
                    self.count_items(items.len() / 2)?;
                    if self.drops_items()? {
                        continue;
                    }
                    let d = self.dict_mut("SETITEMS")?;
                    let mut it = items.into_iter();
                    while let (Some(k), Some(v)) = (it.next(), it.next()) {
                        d.insert(k, v);
                    }
                }
                BINPUT => {
                    let i = self.byte()?;
                    self.memo_put(u32::from(i))?;
                }
                LONG_BINPUT => {
                    let i = u32::from_le_bytes(self.array()?);
                    self.memo_put(i)?;
                }
                MEMOIZE => {
                    let i = u32::try_from(self.memo.len()).or_else(|_| self.err("memo full"))?;
                    self.memo_put(i)?;
                }
                BINGET => {
                    let i = self.byte()?;
                    self.memo_get(u32::from(i))?;
                }
                LONG_BINGET => {
                    let i = u32::from_le_bytes(self.array()?);
                    self.memo_get(i)?;
                }
                GLOBAL => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.global(module, name)?;
                }
                STACK_GLOBAL => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Value::Str(m), Value::Str(n)) => self.global(&m, &n)?,
                        _ => return self.err("STACK_GLOBAL needs two strings"),
                    }
                }
                REDUCE => {
                    let args = self.pop()?;
                    let f = self.pop()?;
                    let v = self.reduce(&f, &args)?;
                    self.push(v)?;
                }
                NEWOBJ if self.classes != Classes::None => {
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let args = self.tuple_items(&args, "NEWOBJ arguments")?;
                    let v = self.instantiate(&cls, args)?;
                    self.push(v)?;
                }
                NEWOBJ_EX if self.classes == Classes::Inert => {
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let args = self.tuple_items(&args, "NEWOBJ_EX arguments")?;
                    let v = self.instantiate(&cls, args)?;
                    self.push(v)?;
                }
                EMPTY_SET if self.classes == Classes::Inert => {
                    let v = self.new_obj(Obj::Set(Vec::new()))?;
                    self.push(v)?;
                }
                ADDITEMS if self.classes == Classes::Inert => {
                    let items = self.pop_mark()?;
                    self.count_items(items.len())?;
                    let top = self.top()?.clone();
                    let kind = self.kind(&top);
                    match top {
                        Value::Obj(id) if matches!(self.objs.get(id.0), Some(Obj::Set(_))) => {
                            if let Some(Obj::Set(s)) = self.objs.get_mut(id.0) {
                                s.extend(items);
                            }
                        }
                        _ => return self.err(format!("ADDITEMS on {kind}, expected a set")),
                    }
                }
                FROZENSET if self.classes == Classes::Inert => {
                    let items = self.pop_mark()?;
                    self.count_items(items.len())?;
                    let v = self.new_obj(Obj::Set(items))?;
                    self.push(v)?;
                }
                BINBYTES8 if self.classes == Classes::Inert => {
                    let n = self.len_u64()?;
                    self.bytes(n)?;
                }
                LONG4 if self.classes == Classes::Inert => {
                    let n = self.len_u32()?;
                    self.take(n)?;
                    self.push(Value::BigInt)?;
                }
                BUILD => {
                    let state = self.pop()?;
                    let top = self.top()?.clone();
                    match self.obj(&top) {
                        // OrderedDict state (`_metadata` of a module state dict): ignored.
                        Some(Obj::Dict(d)) if d.ordered => {}
                        // A placeholder's state is kept as data; nothing is called.
                        Some(Obj::Instance(_)) => {
                            if let Value::Obj(id) = top
                                && let Some(Obj::Instance(i)) = self.objs.get_mut(id.0)
                            {
                                i.state = Some(state);
                            }
                        }
                        // Inert mode: state set on anything else is dropped (nothing is called).
                        _ if self.classes == Classes::Inert => {}
                        _ => {
                            let kind = self.kind(&top);
                            return self.err(format!("BUILD on {kind} is not supported"));
                        }
                    }
                }
                BINPERSID => {
                    let pid = self.pop()?;
                    let storage = self.persistent(&pid)?;
                    let v = self.new_obj(Obj::Storage(storage))?;
                    self.push(v)?;
                }
                NONE => self.push(Value::None)?,
                NEWTRUE => self.push(Value::Bool(true))?,
                NEWFALSE => self.push(Value::Bool(false))?,
                BININT => {
                    let i = i32::from_le_bytes(self.array()?);
                    self.push(Value::Int(i64::from(i)))?;
                }
                BININT1 => {
                    let i = self.byte()?;
                    self.push(Value::Int(i64::from(i)))?;
                }
                BININT2 => {
                    let i = u16::from_le_bytes(self.array()?);
                    self.push(Value::Int(i64::from(i)))?;
                }
                LONG1 => {
                    let n = usize::from(self.byte()?);
                    let b = self.take(n)?;
                    let v = if n > 8 {
                        Value::BigInt
                    } else {
                        let negative = b.last().is_some_and(|&x| x & 0x80 != 0);
                        let mut a = if negative { [0xffu8; 8] } else { [0u8; 8] };
                        a[..n].copy_from_slice(b);
                        Value::Int(i64::from_le_bytes(a))
                    };
                    self.push(v)?;
                }
                BINFLOAT => {
                    let f = f64::from_be_bytes(self.array()?);
                    self.push(Value::Float(f))?;
                }
                BINUNICODE => {
                    let n = self.len_u32()?;
                    self.string(n)?;
                }
                SHORT_BINUNICODE => {
                    let n = usize::from(self.byte()?);
                    self.string(n)?;
                }
                BINUNICODE8 => {
                    let n = self.len_u64()?;
                    self.string(n)?;
                }
                BINBYTES => {
                    let n = self.len_u32()?;
                    self.bytes(n)?;
                }
                SHORT_BINBYTES => {
                    let n = usize::from(self.byte()?);
                    self.bytes(n)?;
                }
                other => {
                    return Err(PickleError::Opcode {
                        offset: self.op_start,
                        code: other,
                    });
                }
            }
        }
    }

    fn global_of(&self, v: &Value) -> Option<Global> {
        match self.obj(v) {
            Some(Obj::Global(g)) => Some(*g),
            _ => None,
        }
    }

    fn tuple_items(&self, v: &Value, what: &str) -> R<Vec<Value>> {
        match self.obj(v) {
            Some(Obj::Tuple(items)) => Ok(items.clone()),
            _ => self.err(format!("{what} must be a tuple, got {}", self.kind(v))),
        }
    }

    fn reduce(&mut self, f: &Value, args: &Value) -> R<Value> {
        if matches!(self.obj(f), Some(Obj::Class(_))) {
            let args = self.tuple_items(args, "REDUCE arguments")?;
            return self.instantiate(f, args);
        }
        let Some(g) = self.global_of(f) else {
            return self.err(format!(
                "REDUCE on {}, not an allowed callable",
                self.kind(f)
            ));
        };
        let args = self.tuple_items(args, "REDUCE arguments")?;
        match g {
            Global::OrderedDict => {
                if !args.is_empty() {
                    return self.err("OrderedDict called with arguments");
                }
                self.new_obj(Obj::Dict(Dict {
                    ordered: true,
                    ..Dict::default()
                }))
            }
            Global::RebuildTensorV2 => self.rebuild_tensor(&args, false),
            Global::RebuildTensorV3 => self.rebuild_tensor(&args, true),
            Global::RebuildParameter | Global::RebuildParameterWithState => match args.first() {
                Some(t) if matches!(self.obj(t), Some(Obj::Tensor(_))) => Ok(t.clone()),
                _ => self.err("_rebuild_parameter needs a tensor as first argument"),
            },
            Global::CodecsEncode => match args.as_slice() {
                [Value::Str(s), Value::Str(enc)] if &**enc == "latin1" || &**enc == "latin-1" => {
                    let mut out = Vec::with_capacity(s.len());
                    for c in s.chars() {
                        match u8::try_from(u32::from(c)) {
                            Ok(b) => out.push(b),
                            Err(_) => return self.err("_codecs.encode: character outside latin1"),
                        }
                    }
                    Ok(Value::Bytes(Rc::from(out)))
                }
                _ => self.err("_codecs.encode supports only (str, 'latin1')"),
            },
            Global::JitIdentity => match args.first() {
                Some(v) => Ok(v.clone()),
                None => self.err("torch.jit._pickle helper called without arguments"),
            },
            Global::LoadFromBytes => {
                let [Value::Bytes(b)] = args.as_slice() else {
                    return self.err("_load_from_bytes needs one bytes argument");
                };
                let (kind, numel, data) = match legacy_storage(b) {
                    Ok(s) => s,
                    Err(e) => return self.err(format!("storage of _load_from_bytes: {e}")),
                };
                // A key of its own: the same legacy key may appear in several storages.
                let key: Rc<str> = Rc::from(format!("inline-{}", self.objs.len()));
                self.new_obj(Obj::Storage(StorageRef {
                    key,
                    kind,
                    numel,
                    inline: Some(Rc::from(data)),
                }))
            }
            Global::StorageType(_) | Global::UntypedStorage | Global::Dtype(_) => {
                self.err("a storage type or dtype cannot be called")
            }
        }
    }

    fn as_u64(&self, v: &Value, what: &str) -> R<u64> {
        match v {
            Value::Int(i) => u64::try_from(*i).or_else(|_| self.err(format!("negative {what}"))),
            Value::Bool(b) => Ok(u64::from(*b)),
            Value::BigInt => self.err(format!("{what} is too large")),
            other => self.err(format!("{what} must be an int, got {}", self.kind(other))),
        }
    }

    fn int_tuple(&self, v: &Value, what: &str) -> R<Vec<u64>> {
        let items = self.tuple_items(v, what)?;
        items.iter().map(|x| self.as_u64(x, what)).collect()
    }

    /// `_rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
    /// backward_hooks[, metadata])` and `_rebuild_tensor_v3(..., backward_hooks, dtype[,
    /// metadata])`.
    fn rebuild_tensor(&mut self, args: &[Value], v3: bool) -> R<Value> {
        let (min, max) = if v3 { (7, 8) } else { (6, 7) };
        if args.len() < min || args.len() > max {
            return self.err(format!(
                "tensor rebuild with {} arguments, expected {min} or {max}",
                args.len()
            ));
        }
        let storage = match self.obj(&args[0]) {
            Some(Obj::Storage(s)) => s.clone(),
            _ => {
                let kind = self.kind(&args[0]);
                return self.err(format!("tensor storage must be a storage, got {kind}"));
            }
        };
        let offset = self.as_u64(&args[1], "storage offset")?;
        let size = self.int_tuple(&args[2], "tensor size")?;
        let stride = self.int_tuple(&args[3], "tensor stride")?;
        if size.len() != stride.len() {
            return self.err(format!(
                "tensor size has {} dimensions but stride has {}",
                size.len(),
                stride.len()
            ));
        }
        let dtype = if v3 {
            match self.global_of(&args[6]) {
                Some(Global::Dtype(t)) => t,
                _ => return self.err("_rebuild_tensor_v3 needs a torch dtype"),
            }
        } else {
            match storage.kind {
                StorageKind::Typed(t) => t,
                StorageKind::Untyped => {
                    return self.err("_rebuild_tensor_v2 with an untyped storage");
                }
            }
        };
        self.count_items(size.len().saturating_mul(2))?;
        self.new_obj(Obj::Tensor(TensorMeta {
            storage,
            dtype,
            offset,
            size,
            stride,
        }))
    }

    /// The persistent id torch.save writes for a storage:
    /// `('storage', storage_type, key, location, numel)`.
    fn persistent(&self, pid: &Value) -> R<StorageRef> {
        let items = self.tuple_items(pid, "persistent id")?;
        // The legacy format adds a sixth field (view metadata, always None since torch 1.x).
        let (tag, ty, key, numel) = match items.as_slice() {
            [tag, ty, key, _location, numel] | [tag, ty, key, _location, numel, Value::None] => {
                (tag, ty, key, numel)
            }
            _ => {
                return self.err(format!(
                    "persistent id has {} fields, expected 5 ('storage', type, key, location, \
                     numel)",
                    items.len()
                ));
            }
        };
        if !matches!(tag, Value::Str(s) if &**s == "storage") {
            return self.err("persistent id does not start with 'storage'");
        }
        let kind = match self.global_of(ty) {
            Some(Global::StorageType(t)) => StorageKind::Typed(t),
            Some(Global::UntypedStorage) => StorageKind::Untyped,
            _ => return self.err("persistent id names no storage type"),
        };
        let key: Rc<str> = match key {
            Value::Str(s) => s.clone(),
            Value::Int(i) => Rc::from(i.to_string()),
            other => {
                let kind = self.kind(other);
                return self.err(format!("storage key must be a str, got {kind}"));
            }
        };
        let numel = self.as_u64(numel, "storage size")?;
        Ok(StorageRef {
            key,
            kind,
            numel,
            inline: None,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! Unit tests of the interpreter on hand-assembled streams, and a builder that the other
    //! test modules use to write pickles.
    use super::*;

    /// Writes pickle opcodes.
    #[derive(Default)]
    pub(crate) struct PickleWriter(pub(crate) Vec<u8>);

    impl PickleWriter {
        pub(crate) fn new() -> Self {
            let mut w = Self::default();
            w.0.extend_from_slice(&[PROTO, 2]);
            w
        }
        pub(crate) fn op(&mut self, code: u8) -> &mut Self {
            self.0.push(code);
            self
        }
        pub(crate) fn global(&mut self, module: &str, name: &str) -> &mut Self {
            self.0.push(GLOBAL);
            self.0.extend_from_slice(module.as_bytes());
            self.0.push(b'\n');
            self.0.extend_from_slice(name.as_bytes());
            self.0.push(b'\n');
            self
        }
        pub(crate) fn str(&mut self, s: &str) -> &mut Self {
            self.0.push(BINUNICODE);
            self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
            self.0.extend_from_slice(s.as_bytes());
            self
        }
        pub(crate) fn int(&mut self, i: i32) -> &mut Self {
            self.0.push(BININT);
            self.0.extend_from_slice(&i.to_le_bytes());
            self
        }
        pub(crate) fn long(&mut self, i: i64) -> &mut Self {
            self.0.extend_from_slice(&[LONG1, 8]);
            self.0.extend_from_slice(&i.to_le_bytes());
            self
        }
        pub(crate) fn int_tuple(&mut self, v: &[i64]) -> &mut Self {
            self.op(MARK);
            for &i in v {
                self.long(i);
            }
            self.op(TUPLE)
        }
        /// Pushes a `_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())`.
        pub(crate) fn tensor_v2(
            &mut self,
            storage_type: &str,
            key: &str,
            numel: i64,
            offset: i64,
            size: &[i64],
            stride: &[i64],
        ) -> &mut Self {
            self.global("torch._utils", "_rebuild_tensor_v2").op(MARK);
            self.storage(("torch", storage_type), key, numel);
            self.long(offset)
                .int_tuple(size)
                .int_tuple(stride)
                .op(NEWFALSE);
            self.global("collections", "OrderedDict")
                .op(EMPTY_TUPLE)
                .op(REDUCE);
            self.op(TUPLE).op(REDUCE)
        }
        /// Pushes a storage from BINPERSID.
        pub(crate) fn storage(&mut self, ty: (&str, &str), key: &str, numel: i64) -> &mut Self {
            self.op(MARK)
                .str("storage")
                .global(ty.0, ty.1)
                .str(key)
                .str("cpu");
            self.long(numel).op(TUPLE).op(BINPERSID)
        }
        pub(crate) fn ordered_dict(&mut self) -> &mut Self {
            self.global("collections", "OrderedDict")
                .op(EMPTY_TUPLE)
                .op(REDUCE)
        }
        pub(crate) fn finish(&mut self) -> Vec<u8> {
            self.op(STOP);
            std::mem::take(&mut self.0)
        }
    }

    fn run(data: &[u8]) -> Result<Pickle, PickleError> {
        parse(data, Classes::None)
    }

    #[test]
    fn plain_containers_and_scalars() {
        let mut w = PickleWriter::new();
        w.op(EMPTY_DICT).op(MARK);
        w.str("i").op(BININT1).op(7);
        w.str("neg").int(-5);
        w.str("big")
            .op(LONG1)
            .op(9)
            .op(1)
            .0
            .extend_from_slice(&[0; 8]);
        w.str("f")
            .op(BINFLOAT)
            .0
            .extend_from_slice(&0.5f64.to_be_bytes());
        w.str("l")
            .op(EMPTY_LIST)
            .op(MARK)
            .op(NONE)
            .op(NEWTRUE)
            .op(APPENDS);
        w.str("t")
            .op(BININT2)
            .0
            .extend_from_slice(&300u16.to_le_bytes());
        w.op(TUPLE1);
        w.op(SETITEMS);
        let p = run(&w.finish()).unwrap();
        let d = p.dict(&p.root).unwrap();
        assert_eq!(d.items().len(), 6);
        assert!(matches!(d.get_str("i"), Some(Value::Int(7))));
        assert!(matches!(d.get_str("neg"), Some(Value::Int(-5))));
        assert!(matches!(d.get_str("big"), Some(Value::BigInt)));
        assert!(matches!(d.get_str("f"), Some(Value::Float(f)) if *f == 0.5));
        assert_eq!(p.describe(d.get_str("l").unwrap()), "a list");
        match p.obj(d.get_str("t").unwrap()) {
            Some(Obj::Tuple(t)) => assert!(matches!(t.as_slice(), [Value::Int(300)])),
            _ => panic!("not a tuple"),
        }
    }

    #[test]
    fn long1_sign_extension() {
        for (bytes, want) in [
            (&[0xffu8][..], -1i64),
            (&[0x00, 0x01][..], 256),
            (&[0x00, 0x80][..], -32768),
            (&[][..], 0),
        ] {
            let mut w = PickleWriter::new();
            w.op(LONG1).op(bytes.len() as u8).0.extend_from_slice(bytes);
            let p = run(&w.finish()).unwrap();
            assert!(matches!(p.root, Value::Int(i) if i == want), "{bytes:?}");
        }
    }

    #[test]
    fn memo_shares_mutated_objects() {
        // d = {}; memo[0] = d; d['a'] = 1; root = (d, memo[0])  -> both see 'a'.
        let mut w = PickleWriter::new();
        w.op(EMPTY_DICT)
            .op(BINPUT)
            .op(0)
            .str("a")
            .op(BININT1)
            .op(1)
            .op(SETITEM);
        w.op(BINGET).op(0).op(TUPLE2);
        let p = run(&w.finish()).unwrap();
        let Some(Obj::Tuple(t)) = p.obj(&p.root) else {
            panic!()
        };
        for v in t {
            assert!(p.dict(v).unwrap().get_str("a").is_some());
        }
    }

    #[test]
    fn setitem_replaces_in_place() {
        let mut w = PickleWriter::new();
        w.op(EMPTY_DICT)
            .op(MARK)
            .str("a")
            .int(1)
            .str("b")
            .int(2)
            .str("a")
            .int(3);
        w.op(SETITEMS);
        let p = run(&w.finish()).unwrap();
        let d = p.dict(&p.root).unwrap();
        assert_eq!(d.items().len(), 2);
        assert!(matches!(d.items()[0], (Value::Str(ref k), Value::Int(3)) if &**k == "a"));
    }

    #[test]
    fn foreign_globals_are_refused() {
        let mut w = PickleWriter::new();
        w.global("os", "system")
            .str("echo pwned")
            .op(TUPLE1)
            .op(REDUCE);
        assert_eq!(
            run(&w.finish()).unwrap_err(),
            PickleError::Forbidden("os.system".into())
        );

        let mut w = PickleWriter::new();
        w.str("builtins").str("eval").op(STACK_GLOBAL);
        assert_eq!(
            run(&w.finish()).unwrap_err(),
            PickleError::Forbidden("builtins.eval".into())
        );

        // torch names outside the allow-list are refused too.
        let mut w = PickleWriter::new();
        w.global("torch.nn.modules.linear", "Linear");
        assert!(matches!(run(&w.finish()), Err(PickleError::Forbidden(_))));
        let mut w = PickleWriter::new();
        w.global("torch", "load");
        assert!(matches!(run(&w.finish()), Err(PickleError::Forbidden(_))));
    }

    #[test]
    fn refusal_happens_before_later_ops() {
        // The refused global comes first; a malformed tail is never reached.
        let mut w = PickleWriter::new();
        w.global("subprocess", "Popen").op(0xff);
        assert!(matches!(run(&w.0), Err(PickleError::Forbidden(_))));
    }

    #[test]
    fn only_allowed_callables_are_reduced() {
        let mut w = PickleWriter::new();
        w.global("torch", "FloatStorage").op(EMPTY_TUPLE).op(REDUCE);
        assert!(matches!(
            run(&w.finish()),
            Err(PickleError::Malformed { .. })
        ));
        let mut w = PickleWriter::new();
        w.str("x").op(EMPTY_TUPLE).op(REDUCE);
        assert!(matches!(
            run(&w.finish()),
            Err(PickleError::Malformed { .. })
        ));
        // BUILD on anything but an OrderedDict.
        let mut w = PickleWriter::new();
        w.op(EMPTY_LIST).op(EMPTY_DICT).op(BUILD);
        assert!(matches!(
            run(&w.finish()),
            Err(PickleError::Malformed { .. })
        ));
    }

    #[test]
    fn unknown_opcodes_are_named() {
        for code in [0x81u8, b'i', 0xff] {
            let mut w = PickleWriter::new();
            w.op(code);
            match run(&w.finish()) {
                Err(PickleError::Opcode { offset: 2, code: c }) => assert_eq!(c, code),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(opcode_name(0x81), "NEWOBJ");
        assert_eq!(opcode_name(b'i'), "INST");
    }

    #[test]
    fn deep_marks_are_bounded() {
        let mut w = PickleWriter::new();
        for _ in 0..100_000 {
            w.op(MARK);
        }
        match run(&w.finish()) {
            Err(PickleError::Malformed { detail, .. }) => assert!(detail.contains("MARK")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn deep_nesting_through_memo_is_flat() {
        // x = []; repeat: x = [x] via memo. 200k levels must neither overflow the stack when
        // built nor when dropped.
        let mut w = PickleWriter::new();
        w.op(EMPTY_LIST).op(BINPUT).op(0);
        for _ in 0..200_000 {
            w.op(POP)
                .op(EMPTY_LIST)
                .op(BINGET)
                .op(0)
                .op(APPEND)
                .op(BINPUT)
                .op(0);
        }
        let p = run(&w.finish()).unwrap();
        assert_eq!(p.describe(&p.root), "a list");
        drop(p);
    }

    #[test]
    fn stack_and_frame_underflow() {
        for ops in [
            &[STOP][..],
            &[MARK, STOP],
            &[BININT1, 1, MARK, TUPLE2],
            &[SETITEMS],
        ] {
            let mut w = PickleWriter::new();
            w.0.extend_from_slice(ops);
            assert!(
                matches!(run(&w.0), Err(PickleError::Malformed { .. })),
                "{ops:?}"
            );
        }
    }

    #[test]
    fn truncated_streams() {
        for data in [
            &[PROTO][..],
            &[PROTO, 2, BINUNICODE, 5, 0, 0, 0, b'a'],
            &[
                PROTO,
                2,
                BINUNICODE8,
                0xff,
                0xff,
                0xff,
                0xff,
                0xff,
                0xff,
                0xff,
                0xff,
            ],
            &[PROTO, 2, GLOBAL, b'o', b's'],
            &[PROTO, 2, BININT1, 1],
            &[],
        ] {
            assert!(
                matches!(run(data), Err(PickleError::Malformed { .. })),
                "{data:?}"
            );
        }
    }

    #[test]
    fn memo_errors() {
        let mut w = PickleWriter::new();
        w.op(BINGET).op(3);
        assert!(matches!(
            run(&w.finish()),
            Err(PickleError::Malformed { .. })
        ));
        let mut w = PickleWriter::new();
        w.op(BINPUT).op(3);
        assert!(matches!(
            run(&w.finish()),
            Err(PickleError::Malformed { .. })
        ));
    }

    #[test]
    fn tensor_description() {
        let mut w = PickleWriter::new();
        w.tensor_v2("HalfStorage", "7", 10, 2, &[2, 3], &[1, 2]);
        let p = run(&w.finish()).unwrap();
        let t = p.tensor(&p.root).unwrap();
        assert_eq!(t.dtype, ElemType::Known(DType::F16));
        assert_eq!(
            (t.offset, t.size.as_slice(), t.stride.as_slice()),
            (2, &[2, 3][..], &[1, 2][..])
        );
        assert_eq!(&*t.storage.key, "7");
        assert_eq!(t.storage.numel, 10);

        // Negative sizes and mismatched ranks are malformed.
        let mut w = PickleWriter::new();
        w.tensor_v2("FloatStorage", "0", 4, 0, &[-1], &[1]);
        assert!(matches!(
            run(&w.finish()),
            Err(PickleError::Malformed { .. })
        ));
        let mut w = PickleWriter::new();
        w.tensor_v2("FloatStorage", "0", 4, 0, &[2, 2], &[1]);
        assert!(matches!(
            run(&w.finish()),
            Err(PickleError::Malformed { .. })
        ));
    }

    #[test]
    fn codecs_encode_makes_bytes() {
        let mut w = PickleWriter::new();
        w.global("_codecs", "encode")
            .str("a\u{ff}")
            .str("latin1")
            .op(TUPLE2)
            .op(REDUCE);
        let p = run(&w.finish()).unwrap();
        assert!(matches!(&p.root, Value::Bytes(b) if **b == [b'a', 0xff]));
    }
}
