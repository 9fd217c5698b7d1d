//! Training and held-out images from HDF5 (docs/design.md §12): a float dataset `[N,C,H,W]` with
//! values in [-1, 1], or `uint8` `[N,H,W,C]` / `[N,C,H,W]` converted as `x/127.5 − 1`. Read in
//! batches; an `ImageSet` holds an open HDF5 file and stays on the thread that opened it.

use ndarray::{Array4, s};
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: cannot open HDF5 file: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: hdf5::Error,
    },
    #[error("{path}: no dataset `{dataset}` (datasets at the top level: {available})")]
    MissingDataset {
        path: PathBuf,
        dataset: String,
        available: String,
    },
    #[error("{path}: dataset `{dataset}`: {message}")]
    Layout {
        path: PathBuf,
        dataset: String,
        message: String,
    },
    #[error("{path}: dataset `{dataset}`: {source}")]
    Type {
        path: PathBuf,
        dataset: String,
        #[source]
        source: hdf5::Error,
    },
    #[error("{path}: dataset `{dataset}`: cannot read images {start}..{end}: {source}")]
    Read {
        path: PathBuf,
        dataset: String,
        start: usize,
        end: usize,
        #[source]
        source: hdf5::Error,
    },
    /// Images read whose values are out of range.
    #[error("{path}: dataset `{dataset}`: cannot read images {start}..{end}: {message}")]
    Values {
        path: PathBuf,
        dataset: String,
        start: usize,
        end: usize,
        message: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// float32/64 `[N,C,H,W]` in [-1, 1].
    FloatNchw,
    /// uint8 `[N,C,H,W]`.
    U8Nchw,
    /// uint8 `[N,H,W,C]`.
    U8Nhwc,
}

/// An open image dataset.
pub struct ImageSet {
    path: PathBuf,
    name: String,
    dataset: hdf5::Dataset,
    layout: Layout,
    len: usize,
    /// `[C,H,W]`.
    shape: [usize; 3],
    /// Float images must lie in [-1, 1] (training data), or only be finite (sampler outputs).
    bounded: bool,
}

impl ImageSet {
    /// Training or held-out images: float values must lie in [-1, 1].
    pub fn open(path: &Path, dataset: &str) -> Result<ImageSet, DataError> {
        Self::open_with(path, dataset, true)
    }

    /// Sampler outputs (`diffmon sample`'s `/samples`): float values need only be finite, since
    /// a model's samples may overshoot [-1, 1].
    pub fn open_samples(path: &Path, dataset: &str) -> Result<ImageSet, DataError> {
        Self::open_with(path, dataset, false)
    }

    fn open_with(path: &Path, dataset: &str, bounded: bool) -> Result<ImageSet, DataError> {
        let file = hdf5::File::open(path).map_err(|source| DataError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let ds = file
            .dataset(dataset)
            .map_err(|_| DataError::MissingDataset {
                path: path.to_path_buf(),
                dataset: dataset.to_string(),
                available: file
                    .member_names()
                    .map(|n| {
                        if n.is_empty() {
                            "none".into()
                        } else {
                            n.join(", ")
                        }
                    })
                    .unwrap_or_else(|_| "unreadable".into()),
            })?;
        let layout_err = |message: String| DataError::Layout {
            path: path.to_path_buf(),
            dataset: dataset.to_string(),
            message,
        };
        let dims = ds.shape();
        if dims.len() != 4 {
            return Err(layout_err(format!(
                "has shape {dims:?}; expected 4 dimensions: [N,C,H,W] (float or uint8) or [N,H,W,C] (uint8)"
            )));
        }
        let dtype = ds
            .dtype()
            .and_then(|t| t.to_descriptor())
            .map_err(|source| DataError::Type {
                path: path.to_path_buf(),
                dataset: dataset.to_string(),
                source,
            })?;
        use hdf5::types::{FloatSize, IntSize, TypeDescriptor as T};
        let is_channels = |d: usize| matches!(d, 1 | 3 | 4);
        let (layout, shape) = match dtype {
            T::Float(FloatSize::U4) | T::Float(FloatSize::U8) => {
                (Layout::FloatNchw, [dims[1], dims[2], dims[3]])
            }
            T::Unsigned(IntSize::U1) if is_channels(dims[3]) && !is_channels(dims[1]) => {
                (Layout::U8Nhwc, [dims[3], dims[1], dims[2]])
            }
            T::Unsigned(IntSize::U1) => (Layout::U8Nchw, [dims[1], dims[2], dims[3]]),
            other => {
                return Err(layout_err(format!(
                    "has dtype {other}; expected float32/float64 in [-1, 1] or uint8 in [0, 255]"
                )));
            }
        };
        if dims[0] == 0 || shape.contains(&0) {
            return Err(layout_err(format!("has shape {dims:?}: no images")));
        }
        Ok(ImageSet {
            path: path.to_path_buf(),
            name: dataset.to_string(),
            dataset: ds,
            layout,
            len: dims[0],
            shape,
            bounded,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `[C,H,W]`.
    pub fn image_shape(&self) -> [usize; 3] {
        self.shape
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Images `start..end` as a CPU f32 tensor `[B,C,H,W]` in [-1, 1].
    pub fn read(&self, start: usize, end: usize) -> Result<Tensor, DataError> {
        let end = end.min(self.len);
        let read_err = |source: hdf5::Error| DataError::Read {
            path: self.path.clone(),
            dataset: self.name.clone(),
            start,
            end,
            source,
        };
        let values_err = |message: String| DataError::Values {
            path: self.path.clone(),
            dataset: self.name.clone(),
            start,
            end,
            message,
        };
        let sel = s![start..end, .., .., ..];
        let t = match self.layout {
            Layout::FloatNchw => {
                let a: Array4<f32> = self.dataset.read_slice(sel).map_err(read_err)?;
                let t = to_tensor(a);
                let max = t.abs().max().double_value(&[]);
                if !max.is_finite() {
                    return Err(values_err(format!("holds a non-finite value ({max})")));
                }
                if self.bounded && max > 1.0 + 1e-3 {
                    return Err(values_err(format!(
                        "float images must lie in [-1, 1]; found |x| up to {max} (scale them, or store uint8)"
                    )));
                }
                t
            }
            Layout::U8Nchw | Layout::U8Nhwc => {
                let a: Array4<u8> = self.dataset.read_slice(sel).map_err(read_err)?;
                let t = to_tensor(a).to_kind(Kind::Float) / 127.5 - 1.0;
                if self.layout == Layout::U8Nhwc {
                    t.permute([0, 3, 1, 2]).contiguous()
                } else {
                    t
                }
            }
        };
        Ok(t)
    }

    /// The images at `indices` (any order, repeats allowed), `[B,C,H,W]`.
    pub fn gather(&self, indices: &[usize]) -> Result<Tensor, DataError> {
        let rows: Vec<Tensor> = indices
            .iter()
            .map(|&i| self.read(i, i + 1))
            .collect::<Result<_, _>>()?;
        Ok(Tensor::cat(&rows, 0))
    }

    /// Every image, `[N,C,H,W]`.
    pub fn read_all(&self) -> Result<Tensor, DataError> {
        self.read(0, self.len)
    }
}

fn to_tensor<A: tch::kind::Element + Clone>(a: Array4<A>) -> Tensor {
    let shape: Vec<i64> = a.shape().iter().map(|&d| d as i64).collect();
    let data = a.as_standard_layout();
    let slice = data.as_slice().expect("standard layout is contiguous");
    Tensor::from_slice(slice).reshape(shape)
}
