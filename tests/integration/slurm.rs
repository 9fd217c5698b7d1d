//! The Slurm executor (`evaluation.executor: slurm`) on a real single-node cluster
//! ([`crate::slurm_cluster`]): records equal to the local executor's, exactly once, in order,
//! and the faults of a real cluster (a cancelled job, a job over its time limit, `slurmd`
//! stopped and restarted, the daemon killed with jobs in flight).

use crate::common::{diffmon, root, stderr, stdout, toy_run};
use crate::daemon::{Daemon, empty_run, free_port, journal, journal_entries};
use crate::early_stop::{checkpoints_by_icr, detector_config, place, write_base_config};
use crate::slurm_cluster::Cluster;
use serde_json::Value;
use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The harness itself: the node comes up idle and runs a batch job to completion.
#[test]
fn the_test_cluster_runs_a_batch_job() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let script = cluster.dir.path().join("hello.sh");
    fs::write(&script, "#!/bin/sh\necho hello from $SLURM_JOB_ID\n").unwrap();
    let out_file = cluster.dir.path().join("hello.out");
    let out = cluster.command(
        "sbatch",
        &[
            "--parsable",
            "--output",
            out_file.to_str().unwrap(),
            script.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        cluster.logs()
    );
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    cluster.wait_for(Duration::from_secs(60), "the job to finish", |_| {
        fs::read_to_string(&out_file).is_ok_and(|t| t.contains("hello"))
    });
    assert_eq!(
        fs::read_to_string(&out_file).unwrap().trim(),
        format!("hello from {id}")
    );
}

/// Starts `diffmon watch` on `config` with the cluster's `SLURM_CONF`.
fn daemon(cluster: &Cluster, config: PathBuf, port: u16) -> Daemon {
    let conf = format!("SLURM_CONF={}", cluster.conf.display());
    Daemon::spawn_wrapped(config, port, &["env", &conf])
}

/// Writes `<dir>/diffmon.yaml`: the run, quick completion checks, `extra`.
fn write_config(dir: &Path, port: u16, extra: &str) -> PathBuf {
    let config = dir.join("diffmon.yaml");
    fs::write(
        &config,
        format!(
            "run: {{dir: ., name: test}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\n\
             icr: {{samples: 256, batch_size: 256}}\n\
             http: {{listen: \"127.0.0.1:{port}\"}}\n\
             checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{extra}"
        ),
    )
    .unwrap();
    config
}

/// Job submissions per step, from the jobs journal.
fn submissions(dir: &Path) -> HashMap<i64, usize> {
    diffmon::daemon::jobs::submissions_per_step(&dir.join(".diffmon")).unwrap_or_default()
}

type Numbers = Vec<(String, f64)>;

/// Records via Slurm (`a`) and locally (`b`): as many, with the same fields, each number within
/// 1e-12 relative (the same computation, in another process).
fn assert_same_records(a: &[Numbers], b: &[Numbers], label: &str) {
    assert_eq!(a.len(), b.len(), "{label}: record counts");
    for (a, b) in a.iter().zip(b) {
        assert_eq!(
            a.iter().map(|x| &x.0).collect::<Vec<_>>(),
            b.iter().map(|x| &x.0).collect::<Vec<_>>(),
            "{label}"
        );
        for ((key, x), (_, y)) in a.iter().zip(b) {
            let tolerance = 1e-12 * x.abs().max(y.abs());
            assert!(
                (x - y).abs() <= tolerance,
                "{label} {key}: {x} via Slurm, {y} locally"
            );
        }
    }
}

/// The records' numbers, without the timings (`seconds`, `stages`) and the path.
fn numbers(record: &Value) -> Numbers {
    let mut out: Vec<(String, f64)> = record
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| !["seconds", "stages", "checkpoint"].contains(&k.as_str()))
        .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Acceptance: a U-turn of five checkpoints, each evaluated once by its own Slurm job, gives
