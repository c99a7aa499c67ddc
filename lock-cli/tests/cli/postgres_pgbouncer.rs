//! The real `distlock` binary through PgBouncer in transaction mode: many
//! processes waiting on one key, as cron on several hosts.

use distlock_conformance::server::{PoolMode, PooledPostgres};

use crate::support::{distlock, run_to_end, start_process, stderr, TempDir};

/// 6 "hosts" (threads) each run `distlock run --wait 60s` 10 times on one
/// key through PgBouncer in transaction mode (fewer server connections
/// than clients): two are woken by NOTIFY on `listen_url`, two poll with
/// `pool_mode=transaction`, and two use the plain URL a newcomer types
/// (neither parameter: the client must find the pooler itself, never
/// half-work with prepared statements it cannot keep). Every run must
/// complete, and no two commands may overlap.
#[test]
fn many_processes_wait_on_one_key_through_pgbouncer() {
    const HOSTS: usize = 6;
    const RUNS: usize = 10;
    let pooler = start_process(PooledPostgres::new(PoolMode::Transaction).pool_size(3));
    let with_listen = pooler.url();
    let (polling, _) = with_listen
        .split_once("&listen_url=")
        .expect("the pooled URL names listen_url");
    let polling = polling.to_owned();
    let plain = polling.replace("pool_mode=transaction", "");
    let plain = plain.trim_end_matches(['?', '&']).replace("?&", "?");
    assert!(!plain.contains("pool_mode"), "{plain}");
    let dir = TempDir::new("distlock-cli-pgbouncer");
    let log = dir.path().join("log");
    // Each section writes "start TOKEN" and "end TOKEN" around a pause.
    let script = r#"echo "start $DISTLOCK_FENCING_TOKEN" >> "$LOG"; sleep 0.05; echo "end $DISTLOCK_FENCING_TOKEN" >> "$LOG""#;
    std::thread::scope(|scope| {
        for host in 0..HOSTS {
            let url = match host % 3 {
                0 => &with_listen,
                1 => &polling,
                _ => &plain,
            };
            let log = &log;
            scope.spawn(move || {
                for run in 0..RUNS {
                    let mut command = distlock();
                    command
                        .args(["run", "--url", url, "--key", "pooled-job", "--wait", "60s"])
                        .args(["--ttl", "10s", "--", "sh", "-c", script])
                        .env("LOG", log);
                    let output = run_to_end(command);
                    assert_eq!(
                        output.status.code(),
                        Some(0),
                        "host {host} run {run}: {}",
                        stderr(&output)
                    );
                }
            });
        }
    });
    let text = std::fs::read_to_string(&log).expect("the log");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2 * HOSTS * RUNS, "{text}");
    let mut last = 0u64;
    for pair in lines.chunks(2) {
        let start = pair[0]
            .strip_prefix("start ")
            .unwrap_or_else(|| panic!("overlap: {pair:?}"));
        let end = pair[1]
            .strip_prefix("end ")
            .unwrap_or_else(|| panic!("overlap: {pair:?}"));
        assert_eq!(start, end, "overlap: {pair:?}");
        let token: u64 = start.parse().expect("a fencing token");
        assert!(
            token > last,
            "fencing tokens must grow: {last} then {token}"
        );
        last = token;
    }
}
