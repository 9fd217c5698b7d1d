//! Training and held-out images from HDF5 (docs/design.md §12): a float dataset `[N,C,H,W]` with
//! values in [-1, 1], or `uint8` `[N,H,W,C]` / `[N,C,H,W]` converted as `x/127.5 − 1`. Read in
//! batches; an `ImageSet` holds an open HDF5 file and stays on the thread that opened it.
//!
//! The same refusals for every such file (training and held-out images, `data.latents_path`,
//! samples): the dataset must live in the file itself (no external link to another file, no
//! external raw storage, no virtual dataset: each would read another file, which the config does
//! not name); one image must not exceed [`MAX_IMAGE_ELEMENTS`] values; and a read is checked
//! against [`memory_bound`] before anything is allocated (a declared shape costs nothing to
//! write: a never-written or compressed dataset can declare terabytes). Allocation failures are
//! errors naming the file and dataset, never a panic.

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

/// The most values one image (`C·H·W`) may hold: 4096 × 4096 × 4.
pub const MAX_IMAGE_ELEMENTS: usize = 4096 * 4096 * 4;

/// The most bytes one read of images may take as float32: half the machine's physical memory
/// (8 GiB where it cannot be read).
pub fn memory_bound() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    match (u64::try_from(pages), u64::try_from(size)) {
        (Ok(p), Ok(s)) if p > 0 && s > 0 => p.saturating_mul(s) / 2,
        _ => 8 << 30,
    }
}

/// How the dataset `name` is reached from the file's root: refused when a link on the way is an
/// external link (to another file); a group with over 100 000 links is not searched.
fn check_links(file: &hdf5::File, name: &str) -> Result<(), String> {
    use hdf5::{IndexType, IterationOrder, LinkType};
    let mut group: hdf5::Group = (**file).clone();
    let parts: Vec<&str> = name.split('/').filter(|p| !p.is_empty()).collect();
    for (i, part) in parts.iter().enumerate() {
        let mut seen = 0usize;
        let found = group
            .find_link(IndexType::Name, IterationOrder::Increasing, |n, info| {
                seen += 1;
                if seen > 100_000 {
                    return Ok(Some(None));
                }
                Ok((n == *part).then_some(Some(info.link_type)))
            })
            .map_err(|e| format!("cannot list its links: {e}"))?;
        match found {
            Some(None) => return Err("a group on its path has over 100 000 links".into()),
            Some(Some(LinkType::External)) => {
                return Err(format!(
                    "`{part}` is an external link to another HDF5 file: refused (the dataset must \
                     be in the file the config names)"
                ));
            }
            _ => {}
        }
        if i + 1 < parts.len() {
            match group.group(part) {
                Ok(g) => group = g,
                Err(_) => return Ok(()), // not a group: opening the dataset says so
            }
        }
    }
    Ok(())
}

