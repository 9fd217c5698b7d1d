//! The Slurm executor (`evaluation.executor: slurm`) on a real single-node cluster
//! ([`crate::slurm_cluster`]): records equal to the local executor's, exactly once, in order,
//! and the faults of a real cluster (a cancelled job, a job over its time limit, `slurmd`
//! stopped and restarted, the daemon killed with jobs in flight).

use crate::slurm_cluster::Cluster;
use std::fs;
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
