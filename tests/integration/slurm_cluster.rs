//! A real single-node Slurm cluster for the tests: `munged` with its own key and socket,
//! `slurmctld` and `slurmd` with a generated `slurm.conf` (this host as the one node, free
//! ports, state, spool and logs in a temporary folder, no accounting daemon). Every Slurm
//! command of the tests reads that config through `SLURM_CONF`. Dropping the cluster cancels its
//! jobs and stops its daemons. The binaries come from Debian's `slurm-wlm` and `munge`
//! (`make setup`); [`Cluster::start`] returns `None`, with a message, only when they are missing.

use crate::daemon::free_port;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const BINARIES: [&str; 8] = [
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "squeue",
    "scontrol",
    "scancel",
    "sinfo",
];

/// One cluster at a time: the tests share the host's name as their node's.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// `MinJobAge` of the generated config: how long a finished job stays visible to `scontrol`.
pub const MIN_JOB_AGE_SECS: u64 = 60;

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub conf: PathBuf,
    munged: Option<Child>,
    slurmctld: Option<Child>,
    slurmd: Option<Child>,
    _serial: MutexGuard<'static, ()>,
}

fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|d| d.join(name).is_file()))
        .unwrap_or(false)
        || ["/usr/sbin", "/sbin"]
            .iter()
            .any(|d| Path::new(d).join(name).is_file())
}

fn binary(name: &str) -> PathBuf {
    for d in ["/usr/sbin", "/sbin"] {
        let p = Path::new(d).join(name);
        if p.is_file() {
            return p;
        }
    }
    PathBuf::from(name)
}