/// Refuses a dataset whose raw data lies outside the file: external raw storage (other files,
/// named in the dataset) or a virtual dataset (drawn from other datasets and files).
fn check_storage(ds: &hdf5::Dataset) -> Result<(), String> {
    use hdf5::dataset::Layout;
    let dcpl = ds
        .dcpl()
        .map_err(|e| format!("cannot read its storage properties: {e}"))?;
    if let Some(first) = dcpl.external().first() {
        return Err(format!(
            "its raw data is stored in external files (`{}`…): refused (the data must be in the \
             file the config names)",
            crate::store::safe_fs::untrusted_text(&first.name)
        ));
    }
    let layout = dcpl
        .get_layout()
        .map_err(|e| format!("cannot read its layout: {e}"))?;
    if !matches!(
        layout,
        Layout::Compact | Layout::Contiguous | Layout::Chunked
    ) {
        return Err(
            "a virtual dataset (drawn from other datasets or files): refused (the data must be \
             in the file the config names)"
                .into(),
        );
    }
    Ok(())
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
        let refused = |message: String| DataError::Layout {
            path: path.to_path_buf(),
            dataset: dataset.to_string(),
            message,
        };
        check_links(&file, dataset).map_err(refused)?;
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
        check_storage(&ds).map_err(refused)?;
        let layout_err = refused;
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
        if shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .is_none_or(|n| n > MAX_IMAGE_ELEMENTS)
        {
            return Err(layout_err(format!(
                "has shape {dims:?}: one image of {shape:?} exceeds {MAX_IMAGE_ELEMENTS} values"
            )));
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
        // Checked before anything is allocated: the shape is what the file declares.
        let bytes = (end.saturating_sub(start) as u64)
            .saturating_mul(self.shape.iter().product::<usize>() as u64)
            .saturating_mul(4);
        if bytes > memory_bound() {
            return Err(values_err(format!(
                "{} images of {:?} take {:.1} GiB as float32, over the bound of {:.1} GiB (half \
                 the machine's memory): a smaller data set, or fewer images in it",
                end.saturating_sub(start),
                self.shape,
                bytes as f64 / (1u64 << 30) as f64,
                memory_bound() as f64 / (1u64 << 30) as f64
            )));
        }
        let sel = s![start..end, .., .., ..];
        let t = match self.layout {
            Layout::FloatNchw => {
                let a: Array4<f32> = self.dataset.read_slice(sel).map_err(read_err)?;
                let t = to_tensor(a).map_err(values_err)?;
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
                let t = to_tensor(a)
                    .and_then(|t| t.f_to_kind(Kind::Float).map_err(|e| e.to_string()))
                    .map_err(values_err)?
                    / 127.5
                    - 1.0;
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

/// The array as a tensor; libtorch's errors (an allocation that fails) as a message.
fn to_tensor<A: tch::kind::Element + Clone>(a: Array4<A>) -> Result<Tensor, String> {
    let shape: Vec<i64> = a.shape().iter().map(|&d| d as i64).collect();
    let data = a.as_standard_layout();
    let slice = data.as_slice().expect("standard layout is contiguous");
    Tensor::f_from_slice(slice)
        .and_then(|t| t.f_reshape(shape))
        .map_err(|e| format!("cannot hold the images in memory: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file with a small, honest dataset `source` `[4,1,2,2]` in [-1, 1].
    fn source_file(dir: &Path) -> PathBuf {
        let path = dir.join("source.h5");
        let file = hdf5::File::create(&path).unwrap();
        let data = ndarray::Array4::<f32>::from_elem((4, 1, 2, 2), 0.5);
        file.new_dataset_builder()
            .with_data(&data)
            .create("source")
            .unwrap();
        path
    }

    fn refused(path: &Path, dataset: &str) -> String {
        match ImageSet::open_samples(path, dataset) {
            Ok(_) => panic!("{}: `{dataset}` was opened", path.display()),
            Err(e) => e.to_string(),
        }
    }

    /// Declared shapes cost nothing to write: a never-written dataset of 2^40 images, or images
    /// of 60000 × 60000, is refused by its shape, before anything is allocated, naming the file
    /// and the dataset (issue #45: the daemon aborted, or panicked on torch's allocation error).
    #[test]
    fn declared_sizes_are_bounded_before_anything_is_allocated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("latents.h5");
        let file = hdf5::File::create(&path).unwrap();
        file.new_dataset::<f32>()
            .chunk([1, 1, 16, 16])
            .shape([1usize << 40, 1, 16, 16])
            .create("latents")
            .unwrap();
        file.new_dataset::<f32>()
            .chunk([1, 1, 64, 64])
            .shape([2, 1, 60000, 60000])
            .create("wide")
            .unwrap();
        drop(file);
        let set = ImageSet::open_samples(&path, "latents").unwrap();
        let e = set.read_all().unwrap_err().to_string();
        assert!(
            e.contains("latents.h5") && e.contains("`latents`") && e.contains("over the bound"),
            "{e}"
        );
        // A batch of them is fine: the bound is on what is read.
        assert_eq!(set.read(0, 2).unwrap().size(), [2, 1, 16, 16]);
        let e = refused(&path, "wide");
        assert!(e.contains("`wide`") && e.contains("exceeds"), "{e}");
    }

    /// The data must be in the file the config names: external raw storage (here pointing at
    /// a file outside), an external link (to a file that exists, and to one that does not) and
    /// a virtual dataset are refused, each saying why.
    #[test]
    fn data_outside_the_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let source = source_file(dir.path());
        let secret = dir.path().join("secret");
        std::fs::write(&secret, [0u8; 64]).unwrap();
        let path = dir.path().join("hostile.h5");
        let file = hdf5::File::create(&path).unwrap();
        file.new_dataset::<f32>()
            .external(secret.to_str().unwrap(), 0, 64)
            .shape([4, 1, 2, 2])
            .create("stored_outside")
            .unwrap();
        file.link_external(source.to_str().unwrap(), "source", "linked")
            .unwrap();
        file.link_external("/nonexistent/gone.h5", "latents", "dangling")
            .unwrap();
        file.new_dataset::<f32>()
            .virtual_map(
                source.to_str().unwrap(),
                "source",
                [4, 1, 2, 2],
                ..,
                [4, 1, 2, 2],
                ..,
            )
            .shape([4, 1, 2, 2])
            .create("virtual")
            .unwrap();
        drop(file);
        let e = refused(&path, "stored_outside");
        assert!(e.contains("external files") && e.contains("secret"), "{e}");
        for name in ["linked", "dangling"] {
            let e = refused(&path, name);
            assert!(e.contains("external link"), "{name}: {e}");
        }
        let e = refused(&path, "virtual");
        assert!(e.contains("virtual dataset"), "{e}");
        // The source itself reads.
        assert_eq!(
            ImageSet::open_samples(&source, "source")
                .unwrap()
                .read_all()
                .unwrap()
                .size(),
            [4, 1, 2, 2]
        );
    }
}
