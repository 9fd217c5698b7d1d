//! The TorchScript module through the C++ shim (`src/ffi/module_shim.cpp`): loading, the named
//! parameters and buffers, the device constants of its graphs, the forward call. The raw handle
//! is not `Send`: a module stays on the thread that loaded it.

use super::error::ModelError;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

/// A device constant in a TorchScript file's graph: the file runs only on that device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinnedDevice {
    /// As libtorch writes it: `cpu`, `cuda:0`.
    pub device: String,
    /// The kind of the first node using it (`aten::ones`).
    pub op: String,
    /// The qualified name of the method whose graph holds it.
    pub method: String,
}

type NamedTensorCb = unsafe extern "C" fn(*mut c_void, *const c_char, *mut tch::Tensor);
type DeviceConstantCb =
    unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char, *const c_char);

unsafe extern "C" {
    fn dm_free_string(s: *mut c_char);
    fn dm_module_load(
        path: *const c_char,
        device_index: c_int,
        err: *mut *mut c_char,
    ) -> *mut c_void;
    fn dm_module_free(module: *mut c_void);
    fn dm_module_named_tensors(
        module: *mut c_void,
        data: *mut c_void,
        cb: NamedTensorCb,
        err: *mut *mut c_char,
    ) -> c_int;
    fn dm_module_device_constants(
        module: *mut c_void,
        data: *mut c_void,
        cb: DeviceConstantCb,
        err: *mut *mut c_char,
    ) -> c_int;
    fn dm_set_tf32(on: c_int);
    fn dm_module_channels_last(module: *mut c_void, on: c_int, err: *mut *mut c_char) -> c_int;
    fn dm_module_forward(
        module: *mut c_void,
        x: *const c_void,
        sigma: *const c_void,
        bf16: c_int,
        channels_last: c_int,
        denoised: *mut *mut c_void,
        features: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
}

pub(super) fn take_error(err: *mut c_char) -> String {
    shorten(&take_full_error(err))
}

pub(super) fn take_full_error(err: *mut c_char) -> String {
    if err.is_null() {
        return "unknown libtorch error".into();
    }
    let message = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    unsafe { dm_free_string(err) };
    message
}

/// libtorch messages can carry a long TorchScript traceback; the first lines say what broke.
pub(super) fn shorten(message: &str) -> String {
    message.lines().take(8).collect::<Vec<_>>().join("\n")
}

/// Whether a libtorch error says an allocation failed: CUDA's caching allocator ("CUDA out of
/// memory"), cuBLAS or cuDNN's (`*_STATUS_ALLOC_FAILED`), the CPU allocator ("can't allocate
/// memory"). The whole message is searched: in a TorchScript traceback it comes last.
pub(super) fn is_out_of_memory(message: &str) -> bool {
    [
        "out of memory",
        "STATUS_ALLOC_FAILED",
        "can't allocate memory",
    ]
    .iter()
    .any(|m| message.contains(m))
}

/// A failed forward: the message (shortened) and whether memory ran out.
pub(super) struct ForwardFailure {
    pub(super) message: String,
    pub(super) out_of_memory: bool,
    /// Not out of memory, but over `evaluation.gpu_memory_mib` (set by [`super::Model`]).
    pub(super) over_cap: bool,
    /// The images of the failed forward.
    pub(super) images: i64,
}

unsafe extern "C" fn collect_named(data: *mut c_void, name: *const c_char, t: *mut tch::Tensor) {
    let out = unsafe { &mut *(data as *mut Vec<(String, Tensor)>) };
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    out.push((name, unsafe { Tensor::from_ptr(t as *mut _) }));
}

unsafe extern "C" fn collect_device(
    data: *mut c_void,
    device: *const c_char,
    op: *const c_char,
    method: *const c_char,
) {
    let out = unsafe { &mut *(data as *mut Vec<PinnedDevice>) };
    let text = |p: *const c_char| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    out.push(PinnedDevice {
        device: text(device),
        op: text(op),
        method: text(method),
    });
}

/// A loaded TorchScript module (raw handle; not `Send`, so it stays on its thread).
pub(super) struct Module {
    ptr: *mut c_void,
    pub(super) path: PathBuf,
    /// Its 4-dimensional weights and its inputs in the channels-last layout
    /// ([`Module::use_channels_last`]).
    channels_last: std::cell::Cell<bool>,
}

impl Drop for Module {
    fn drop(&mut self) {
        unsafe { dm_module_free(self.ptr) }
    }
}

impl Module {
    pub(super) fn load(path: &Path, device: Device) -> Result<Module, ModelError> {
        let load_err = |message: String| ModelError::Load {
            path: path.to_path_buf(),
            message,
        };
        if !path.is_file() {
            return Err(load_err("no such file".into()));
        }
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| load_err("path contains a NUL byte".into()))?;
        let index = match device {
            Device::Cuda(n) => n as c_int,
            _ => -1,
        };
        let mut err = std::ptr::null_mut();
        let ptr = unsafe { dm_module_load(c_path.as_ptr(), index, &mut err) };
        if ptr.is_null() {
            return Err(load_err(take_error(err)));
        }
        Ok(Module {
            ptr,
            path: path.to_path_buf(),
            channels_last: std::cell::Cell::new(false),
        })
    }

    /// Runs the module in the channels-last layout from now on: its 4-dimensional weights
    /// converted in place (the aliases of [`Module::named_tensors`] follow), each input
    /// converted, the outputs contiguous. oneDNN's convolutions on the CPU are faster so (a
    /// 3.7 M-parameter U-Net's ICR 1.7 times; docs/guide/cost-and-gpu.md). Returns how many
    /// weights changed layout; with none (a network without convolutions) nothing changes.
    pub(super) fn use_channels_last(&self) -> Result<usize, String> {
        let changed = self.set_layout(true)?;
        self.channels_last.set(changed > 0);
        Ok(changed)
    }

    fn set_layout(&self, channels_last: bool) -> Result<usize, String> {
        let mut err = std::ptr::null_mut();
        let rc = unsafe { dm_module_channels_last(self.ptr, c_int::from(channels_last), &mut err) };
        usize::try_from(rc).map_err(|_| take_error(err))
    }

    /// Parameters then buffers, aliasing the module's storage, and how many are parameters.
    pub(super) fn named_tensors(&self) -> Result<(Vec<(String, Tensor)>, usize), ModelError> {
        let mut out: Vec<(String, Tensor)> = Vec::new();
        let mut err = std::ptr::null_mut();
        let rc = unsafe {
            dm_module_named_tensors(
                self.ptr,
                &mut out as *mut _ as *mut c_void,
                collect_named,
                &mut err,
            )
        };
        let Ok(params) = usize::try_from(rc) else {
            return Err(ModelError::Load {
                path: self.path.clone(),
                message: take_error(err),
            });
        };
        let params = params.min(out.len());
        Ok((out, params))
    }

    /// The device constants of every method graph of the module and its submodules.
    pub(super) fn device_constants(&self) -> Result<Vec<PinnedDevice>, ModelError> {
        let mut out: Vec<PinnedDevice> = Vec::new();
        let mut err = std::ptr::null_mut();
        let rc = unsafe {
            dm_module_device_constants(
                self.ptr,
                &mut out as *mut _ as *mut c_void,
                collect_device,
                &mut err,
            )
        };
        if rc < 0 {
            return Err(ModelError::Load {
                path: self.path.clone(),
                message: take_error(err),
            });
        }
        Ok(out)
    }

    /// `forward(x, sigma)`; with `bf16`, under bfloat16 autocast (outputs in float32). A
    /// network whose code fails in the channels-last layout but not in the contiguous one (a
    /// `view` that needs contiguous memory) runs contiguous from then on, with a warning.
    pub(super) fn forward(
        &self,
        x: &Tensor,
        sigma: &Tensor,
        bf16: bool,
    ) -> Result<(Tensor, Tensor), ForwardFailure> {
        if !self.channels_last.get() {
            return self.forward_in(x, sigma, bf16, false);
        }
        match self.forward_in(x, sigma, bf16, true) {
            Err(failure) if !failure.out_of_memory => {
                let back = |on: bool, failure: ForwardFailure| match self.set_layout(on) {
                    Ok(_) => Ok(failure),
                    Err(e) => Err(ForwardFailure {
                        message: format!("{}; and changing the layout: {e}", failure.message),
                        ..failure
                    }),
                };
                let failure = back(false, failure)?;
                match self.forward_in(x, sigma, bf16, false) {
                    Ok(out) => {
                        self.channels_last.set(false);
                        tracing::warn!(
                            architecture = %self.path.display(),
                            "the network failed in the channels-last layout ({}); it runs in \
                             the contiguous layout from now on",
                            failure.message.lines().next().unwrap_or_default()
                        );
                        Ok(out)
                    }
                    // It fails either way: not the layout's doing, which stays.
                    Err(contiguous) => Err(back(true, contiguous)?),
                }
            }
            out => out,
        }
    }

    fn forward_in(
        &self,
        x: &Tensor,
        sigma: &Tensor,
        bf16: bool,
        channels_last: bool,
    ) -> Result<(Tensor, Tensor), ForwardFailure> {
        let mut denoised = std::ptr::null_mut();
        let mut features = std::ptr::null_mut();
        let mut err = std::ptr::null_mut();
        let rc = unsafe {
            dm_module_forward(
                self.ptr,
                x.as_ptr() as *const c_void,
                sigma.as_ptr() as *const c_void,
                c_int::from(bf16),
                c_int::from(channels_last),
                &mut denoised,
                &mut features,
                &mut err,
            )
        };
        if rc != 0 {
            let message = take_full_error(err);
            return Err(ForwardFailure {
                out_of_memory: is_out_of_memory(&message),
                message: shorten(&message),
                over_cap: false,
                images: x.size().first().copied().unwrap_or(0),
            });
        }
        unsafe {
            Ok((
                Tensor::from_ptr(denoised as *mut _),
                Tensor::from_ptr(features as *mut _),
            ))
        }
    }
}

/// Whether cuDNN and cuBLAS may use TF32 for float32 work (libtorch's default: on for cuDNN).
pub(super) fn set_tf32(on: bool) {
    unsafe { dm_set_tf32(c_int::from(on)) }
}