/// the local executor's records (to 1e-12 relative) in the same order and the same decision;
/// a sixth file that is no checkpoint is the same failure (`unreadable`) either way.
#[test]
fn every_checkpoint_is_evaluated_once_through_slurm_as_the_local_executor_would() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let (local, slurm) = (empty_run(), empty_run());
    write_base_config(local.path(), "");
    let (hi, lo, rise) = checkpoints_by_icr(local.path());
    let detector = detector_config(rise);
    let mut records = Vec::new();
    let mut statuses = Vec::new();
    for (run, executor) in [
        (
            &slurm,
            "evaluation: {executor: slurm, max_in_flight: 3, slurm: {poll_secs: 0.5}}\n",
        ),
        (&local, ""),
    ] {
        let dir = run.path();
        for (step, src) in [(1, &hi), (2, &lo), (3, &lo), (4, &hi), (5, &hi)] {
            place(dir, src, step);
        }
        // Not a checkpoint: a failure with the same reason either way.
        fs::write(dir.join("ckpt_6.pt"), b"not a checkpoint").unwrap();
        let port = free_port();
        let config = write_config(dir, port, &format!("{detector}{executor}"));
        let d = daemon(&cluster, config, port);
        d.wait_for(Duration::from_secs(300), "six outcomes", |_| {
            journal_entries(dir).len() >= 6
        });
        assert_eq!(
            journal(dir),
            (vec![1, 2, 3, 4, 5], vec![(6, "unreadable".to_string())]),
            "in step order, once each"
        );
        records.push(
            journal_entries(dir)
                .iter()
                .filter(|e| e["kind"] == "evaluation")
                .map(|e| numbers(&e["record"]))
                .collect::<Vec<_>>(),
        );
        let status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
        statuses.push((status["fired"].clone(), status["best_step"].clone()));
        if !executor.is_empty() {
            let per_step = submissions(dir);
            assert_eq!(
                per_step,
                (1..=6).map(|s| (s, 1)).collect::<HashMap<i64, usize>>(),
                "one job per checkpoint"
            );
            assert_eq!(
                d.metric("diffmon_slurm_jobs_submitted_total{run=\"test\"}"),
                Some(6.0)
            );
            // Each job ran `diffmon eval` on its checkpoint and left its record.
            let folders = fs::read_dir(dir.join(".diffmon/jobs")).unwrap().count();
            assert_eq!(folders, 6);
        }
    }
    assert_same_records(&records[0], &records[1], "");
    assert_eq!(statuses[0], statuses[1], "the same early-stop decision");
    assert_eq!(statuses[0], (Value::Bool(true), Value::from(2)));
}

/// The ids of the cluster's jobs that are running.
fn running(cluster: &Cluster) -> Vec<String> {
    cluster
        .queue()
        .into_iter()
        .filter(|(_, state)| state == "RUNNING")
        .map(|(id, _)| id)
        .collect()
}

fn wait_running(cluster: &Cluster, d: &Daemon, n: usize) -> Vec<String> {
    d.wait_for(
        Duration::from_secs(120),
        &format!("{n} running job(s)"),
        |_| running(cluster).len() >= n,
    );
    running(cluster)
}

fn failed_jobs(d: &Daemon, reason: &str) -> f64 {
    d.metric(&format!(
        "diffmon_slurm_jobs_failed_total{{run=\"test\",reason=\"{reason}\"}}"
    ))
    .unwrap_or(-1.0)
}

