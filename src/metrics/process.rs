//! The standard process metrics (`process_*`), read from /proc/self at each scrape: the
//! daemon's own, once per exposition and without a `run` label (every run of a sweep shares the
//! process).

use super::names::{
    PROCESS_CPU_SECONDS, PROCESS_MAX_FDS, PROCESS_OPEN_FDS, PROCESS_RESIDENT_MEMORY,
    PROCESS_START_TIME, PROCESS_VIRTUAL_MEMORY,
};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// One reading of /proc/self; a field is None where it could not be read.
#[derive(Debug, Default)]
pub struct ProcessStats {
    pub cpu_seconds: Option<f64>,
    pub resident_bytes: Option<f64>,
    pub virtual_bytes: Option<f64>,
    pub start_time_seconds: Option<f64>,
    pub open_fds: Option<f64>,
    pub max_fds: Option<f64>,
}

impl ProcessStats {
    pub fn read() -> ProcessStats {
        let mut p = ProcessStats::default();
        // SAFETY: sysconf and getrlimit only read process-wide settings into our variables.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
        if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
            // Fields after the command name in parentheses (which may hold spaces): state is
            // field 3, utime 14, stime 15, starttime 22, vsize 23, rss 24.
            if let Some(i) = stat.rfind(')') {
                let f: Vec<&str> = stat[i + 1..].split_whitespace().collect();
                let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<f64>().ok());
                if ticks > 0.0 {
                    if let (Some(u), Some(s)) = (field(14), field(15)) {
                        p.cpu_seconds = Some((u + s) / ticks);
                    }
                    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|t| {
                        t.lines()
                            .find_map(|l| l.strip_prefix("btime "))
                            .and_then(|v| v.trim().parse::<f64>().ok())
                    });
                    if let (Some(b), Some(st)) = (boot, field(22)) {
                        p.start_time_seconds = Some(b + st / ticks);
                    }
                }
                p.virtual_bytes = field(23);
                if page > 0.0 {
                    p.resident_bytes = field(24).map(|r| r * page);
                }
            }
        }
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            // The directory handle itself is one of the entries.
            p.open_fds = Some(dir.count().saturating_sub(1) as f64);
        }
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
            p.max_fds = Some(lim.rlim_cur as f64);
        }
        p
    }
}

/// The `process_*` metrics, read at each scrape. (A collector's HELP is written as given: with
/// its full stop, which `Registry::register` adds to the others.)
#[derive(Debug)]
struct ProcessCollector;

/// The OpenMetrics families of the `process_*` metrics, read now, without a `run` label and
/// without the closing `# EOF`.
pub(super) fn encode_process() -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(ProcessCollector));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).expect("writing to a String");
    out.strip_suffix("# EOF\n").unwrap_or(&out).to_string()
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let p = ProcessStats::read();
        if let Some(v) = p.cpu_seconds {
            let c = ConstCounter::new(v);
            let e = encoder.encode_descriptor(
                PROCESS_CPU_SECONDS,
                "Total user and system CPU time spent in seconds.",
                None,
                c.metric_type(),
            )?;
            c.encode(e)?;
        }
        let gauges = [
            (
                PROCESS_RESIDENT_MEMORY,
                "Resident memory size in bytes.",
                p.resident_bytes,
            ),
            (
                PROCESS_VIRTUAL_MEMORY,
                "Virtual memory size in bytes.",
                p.virtual_bytes,
            ),
            (
                PROCESS_START_TIME,
                "Start time of the process since unix epoch in seconds.",
                p.start_time_seconds,
            ),
            (
                PROCESS_OPEN_FDS,
                "Number of open file descriptors.",
                p.open_fds,
            ),
            (
                PROCESS_MAX_FDS,
                "Maximum number of open file descriptors.",
                p.max_fds,
            ),
        ];
        for (name, help, value) in gauges {
            if let Some(v) = value {
                let g = ConstGauge::new(v);
                let e = encoder.encode_descriptor(name, help, None, g.metric_type())?;
                g.encode(e)?;
            }
        }
        Ok(())
    }
}
