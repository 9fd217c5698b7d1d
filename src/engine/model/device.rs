//! The device an evaluation runs on, and TorchScript files that pin one: `auto|cpu|cuda|cuda:N`
//! resolved against what is visible, and the device constants a traced file may hold (a file
//! exported by `diffmon-export` holds none).

use super::error::{ModelError, REEXPORT};
use super::module::{Module, PinnedDevice, set_tf32};
use crate::config::DeviceSpec;
use std::ffi::{c_char, c_int, c_void};
use std::path::Path;
use tch::Device;

/// What [`ModelError::PinnedDevice`] says of `pins`: each op once, with its method's last two
/// name components, the first few.
fn describe_pins<'a>(pins: impl Iterator<Item = &'a PinnedDevice>) -> String {
    let mut seen: Vec<String> = Vec::new();
    for p in pins {
        let method: Vec<&str> = p.method.rsplitn(3, '.').take(2).collect();
        let method: Vec<&str> = method.into_iter().rev().collect();
        let text = format!("{} in {}", p.op, method.join("."));
        if !seen.contains(&text) {
            seen.push(text);
        }
    }
    let more = seen.len().saturating_sub(4);
    seen.truncate(4);
    let mut out = seen.join(", ");
    if more > 0 {
        out.push_str(&format!(" and {more} more"));
    }
    out
}

/// libtorch's name of `device`, as device constants print it.
fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        Device::Cpu => "cpu".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Whether a constant naming `pinned` puts tensors where `running` is: `cuda` is the current
/// CUDA device, index 0 unless changed (diffmon never changes it).
fn pin_matches(pinned: &str, running: Device) -> bool {
    let running = device_name(running);
    pinned == running || (pinned == "cuda" && running == "cuda:0")
}

/// The device constants of the TorchScript file at `path` (loaded on the CPU): `check-config`
/// reports any, since a file with one runs on that device only.
pub fn pinned_devices(path: &Path) -> Result<Vec<PinnedDevice>, ModelError> {
    Module::load(path, Device::Cpu)?.device_constants()
}

/// Refuses the TorchScript file at `path` when it pins another device than `device` (its
/// device constants `pins`), and warns when it pins `device` itself: it runs, here only.
pub fn check_pins(path: &Path, pins: &[PinnedDevice], device: Device) -> Result<(), ModelError> {
    let foreign: Vec<&PinnedDevice> = pins
        .iter()
        .filter(|p| !pin_matches(&p.device, device))
        .collect();
    if let Some(first) = foreign.first() {
        return Err(ModelError::PinnedDevice {
            path: path.to_path_buf(),
            pinned: first.device.clone(),
            uses: describe_pins(foreign.iter().copied()),
            running: device_name(device),
        });
    }
    if let Some(first) = pins.first() {
        tracing::warn!(
            file = %path.display(),
            pinned = %first.device,
            uses = %describe_pins(pins.iter()),
            "the file pins the device it runs on: it would fail on any other; re-export it \
             with this version's diffmon-export to make it follow its input's device"
        );
    }
    Ok(())
}

/// What `check-config` says of a file with device constants `pins` (not empty).
pub fn pins_problem(pins: &[PinnedDevice]) -> String {
    format!(
        "pins device {} ({}): it runs only there. {REEXPORT}",
        pins[0].device,
        describe_pins(pins.iter())
    )
}

/// Resolves `auto|cpu|cuda|cuda:N` to a libtorch device, and keeps CUDA's TF32 off (cuDNN
/// convolutions use it by default in libtorch): float32 on every device, so CPU and GPU give
/// the same numbers to float32 rounding.
pub fn select_device(spec: DeviceSpec) -> Result<Device, ModelError> {
    set_tf32(false);
    let (count, cuda_build) = if spec == DeviceSpec::Cpu {
        (0, false)
    } else {
        let cuda_build = load_cuda_backend();
        (tch::Cuda::device_count() as usize, cuda_build)
    };
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Auto if count > 0 => Ok(Device::Cuda(0)),
        DeviceSpec::Auto => Ok(Device::Cpu),
        DeviceSpec::Cuda(n) if n < count => Ok(Device::Cuda(n)),
        DeviceSpec::Cuda(_) => {
            let visible = match std::env::var("CUDA_VISIBLE_DEVICES") {
                Ok(v) => format!(" (CUDA_VISIBLE_DEVICES={v:?})"),
                Err(_) => String::new(),
            };
            let why = if !cuda_build {
                "the libtorch diffmon runs with has no CUDA support (a CPU-only torch)".into()
            } else if count == 0 {
                format!(
                    "no CUDA device is visible to this process{visible} (no GPU, or no NVIDIA driver)"
                )
            } else {
                format!("{count} CUDA device(s) visible to this process{visible}")
            };
            Err(ModelError::Device {
                spec,
                message: format!(
                    "not available: {why}; set `device` to cpu or auto, or one of the visible devices"
                ),
            })
        }
    }
}

/// libtorch registers its CUDA backend from `libtorch_cuda.so`'s static initializers; the linker
/// may drop that library as unused, so load it explicitly. Whether libtorch has it (false for
/// a CPU-only libtorch).
fn load_cuda_backend() -> bool {
    unsafe extern "C" {
        fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    }
    const RTLD_NOW: c_int = 2;
    const RTLD_GLOBAL: c_int = 0x100;
    // The binary's rpath names libtorch's folder, so the bare name resolves there.
    unsafe { !dlopen(c"libtorch_cuda.so".as_ptr(), RTLD_NOW | RTLD_GLOBAL).is_null() }
}