/// The faults of a real cluster, one after the other on one daemon: a cancelled job (retried;
/// cancelled again, the checkpoint's failure), the daemon SIGKILLed with two jobs in flight
/// and restarted (they are adopted, not submitted again), `slurmd` stopped and restarted under
/// a running job, a job whose processes are killed (retried) and a job over its time limit
/// (retried). Nothing is lost, nothing evaluated
/// twice, each job failure is counted with its reason.
///
/// The jobs run `diffmon eval` through a wrapper that waits while a gate file exists: the
/// test holds a job running as long as it needs to.
#[test]
fn cancelled_timed_out_and_orphaned_jobs_lose_nothing_and_duplicate_nothing() {
    let Some(mut cluster) = Cluster::start() else {
        return;
    };
    let run = empty_run();
    let dir = run.path();
    let gate = cluster.dir.path().join("gate");
    let wrapper = cluster.dir.path().join("gated-diffmon");
    fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nwhile [ -e '{}' ]; do sleep 0.2; done\nexec '{}' \"$@\"\n",
            gate.display(),
            env!("CARGO_BIN_EXE_diffmon")
        ),
    )
    .unwrap();
    fs::set_permissions(&wrapper, fs::Permissions::from_mode(0o755)).unwrap();
    let port = free_port();
    let config = write_config(
        dir,
        port,
        &format!(
            "evaluation:\n  executor: slurm\n  max_in_flight: 2\n  retries: 1\n  slurm:\n    \
             poll_secs: 0.5\n    time_limit: \"1\"\n    binary: {}\n",
            wrapper.display()
        ),
    );
    let ckpt = toy_run().join("ckpt_000030.pt");
    let mut d = daemon(&cluster, config.clone(), port);

    // Step 1 runs alone (it computes what the others share).
    place(dir, &ckpt, 1);
    d.wait_for(Duration::from_secs(120), "step 1", |_| {
        journal(dir).0 == [1]
    });

    // A cancelled job is submitted again; cancelled again, it is the checkpoint's failure.
    fs::write(&gate, "").unwrap();
    place(dir, &ckpt, 2);
    let ids = wait_running(&cluster, &d, 1);
    assert!(cluster.command("scancel", &[&ids[0]]).status.success());
    d.wait_for(Duration::from_secs(60), "the cancellation to count", |d| {
        failed_jobs(d, "cancelled") == 1.0
    });
    d.wait_for(Duration::from_secs(60), "the retry to run", |_| {
        running(&cluster).iter().any(|id| *id != ids[0])
    });
    for id in running(&cluster) {
        cluster.command("scancel", &[&id]);
    }
    d.wait_for(Duration::from_secs(60), "step 2's failure", |_| {
        journal(dir).1.len() == 1
    });
    assert_eq!(journal(dir).1, vec![(2, "job_cancelled".to_string())]);
    // The counters follow the journal's line (not in the same instant).
    d.wait_for(Duration::from_secs(10), "the failure's counters", |d| {
        failed_jobs(d, "cancelled") == 2.0
            && d.metric("diffmon_checkpoint_failures_total{run=\"test\",reason=\"job_cancelled\"}")
                == Some(1.0)
    });

    // SIGKILL with two jobs in flight; the restarted daemon adopts them.
    place(dir, &ckpt, 3);
    place(dir, &ckpt, 4);
    wait_running(&cluster, &d, 2);
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let mut d = daemon(&cluster, config.clone(), port);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(running(&cluster).len(), 2, "the jobs outlive the daemon");
    fs::remove_file(&gate).unwrap();
    d.wait_for(Duration::from_secs(180), "steps 3 and 4", |_| {
        journal(dir).0 == [1, 3, 4]
    });
    assert!(d.log().contains("adopting the Slurm job"), "{}", d.log());
    // Taken together, steps 3 and 4 went as the two tasks of one array, adopted as such.
    let ids = diffmon::daemon::jobs::job_ids_per_step(&dir.join(".diffmon")).unwrap();
    let (three, four) = (&ids[&3], &ids[&4]);
    assert_eq!((three.len(), four.len()), (1, 1), "{ids:?}");
    let array = |id: &str| id.split_once('_').map(|x| x.0.to_string());
    assert!(array(&three[0]).is_some(), "{ids:?}");
    assert_eq!(array(&three[0]), array(&four[0]), "{ids:?}");

    // slurmd stopped and started again under a running job.
    fs::write(&gate, "").unwrap();
    place(dir, &ckpt, 5);
    wait_running(&cluster, &d, 1);
    cluster.stop_slurmd();
    std::thread::sleep(Duration::from_secs(3));
    cluster.start_slurmd();
    fs::remove_file(&gate).unwrap();
    d.wait_for(Duration::from_secs(180), "step 5", |_| {
        journal(dir).0 == [1, 3, 4, 5]
    });

    // A job whose processes are killed (an out-of-memory kill, say) failed; submitted again.
    fs::write(&gate, "").unwrap();
    place(dir, &ckpt, 6);
    let ids = wait_running(&cluster, &d, 1);
    // The job's processes as Slurm lists them, killed; again at each poll until the failure
    // counts, in case the first listing came before the job had started all of them.
    let kill_job = || {
        let pids = cluster.command("scontrol", &["listpids", &ids[0]]);
        let pids: Vec<i32> = String::from_utf8_lossy(&pids.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next()?.parse().ok())
            .collect();
        for &pid in &pids {
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        pids.len()
    };
    // Listed as running before slurmd has started its processes, on a loaded machine.
    let listed = std::time::Instant::now();
    while kill_job() == 0 {
        assert!(
            listed.elapsed() < Duration::from_secs(60),
            "no processes listed for job {} in 60 s",
            ids[0]
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    d.wait_for(Duration::from_secs(120), "the failed job to count", |d| {
        failed_jobs(d, "failed") == 1.0 || {
            kill_job();
            false
        }
    });
    fs::remove_file(&gate).unwrap();
    d.wait_for(Duration::from_secs(180), "step 6", |_| {
        journal(dir).0 == [1, 3, 4, 5, 6]
    });

    // A job over its time limit (1 minute) is submitted again.
    fs::write(&gate, "").unwrap();
    place(dir, &ckpt, 7);
    wait_running(&cluster, &d, 1);
    d.wait_for(Duration::from_secs(180), "the time-out to count", |d| {
        failed_jobs(d, "timeout") == 1.0
    });
    fs::remove_file(&gate).unwrap();
    d.wait_for(Duration::from_secs(180), "step 7", |_| {
        journal(dir).0 == [1, 3, 4, 5, 6, 7]
    });

    let per_step = submissions(dir);
    assert_eq!(
        per_step,
        HashMap::from([(1, 1), (2, 2), (3, 1), (4, 1), (5, 1), (6, 2), (7, 2)]),
        "retries only where a job ended without a result"
    );
    assert_eq!(journal(dir).1, vec![(2, "job_cancelled".to_string())]);
    assert_eq!(failed_jobs(&d, "timeout"), 1.0);
    assert_eq!(failed_jobs(&d, "lost"), 0.0);
    assert_eq!(failed_jobs(&d, "failed"), 1.0);
    d.terminate();
}

/// The sweep of `sweep_on_slurm`: runs `ra` (trained on `train.h5`) and `rb` (the same
/// checkpoints judged against swapped data: other numbers) under `at`, with `executor`.
fn write_sweep(at: &Path, port: u16, executor: &str) -> PathBuf {
    let ckpts = [30, 60, 30, 60].map(|s| toy_run().join(format!("ckpt_{s:06}.pt")));
    for name in ["ra", "rb"] {
        let dir = at.join(name);
        fs::create_dir_all(&dir).unwrap();
        for f in ["model.ts", "train.h5", "heldout.h5"] {
            fs::copy(toy_run().join(f), dir.join(f)).unwrap();
        }
        for (step, src) in (1..).zip(&ckpts) {
            place(&dir, src, step);
        }
    }
    let config = at.join("sweep.yaml");
    fs::write(
        &config,
        format!(
            "model: {{architecture: ra/model.ts}}\ndevice: cpu\n\
             data: {{path: ra/train.h5, heldout_path: ra/heldout.h5}}\n\
             icr: {{samples: 256, batch_size: 256}}\n\
             http: {{listen: \"127.0.0.1:{port}\"}}\n\
             checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n\
             runs:\n  - {{name: ra, dir: ra}}\n\
             \x20 - {{name: rb, dir: rb, data: {{path: rb/heldout.h5, heldout_path: rb/train.h5}}}}\n\
             {executor}"
        ),
    )
    .unwrap();
    config
}

/// Acceptance (#19): a sweep of two runs on the Slurm executor, sharing `max_in_flight`,
/// evaluates every checkpoint of each run exactly once, by jobs of that run (its journal, its
/// jobs folder, `diffmon eval --run`), and each run's records equal (1e-12 relative) those the
/// local executor gives for it; the runs' data differ, so a job evaluating the wrong run would
/// show. The checkpoints wait from the start: once a run's first job has filled its caches,
/// the next ones go as one job array (task ids `<id>_<index>`).
#[test]
fn a_sweep_on_slurm_evaluates_each_run_once_as_the_local_executor_would() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let (slurm, local) = (empty_run(), empty_run());
    let mut records = Vec::new();
    for (at, executor) in [
        (
            slurm.path(),
            "evaluation: {executor: slurm, max_in_flight: 4, slurm: {poll_secs: 0.5}}\n",
        ),
        (local.path(), ""),
    ] {
        let port = free_port();
        let config = write_sweep(at, port, executor);
        let mut array_tasks = 0;
        let d = daemon(&cluster, config, port);
        d.wait_for(Duration::from_secs(300), "four outcomes per run", |_| {
            ["ra", "rb"]
                .iter()
                .all(|r| journal_entries(&at.join(r)).len() >= 4)
        });
        let mut per_run: Vec<Vec<Numbers>> = Vec::new();
        for run in ["ra", "rb"] {
            let dir = at.join(run);
            assert_eq!(journal(&dir), (vec![1, 2, 3, 4], vec![]), "{run}");
            per_run.push(
                journal_entries(&dir)
                    .iter()
                    .map(|e| numbers(&e["record"]))
                    .collect::<Vec<_>>(),
            );
            if !executor.is_empty() {
                assert_eq!(
                    submissions(&dir),
                    (1..=4).map(|s| (s, 1)).collect::<HashMap<i64, usize>>(),
                    "{run}: one job per checkpoint, in the run's own journal"
                );
                assert_eq!(
                    d.metric(&format!(
                        "diffmon_slurm_jobs_submitted_total{{run=\"{run}\"}}"
                    )),
                    Some(4.0),
                    "{run}"
                );
                let ids = diffmon::daemon::jobs::job_ids_per_step(&dir.join(".diffmon")).unwrap();
                assert_eq!(ids[&1].len(), 1);
                assert!(
                    !ids[&1][0].contains('_'),
                    "the first job runs alone: {ids:?}"
                );
                array_tasks += ids.values().flatten().filter(|i| i.contains('_')).count();
                let scripts: Vec<String> = fs::read_dir(dir.join(".diffmon/jobs"))
                    .unwrap()
                    .map(|e| fs::read_to_string(e.unwrap().path().join("job.sh")).unwrap())
                    .collect();
                assert_eq!(scripts.len(), 4, "{run}");
                for s in scripts {
                    assert!(s.contains(&format!("--run '{run}'")), "{s}");
                }
            }
        }
        if !executor.is_empty() {
            assert!(array_tasks >= 2, "no job array was submitted");
        }
        records.push(per_run);
    }
    let (via_slurm, via_local) = (&records[0], &records[1]);
    for (run, (a_run, b_run)) in ["ra", "rb"].iter().zip(via_slurm.iter().zip(via_local)) {
        assert_same_records(a_run, b_run, run);
    }
    // The runs differ: each job evaluated its own run.
    assert_ne!(via_slurm[0], via_slurm[1]);
}

/// `runs_glob` on Slurm: a run folder moved into the watched folder while the daemon runs gets
/// its own runner in the pool, and its jobs find the run through the glob (`eval --run`).
#[test]
fn a_run_folder_that_appears_is_evaluated_through_slurm() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let at = empty_run();
    let at = at.path();
    let stage = at.join("stage");
    fs::create_dir_all(&stage).unwrap();
    fs::create_dir_all(at.join("sweep")).unwrap();
    for f in ["model.ts", "train.h5", "heldout.h5"] {
        fs::copy(toy_run().join(f), at.join(f)).unwrap();
    }
    for (step, s) in [(1, 30), (2, 60)] {
        place(&stage, &toy_run().join(format!("ckpt_{s:06}.pt")), step);
    }
    let port = free_port();
    let config = at.join("sweep.yaml");
    fs::write(
        &config,
        format!(
            "model: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\n\
             icr: {{samples: 256, batch_size: 256}}\n\
             http: {{listen: \"127.0.0.1:{port}\"}}\n\
             checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n\
             runs_glob: sweep/run-*\n\
             evaluation: {{executor: slurm, max_in_flight: 2, slurm: {{poll_secs: 0.5}}}}\n"
        ),
    )
    .unwrap();
    let d = daemon(&cluster, config, port);
    let run = at.join("sweep/run-1");
    fs::rename(&stage, &run).unwrap();
    d.wait_for(
        Duration::from_secs(240),
        "both checkpoints of run-1",
        |_| journal_entries(&run).len() >= 2,
    );
    assert_eq!(journal(&run), (vec![1, 2], vec![]));
    assert_eq!(submissions(&run), HashMap::from([(1, 1), (2, 1)]));
    for e in fs::read_dir(run.join(".diffmon/jobs")).unwrap() {
        let script = fs::read_to_string(e.unwrap().path().join("job.sh")).unwrap();
        assert!(script.contains("--run 'run-1'"), "{script}");
    }
    assert!(d.log().contains("a new run joins the sweep"), "{}", d.log());
}

