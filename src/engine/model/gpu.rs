//! The GPU side of a model's forward passes (docs/design.md §11, "Sharing the GPU"): the GPU
//! time they take, the share of the GPU's time they may take (`evaluation.gpu_share`), the
//! memory they may hold (`evaluation.gpu_memory_mib`), and CUDA's caching allocator (its peak,
//! and giving its cache back after an evaluation). Nothing here runs on a CPU device.

use super::module::take_error;
use std::ffi::{c_char, c_int};
use std::time::Duration;

unsafe extern "C" {
    fn dm_cuda_memory(device: c_int, out: *mut i64, err: *mut *mut c_char) -> c_int;
    fn dm_cuda_reset_peak(device: c_int, err: *mut *mut c_char) -> c_int;
    fn dm_cuda_empty_cache(err: *mut *mut c_char) -> c_int;
}

/// What CUDA's caching allocator holds on one device for this process, in bytes: what tensors
/// use now and at the peak, and the most it reserved from the GPU (the blocks tensors use and its
/// cache: what another process on the GPU cannot have). The CUDA context itself (a few hundred
/// MiB) is not counted. Peaks are since the last [`reset_peak`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuMemory {
    pub allocated: i64,
    pub allocated_peak: i64,
    pub reserved_peak: i64,
}

/// One call of the shim's allocator functions, which report a failure through `err`.
fn call(f: impl FnOnce(*mut *mut c_char) -> c_int) -> Result<(), String> {
    let mut err = std::ptr::null_mut();
    if f(&mut err) == 0 {
        Ok(())
    } else {
        Err(take_error(err))
    }
}

/// The allocator's counts on CUDA device `index`.
pub fn memory(index: usize) -> Result<GpuMemory, String> {
    let mut out = [0i64; 3];
    call(|err| unsafe { dm_cuda_memory(index as c_int, out.as_mut_ptr(), err) })?;
    let [allocated, allocated_peak, reserved_peak] = out;
    Ok(GpuMemory {
        allocated,
        allocated_peak,
        reserved_peak,
    })
}

/// The peaks of [`memory`] start again from the current values.
pub fn reset_peak(index: usize) -> Result<(), String> {
    call(|err| unsafe { dm_cuda_reset_peak(index as c_int, err) })
}

/// Gives the allocator's cached blocks (those no tensor uses) back to the GPU, where another
/// process can take them.
pub fn release_cached() -> Result<(), String> {
    call(|err| unsafe { dm_cuda_empty_cache(err) })
}

/// The pause after `busy` of GPU work that keeps the work at `share` of the time: busy /
/// (busy + pause) = share.
pub fn pause_after(busy: Duration, share: f64) -> Duration {
    if share >= 1.0 || share <= 0.0 {
        return Duration::ZERO;
    }
    busy.mul_f64((1.0 - share) / share)
}

/// The batch a capped model starts from (`evaluation.gpu_memory_mib`): it then grows by
/// [`grown_batch`].
pub const CAPPED_START: i64 = 16;

/// Under a memory cap of `cap` bytes: after a forward of `images` images (the whole batch
/// limit) that allocated `took` bytes at its peak above the `allocated` before it, the doubled
/// batch when twice as much still fits within 80 % of the cap (a fifth left to the allocator's
/// rounding and fragmentation: the cap is on what it reserves), else `None`. Twice the batch
/// takes at most twice the memory (a fixed part, workspaces, does not double), so a batch grown
/// this way stays under the cap.
pub fn grown_batch(images: i64, allocated: i64, took: i64, cap: i64) -> Option<i64> {
    let fits = allocated as f64 + 2.0 * took.max(0) as f64 <= 0.8 * cap as f64;
    fits.then_some(images.saturating_mul(2))
}

/// `evaluation.gpu_share` and `evaluation.gpu_memory_mib` as a model applies them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuLimits {
    /// The share of the GPU's time the forward passes may take, in (0, 1].
    pub share: f64,
    /// The most bytes the caching allocator may reserve while they run.
    pub memory_cap: Option<i64>,
}

impl GpuLimits {
    /// The limits a run's `evaluation` section sets.
    pub fn of(e: &crate::config::EvaluationConfig) -> GpuLimits {
        GpuLimits {
            share: e.gpu_share,
            memory_cap: e.gpu_memory_mib.map(|mib| (mib as i64) << 20),
        }
    }
}

impl Default for GpuLimits {
    fn default() -> Self {
        GpuLimits {
            share: 1.0,
            memory_cap: None,
        }
    }
}

/// What one evaluation took of the GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuUse {
    /// The wall time of the network's forward passes, each synchronized at both ends (the GPU
    /// was busy with them, or waiting on another process's work): the pauses of the share are
    /// not in it.
    pub seconds: f64,
    /// The most bytes the caching allocator reserved during the evaluation.
    pub memory_peak_bytes: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The duty cycle: after the pause, the busy time is `share` of the whole.
    #[test]
    fn the_pause_keeps_the_work_at_its_share_of_the_time() {
        let busy = Duration::from_millis(300);
        for share in [0.1, 0.25, 0.5, 0.9] {
            let pause = pause_after(busy, share);
            let duty = busy.as_secs_f64() / (busy + pause).as_secs_f64();
            assert!((duty - share).abs() < 1e-6, "share {share}: duty {duty}");
        }
        assert_eq!(pause_after(busy, 1.0), Duration::ZERO);
    }

    /// A forward of B images that takes 1000 + 50·B bytes above 10 000 allocated, under a cap
    /// of 20 000 (16 000 usable): the batch doubles while 10 000 + 2·(1000 + 50·B) ≤ 16 000,
    /// 16 → 32 (13 600) → 64 (15 200), and stops there (10 000 + 2·4200 = 18 400): a forward of
    /// 64 takes 14 200 bytes, under the cap.
    #[test]
    fn a_capped_batch_doubles_while_twice_its_memory_fits() {
        let took = |b: i64| 1000 + 50 * b;
        let mut b = CAPPED_START;
        while let Some(next) = grown_batch(b, 10_000, took(b), 20_000) {
            b = next;
        }
        assert_eq!(b, 64);
        assert!(10_000 + took(b) <= 20_000);
        // No room left: no growth; nothing taken (a cached forward): growth.
        assert_eq!(grown_batch(16, 20_000, took(16), 20_000), None);
        assert_eq!(grown_batch(16, 0, 0, 20_000), Some(32));
    }
}
