//! The device an evaluation runs on, and TorchScript files that pin one: `auto|cpu|cuda|cuda:N`
//! resolved against what is visible, and the device constants a traced file may hold (a file
//! exported by `diffmon-export` holds none).

use super::error::{ModelError, REEXPORT};
use super::module::{Module, PinnedDevice, set_tf32};
use crate::config::DeviceSpec;
use std::ffi::{c_char, c_int, c_uint, c_void};
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
    let chosen = match spec {
        DeviceSpec::Cpu => Device::Cpu,
        DeviceSpec::Auto if count > 0 => Device::Cuda(0),
        DeviceSpec::Auto => Device::Cpu,
        DeviceSpec::Cuda(n) if n < count => Device::Cuda(n),
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
            return Err(ModelError::Device {
                spec,
                message: format!(
                    "not available: {why}; set `device` to cpu or auto, or one of the visible devices"
                ),
            });
        }
    };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let name = match chosen {
        Device::Cuda(n) => gpu_name(n),
        _ => None,
    };
    tracing::info!(
        "{}",
        describe_choice(
            spec,
            chosen,
            count,
            name.as_deref(),
            visible.as_deref(),
            tch::get_num_threads()
        )
    );
    Ok(chosen)
}

/// The start-up line that names the device chosen and why: which GPU (its name where the CUDA
/// driver gives it), how many were visible, and on the CPU how many threads libtorch uses
/// (`cpu_threads`; one per core by default).
pub fn describe_choice(
    spec: DeviceSpec,
    chosen: Device,
    count: usize,
    name: Option<&str>,
    visible: Option<&str>,
    threads: i32,
) -> String {
    let visible = visible.map_or(String::new(), |v| format!(", CUDA_VISIBLE_DEVICES={v:?}"));
    let seen = match count {
        0 => format!("no CUDA device visible{visible}"),
        1 => format!("1 CUDA device visible{visible}"),
        n => format!("{n} CUDA devices visible{visible}"),
    };
    let threads = match threads {
        1 => "1 CPU thread".to_string(),
        n => format!("{n} CPU threads"),
    };
    match chosen {
        Device::Cuda(n) => {
            let name = name.map_or(String::new(), |n| format!(" ({n})"));
            format!(
                "device: cuda:{n}{name}, from `device: {spec}` ({seen}); {threads} (cpu_threads)"
            )
        }
        _ if spec == DeviceSpec::Cpu => {
            format!("device: cpu, from `device: cpu`; {threads} (cpu_threads)")
        }
        _ => format!("device: cpu, from `device: {spec}` ({seen}); {threads} (cpu_threads)"),
    }
}

/// The name of CUDA device `index` (`NVIDIA H100 80GB HBM3`), from the CUDA driver's
/// `cuDeviceGetName` (its C ABI is stable across driver releases; the runtime's device
/// properties struct is not); `None` where the driver or the name is not there.
fn gpu_name(index: usize) -> Option<String> {
    unsafe extern "C" {
        fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    }
    const RTLD_NOW: c_int = 2;
    type Init = unsafe extern "C" fn(c_uint) -> c_int;
    type Get = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
    type Name = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
    // SAFETY: the symbols are the CUDA driver API's, with these signatures since CUDA 2;
    // the name buffer is NUL-terminated by the driver within its given length.
    unsafe {
        let lib = dlopen(c"libcuda.so.1".as_ptr(), RTLD_NOW);
        if lib.is_null() {
            return None;
        }
        let sym = |name: &std::ffi::CStr| {
            let p = dlsym(lib, name.as_ptr());
            (!p.is_null()).then_some(p)
        };
        let init: Init = std::mem::transmute(sym(c"cuInit")?);
        let get: Get = std::mem::transmute(sym(c"cuDeviceGet")?);
        let name: Name = std::mem::transmute(sym(c"cuDeviceGetName")?);
        if init(0) != 0 {
            return None;
        }
        let mut device: c_int = 0;
        if get(&mut device, c_int::try_from(index).ok()?) != 0 {
            return None;
        }
        let mut buf = [0 as c_char; 256];
        if name(buf.as_mut_ptr(), buf.len() as c_int, device) != 0 {
            return None;
        }
        let text = std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy();
        let text = text.trim();
        (!text.is_empty()).then(|| text.to_string())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The start-up line names the device, why it was chosen, and the CPU threads.
    #[test]
    fn the_chosen_device_is_named_with_why() {
        let gpu = describe_choice(
            DeviceSpec::Auto,
            Device::Cuda(0),
            2,
            Some("NVIDIA H200"),
            Some("2,3"),
            8,
        );
        assert_eq!(
            gpu,
            "device: cuda:0 (NVIDIA H200), from `device: auto` (2 CUDA devices visible, \
             CUDA_VISIBLE_DEVICES=\"2,3\"); 8 CPU threads (cpu_threads)"
        );
        let fallback = describe_choice(DeviceSpec::Auto, Device::Cpu, 0, None, None, 1);
        assert_eq!(
            fallback,
            "device: cpu, from `device: auto` (no CUDA device visible); 1 CPU thread (cpu_threads)"
        );
        let asked = describe_choice(DeviceSpec::Cpu, Device::Cpu, 0, None, None, 4);
        assert_eq!(
            asked,
            "device: cpu, from `device: cpu`; 4 CPU threads (cpu_threads)"
        );
        let second = describe_choice(DeviceSpec::Cuda(1), Device::Cuda(1), 2, None, None, 4);
        assert!(
            second.starts_with("device: cuda:1, from `device: cuda:1` (2 CUDA"),
            "{second}"
        );
    }
}
