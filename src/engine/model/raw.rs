//! Tensors read by the weights readers ([`RawTensor`]) as libtorch tensors, without a copy: for
//! the architecture's checkpoints (`mod.rs`) and a compiled package's constants
//! (`compiled.rs`).

use crate::weights::{DType, RawTensor};
use tch::{Device, Kind, Tensor};

fn kind_of(dtype: DType) -> Kind {
    match dtype {
        DType::Bool => Kind::Bool,
        DType::U8 => Kind::Uint8,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::I32 => Kind::Int,
        DType::I64 => Kind::Int64,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
    }
}

/// A CPU tensor viewing the raw bytes without copying them; valid while `raw` lives.
pub(super) fn view(raw: &RawTensor) -> Tensor {
    let shape: Vec<i64> = raw.shape.iter().map(|&d| d as i64).collect();
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    // SAFETY: `read_checkpoint` guarantees `data` holds exactly numel × element size bytes in
    // row-major order; the view is only read (copied from) while `raw` is borrowed.
    unsafe {
        Tensor::from_blob(
            raw.data.as_ptr(),
            &shape,
            &strides,
            kind_of(raw.dtype),
            Device::Cpu,
        )
    }
}