/// The config of the user guide's sweep-on-Slurm example: the only `yaml` block of its section
/// (docs/guide/sweeps-and-slurm.md, "A sweep on Slurm, end to end").
fn guide_sweep_config() -> String {
    let page = fs::read_to_string(root().join("docs/guide/sweeps-and-slurm.md")).unwrap();
    let section = page
        .split("\n## A sweep on Slurm, end to end\n")
        .nth(1)
        .expect("the guide's section \"A sweep on Slurm, end to end\"");
    let section = section.split("\n## ").next().unwrap();
    let blocks: Vec<&str> = section
        .split("```yaml\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap())
        .collect();
    assert_eq!(
        blocks.len(),
        1,
        "the section has one yaml block, the config"
    );
    blocks[0].to_string()
}

/// The user guide's sweep on Slurm: its config, as written, passes `check-config` in a folder
/// laid out as the page says (`sweep/` holding the config, `model.ts`, `train.h5` and
/// `heldout.h5`, and a folder per run); then, on the test cluster, with the changes the page
/// gives for it (`partition: debug`, `device: cpu`, no `gres`) and a free port, every
/// checkpoint of both runs is evaluated once, by one job of its own run.
#[test]
fn the_sweep_example_of_the_guide_is_a_valid_config_and_runs_on_a_test_cluster() {
    let yaml = guide_sweep_config();
    let at = tempfile::tempdir().unwrap();
    let sweep = at.path().join("sweep");
    fs::create_dir(&sweep).unwrap();
    for f in ["model.ts", "train.h5", "heldout.h5"] {
        fs::copy(toy_run().join(f), sweep.join(f)).unwrap();
    }
    let runs = ["lr-1e-3", "lr-2e-3"];
    for (run, s) in runs.iter().zip([30, 60]) {
        let dir = sweep.join(run);
        fs::create_dir(&dir).unwrap();
        for step in [50, 100] {
            place(&dir, &toy_run().join(format!("ckpt_{s:06}.pt")), step);
        }
    }
    let config = sweep.join("diffmon.yaml");
    fs::write(&config, &yaml).unwrap();
    let out = diffmon(&["check-config", config.to_str().unwrap()]);
    assert!(out.status.success(), "{yaml}\n{}", stderr(&out));
    assert!(
        stdout(&out).contains("runs now: `lr-1e-3`, `lr-2e-3`"),
        "{}",
        stdout(&out)
    );

    let Some(cluster) = Cluster::start() else {
        return;
    };
    let port = free_port();
    let on_cluster: Vec<String> = yaml
        .lines()
        .filter(|l| !l.trim_start().starts_with("gres:"))
        .map(|l| {
            l.replace("partition: gpu", "partition: debug")
                .replace("device: cuda", "device: cpu")
        })
        .collect();
    let on_cluster = on_cluster.join("\n") + &format!("\nhttp: {{listen: \"127.0.0.1:{port}\"}}\n");
    assert!(
        on_cluster.contains("partition: debug")
            && on_cluster.contains("device: cpu")
            && !on_cluster.contains("gres"),
        "{on_cluster}"
    );
    fs::write(&config, &on_cluster).unwrap();
    let mut d = daemon(&cluster, config, port);
    d.wait_for(
        Duration::from_secs(300),
        "both checkpoints of both runs",
        |_| {
            runs.iter()
                .all(|r| journal_entries(&sweep.join(r)).len() >= 2)
        },
    );
    for run in runs {
        let dir = sweep.join(run);
        assert_eq!(journal(&dir), (vec![50, 100], vec![]), "{run}");
        assert_eq!(
            submissions(&dir),
            HashMap::from([(50, 1), (100, 1)]),
            "{run}: one job per checkpoint"
        );
        for e in fs::read_dir(dir.join(".diffmon/jobs")).unwrap() {
            let folder = e.unwrap().path();
            assert!(folder.join("record.json").is_file(), "{}", folder.display());
            let script = fs::read_to_string(folder.join("job.sh")).unwrap();
            assert!(script.contains(&format!("--run '{run}'")), "{script}");
        }
    }
    d.terminate();
}