fn hostname() -> String {
    let out = Command::new("hostname").arg("-s").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// CPUs and MiB of memory, as `slurmd -C` reports them for this host.
fn node_resources() -> (String, String) {
    let out = Command::new(binary("slurmd")).arg("-C").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |name: &str| {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .map(str::to_string)
    };
    (
        field("CPUs").unwrap_or_else(|| "1".into()),
        field("RealMemory").unwrap_or_else(|| "1024".into()),
    )
}

impl Cluster {
    /// Starts the cluster and waits until its node is idle; `None` when the binaries are
    /// missing.
    pub fn start() -> Option<Cluster> {
        let missing: Vec<_> = BINARIES.iter().filter(|b| !on_path(b)).collect();
        if !missing.is_empty() {
            eprintln!(
                "SKIPPED: the Slurm tests need {missing:?} (Debian's slurm-wlm and munge: `make setup`)"
            );
            return None;
        }
        let serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::Builder::new()
            .prefix("diffmon-slurm")
            .tempdir()
            .unwrap();
        let d = dir.path();
        // munged wants every folder above its socket searchable by all.
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
        for sub in ["state", "spool"] {
            fs::create_dir(d.join(sub)).unwrap();
        }
        let key = d.join("munge.key");
        let mut bytes = vec![0u8; 1024];
        std::io::Read::read_exact(&mut fs::File::open("/dev/urandom").unwrap(), &mut bytes)
            .unwrap();
        fs::write(&key, bytes).unwrap();
        fs::set_permissions(&key, fs::Permissions::from_mode(0o600)).unwrap();
        let node = hostname();
        let (cpus, memory) = node_resources();
        let conf = d.join("slurm.conf");
        let p = |name: &str| d.join(name).display().to_string();
        fs::write(
            &conf,
            format!(
                "ClusterName=diffmontest\n\
                 SlurmctldHost={node}\n\
                 SlurmctldPort={ctld}\n\
                 SlurmdPort={slurmd}\n\
                 SlurmUser=root\n\
                 SlurmdUser=root\n\
                 AuthType=auth/munge\n\
                 AuthInfo=socket={socket}\n\
                 CredType=cred/munge\n\
                 StateSaveLocation={state}\n\
                 SlurmdSpoolDir={spool}\n\
                 SlurmctldPidFile={ctld_pid}\n\
                 SlurmdPidFile={slurmd_pid}\n\
                 SlurmctldLogFile={ctld_log}\n\
                 SlurmdLogFile={slurmd_log}\n\
                 ProctrackType=proctrack/linuxproc\n\
                 TaskPlugin=task/none\n\
                 SelectType=select/cons_tres\n\
                 SelectTypeParameters=CR_CPU\n\
                 SchedulerType=sched/backfill\n\
                 MpiDefault=none\n\
                 ReturnToService=2\n\
                 MinJobAge={MIN_JOB_AGE_SECS}\n\
                 SlurmdTimeout=300\n\
                 JobAcctGatherType=jobacct_gather/none\n\
                 AccountingStorageType=accounting_storage/none\n\
                 NodeName={node} CPUs={cpus} RealMemory={memory} State=UNKNOWN\n\
                 PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP\n",
                ctld = free_port(),
                slurmd = free_port(),
                socket = p("munge.sock"),
                state = p("state"),
                spool = p("spool"),
                ctld_pid = p("slurmctld.pid"),
                slurmd_pid = p("slurmd.pid"),
                ctld_log = p("slurmctld.log"),
                slurmd_log = p("slurmd.log"),
            ),
        )
        .unwrap();
        let mut cluster = Cluster {
            conf,
            munged: None,
            slurmctld: None,
            slurmd: None,
            _serial: serial,
            dir,
        };
        let d = cluster.dir.path().to_path_buf();
        cluster.munged = Some(cluster.spawn(
            &binary("munged"),
            &[
                "-F",
                &format!("--key-file={}", key.display()),
                &format!("--socket={}", d.join("munge.sock").display()),
                &format!("--pid-file={}", d.join("munged.pid").display()),
                &format!("--log-file={}", d.join("munged.log").display()),
                &format!("--seed-file={}", d.join("munged.seed").display()),
            ],
            "munged.out",
        ));
        cluster.wait_for(Duration::from_secs(20), "munged's socket", |c| {
            c.dir.path().join("munge.sock").exists()
        });
        let conf = cluster.conf.display().to_string();
        cluster.slurmctld = Some(cluster.spawn(
            &binary("slurmctld"),
            &["-D", "-i", "-f", &conf],
            "slurmctld.out",
        ));
        cluster.start_slurmd();
        cluster.wait_until_idle();
        Some(cluster)
    }

    fn spawn(&self, program: &Path, args: &[&str], out: &str) -> Child {
        let log = fs::File::create(self.dir.path().join(out)).unwrap();
        Command::new(program)
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()))
    }

    /// Starts `slurmd` (again).
    pub fn start_slurmd(&mut self) {
        let conf = self.conf.display().to_string();
        self.slurmd = Some(self.spawn(&binary("slurmd"), &["-D", "-f", &conf], "slurmd.out"));
    }

    /// Stops `slurmd` (SIGTERM; its jobs' processes go on, as with a real node's daemon
    /// restarted under running jobs).
    pub fn stop_slurmd(&mut self) {
        if let Some(mut child) = self.slurmd.take() {
            stop(&mut child);
        }
    }

    /// Waits until `sinfo` shows the node idle (or mixed/allocated: it is up).
    pub fn wait_until_idle(&self) {
        self.wait_for(Duration::from_secs(60), "the node to be idle", |c| {
            let out = c.command("sinfo", &["-h", "-o", "%t"]);
            let state = String::from_utf8_lossy(&out.stdout).trim().to_string();
            state == "idle"
        });
    }

    pub fn wait_for(&self, timeout: Duration, what: &str, mut cond: impl FnMut(&Cluster) -> bool) {
        let start = Instant::now();
        while !cond(self) {
            if start.elapsed() > timeout {
                panic!("timed out waiting for {what}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// A Slurm client command on this cluster.
    pub fn command(&self, name: &str, args: &[&str]) -> Output {
        Command::new(binary(name))
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {name}: {e}"))
    }

    /// Ids and states of the cluster's jobs in the queue.
    pub fn queue(&self) -> Vec<(String, String)> {
        let out = self.command("squeue", &["-h", "-o", "%i %T"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    /// The end of the daemons' logs, for a failure's message.
    pub fn logs(&self) -> String {
        let mut all = String::new();
        for f in [
            "munged.out",
            "slurmctld.out",
            "slurmd.out",
            "slurmctld.log",
            "slurmd.log",
        ] {
            let text = fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            all += &format!("--- {f}\n");
            for l in tail.into_iter().rev() {
                all += l;
                all.push('\n');
            }
        }
        all
    }
}

fn stop(child: &mut Child) {
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.slurmctld.is_some() {
            let _ = self.command("scancel", &["--full", "-u", "root"]);
            if self.slurmd.is_none() {
                self.start_slurmd();
            }
            let start = Instant::now();
            while !self.queue().is_empty() && start.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(250));
            }
        }
        for child in [
            self.slurmd.take(),
            self.slurmctld.take(),
            self.munged.take(),
        ]
        .into_iter()
        .flatten()
        {
            let mut child = child;
            stop(&mut child);
        }
    }
}
