//! `distlock run --wait` against a 3-member etcd cluster whose leader is
//! SIGKILLed mid-run: every run completes, none overlaps.

use std::sync::Arc;
use std::time::Duration;

use distlock_conformance::server::EtcdCluster;

use crate::support::{code, run_sh, run_to_end, stderr, unique_name, TempDir};

/// Processes, each running the job this many times in a row.
const PROCESSES: usize = 6;
const RUNS_EACH: usize = 10;

/// The job: takes a directory nobody else may hold (an overlap fails it),
/// appends its fencing token to a log, works a little, leaves.
const JOB: &str = r#"mkdir "$DIR/inside" 2>/dev/null || { echo "overlap: another run is inside" >&2; exit 99; }
echo "$DISTLOCK_FENCING_TOKEN" >> "$DIR/tokens"
sleep 0.1
rmdir "$DIR/inside""#;

/// 6 processes x 10 `distlock run --wait 60s` on one key, the leader
/// SIGKILLed 3 s in and restarted 4 s later: waits ride through the
/// election (a run that got Unavailable exited 69 before the fix), and the
/// tokens logged in run order strictly grow.
#[test]
fn waits_ride_through_a_leader_kill() {
    let cluster = Arc::new(EtcdCluster::start(3).expect("a 3-member etcd cluster"));
    let url = cluster.url();
    let dir = Arc::new(TempDir::new("distlock-etcd-cluster"));
    let key = unique_name("failover");
    let runners: Vec<_> = (0..PROCESSES)
        .map(|_| {
            let (url, key, dir) = (url.clone(), key.clone(), dir.clone());
            std::thread::spawn(move || {
                (0..RUNS_EACH)
                    .map(|_| run_to_end(run_sh(&url, &key, &["--wait", "60s"], dir.path(), JOB)))
                    .collect::<Vec<_>>()
            })
        })
        .collect();

    std::thread::sleep(Duration::from_secs(3));
    let leader = cluster.wait_for_leader().expect("a leader");
    cluster.member(leader).kill();
    std::thread::sleep(Duration::from_secs(4));
    cluster
        .member(leader)
        .restart()
        .expect("the old leader restarts");

    let mut failures = Vec::new();
    for runner in runners {
        for output in runner.join().expect("runner thread") {
            if code(&output) != 0 {
                failures.push(format!("exit {}: {}", code(&output), stderr(&output)));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} runs failed: {failures:#?}",
        failures.len(),
        PROCESSES * RUNS_EACH
    );
    let log = std::fs::read_to_string(dir.path().join("tokens")).expect("token log");
    let tokens: Vec<u64> = log
        .lines()
        .map(|line| line.parse().expect("a fencing token"))
        .collect();
    assert_eq!(tokens.len(), PROCESSES * RUNS_EACH, "every run ran once");
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "fencing tokens grow in run order: {tokens:?}"
    );
}
