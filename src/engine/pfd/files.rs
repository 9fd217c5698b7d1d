//! The files PFD keeps: the cache of what does not change between checkpoints (latents, the
//! teacher's and the empirical flow's outputs and descriptors), keyed and written atomically;
//! latents and samples as HDF5.

use super::error::PfdError;
use crate::engine::data::ImageSet;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

pub(super) fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> PfdError {
    let path = path.to_path_buf();
    move |source| PfdError::Io { path, source }
}

/// Hex SHA-256 of a file's content.
pub fn file_sha256(path: &Path) -> Result<String, PfdError> {
    let mut file = std::fs::File::open(path).map_err(io_error(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_error(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where cached flows and latents live: `<state_dir>/cache`.
pub struct Cache {
    pub dir: PathBuf,
}

impl Cache {
    pub fn path(&self, kind: &str, key: &serde_json::Value) -> PathBuf {
        let digest = hex(&Sha256::digest(key.to_string().as_bytes()));
        self.dir.join(format!("{kind}-{}.h5", &digest[..16]))
    }

    /// The datasets of a cache file whose recorded key is `key`; `None` (with a log line) when
    /// the file is absent, unreadable, or was built for another key.
    pub fn load(&self, kind: &str, key: &serde_json::Value, names: &[&str]) -> Option<Vec<Tensor>> {
        let path = self.path(kind, key);
        if !path.exists() {
            return None;
        }
        match read_cache(&path, key, names) {
            Ok(tensors) => {
                tracing::info!(cache = %path.display(), "{kind}: reusing the cache");
                Some(tensors)
            }
            Err(message) => {
                tracing::warn!(cache = %path.display(), "{kind}: cache unusable, rebuilding: {message}");
                None
            }
        }
    }

    /// Writes datasets atomically (temporary file, fsync, rename).
    pub fn store(
        &self,
        kind: &str,
        key: &serde_json::Value,
        data: &[(&str, &Tensor)],
    ) -> Result<(), PfdError> {
        crate::store::safe_fs::create_private_dir(&self.dir).map_err(io_error(&self.dir))?;
        let path = self.path(kind, key);
        if let Some(name) = path.file_name() {
            // Leftovers of a crash mid-write (and links planted at those names).
            crate::store::safe_fs::remove_leftover_temps(&self.dir, &name.to_string_lossy());
        }
        write_h5_atomically(&path, |tmp| write_cache(tmp, Some(key), data))?;
        tracing::info!(cache = %path.display(), "{kind}: cached");
        Ok(())
    }
}

/// Writes `data` as datasets of a new HDF5 file, with the cache `key` as an attribute when given.
pub(super) fn write_cache(
    path: &Path,
    key: Option<&serde_json::Value>,
    data: &[(&str, &Tensor)],
) -> hdf5::Result<()> {
    let file = hdf5::File::create(path)?;
    if let Some(key) = key {
        let key: hdf5::types::VarLenUnicode =
            key.to_string().parse().expect("JSON has no NUL byte");
        file.new_attr::<hdf5::types::VarLenUnicode>()
            .create("key")?
            .write_scalar(&key)?;
    }
    for (name, t) in data {
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        let t = t.to_device(Device::Cpu).contiguous();
        match t.kind() {
            Kind::Float => {
                let v = Vec::<f32>::try_from(t.flatten(0, -1)).expect("f32 tensor");
                let a = ndarray::ArrayD::from_shape_vec(shape, v).expect("shape");
                file.new_dataset_builder().with_data(&a).create(*name)?;
            }
            _ => {
                let v = Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1))
                    .expect("f64 tensor");
                let a = ndarray::ArrayD::from_shape_vec(shape, v).expect("shape");
                file.new_dataset_builder().with_data(&a).create(*name)?;
            }
        }
    }
    file.close()
}

pub(super) fn read_cache(
    path: &Path,
    key: &serde_json::Value,
    names: &[&str],
) -> Result<Vec<Tensor>, String> {
    let file = hdf5::File::open(path).map_err(|e| e.to_string())?;
    let stored: hdf5::types::VarLenUnicode = file
        .attr("key")
        .and_then(|a| a.read_scalar())
        .map_err(|e| format!("no key: {e}"))?;
    if stored.as_str() != key.to_string().as_str() {
        return Err("built for other inputs".into());
    }
    names
        .iter()
        .map(|name| {
            let ds = file.dataset(name).map_err(|e| format!("`{name}`: {e}"))?;
            let shape: Vec<i64> = ds.shape().iter().map(|&d| d as i64).collect();
            let t = match ds.dtype().map_err(|e| e.to_string())?.size() {
                4 => Tensor::from_slice(&ds.read_raw::<f32>().map_err(|e| e.to_string())?),
                _ => Tensor::from_slice(&ds.read_raw::<f64>().map_err(|e| e.to_string())?),
            };
            Ok(t.view(shape.as_slice()))
        })
        .collect()
}

/// Reads `/latents` `[M,C,H,W]` (float) from `path`, checked against the image shape.
pub fn read_latents(path: &Path, image_shape: Option<[usize; 3]>) -> Result<Tensor, PfdError> {
    let set = ImageSet::open_samples(path, "latents")?;
    if let Some(shape) = image_shape
        && set.image_shape() != shape
    {
        return Err(PfdError::File {
            path: path.to_path_buf(),
            message: format!(
                "/latents hold images of shape {:?}, the model's images are {shape:?}",
                set.image_shape()
            ),
        });
    }
    Ok(set.read_all()?)
}

/// Writes samples `[M,C,H,W]` as float32 `/samples` (temporary file, then rename).
pub fn write_samples(path: &Path, samples: &Tensor) -> Result<(), PfdError> {
    let t = samples.to_kind(Kind::Float);
    write_h5_atomically(path, |tmp| write_cache(tmp, None, &[("samples", &t)]))
}

/// Writes an HDF5 file at `path` through `write` on a temporary file, then renames it into
/// place. The temporary file is created exclusively (O_EXCL|O_NOFOLLOW) under a random name
/// before HDF5 opens it again by path: that path cannot be swapped for a link in between, its
/// name being unpredictable, and `persist` checks that the file renamed is the one created.
pub(super) fn write_h5_atomically(
    path: &Path,
    write: impl FnOnce(&Path) -> hdf5::Result<()>,
) -> Result<(), PfdError> {
    let (file, tmp) = crate::store::safe_fs::temp_file(path).map_err(io_error(path))?;
    let result = write(&tmp)
        .map_err(|source| PfdError::Hdf5 {
            path: tmp.clone(),
            source,
        })
        .and_then(|_| crate::store::safe_fs::persist(&file, &tmp, path).map_err(io_error(path)));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cache_round_trips_and_rejects_another_key() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache {
            dir: dir.path().join("cache"),
        };
        let key = json!({"a": 1});
        let t = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0]).view([2, 2]);
        cache.store("flow", &key, &[("features", &t)]).unwrap();
        let back = cache.load("flow", &key, &["features"]).unwrap();
        assert_eq!(back[0], t);
        // Same file name, other content of the key: refused.
        let path = cache.path("flow", &key);
        let other = json!({"a": 2});
        assert!(read_cache(&path, &other, &["features"]).is_err());
        // A truncated file is refused, not used.
        let len = std::fs::metadata(&path).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len / 2).unwrap();
        assert!(cache.load("flow", &key, &["features"]).is_none());
    }

    #[test]
    fn cache_and_sample_writes_never_follow_links_at_temporary_names() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let cache = Cache {
            dir: dir.path().join("cache"),
        };
        std::fs::create_dir(&cache.dir).unwrap();
        let key = json!({"a": 1});
        let path = cache.path("flow", &key);
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        // The old names: `<cache>.h5.tmp-<pid>` and, for samples, `<file>.h5.tmp`.
        let link = |at: PathBuf| std::os::unix::fs::symlink(&victim, at).unwrap();
        link(
            cache
                .dir
                .join(format!("{}.tmp-{}", name, std::process::id())),
        );
        let t = Tensor::from_slice(&[1.0f64, 2.0]);
        cache.store("flow", &key, &[("features", &t)]).unwrap();
        assert_eq!(cache.load("flow", &key, &["features"]).unwrap()[0], t);
        let samples = dir.path().join("samples.h5");
        link(dir.path().join("samples.h5.tmp"));
        write_samples(
            &samples,
            &Tensor::zeros([1, 1, 2, 2], (Kind::Float, Device::Cpu)),
        )
        .unwrap();
        assert!(samples.is_file());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    }
}
