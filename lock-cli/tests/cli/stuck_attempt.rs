//! A signal ends `distlock run` promptly even while it is stuck connecting
//! or in an attempt on the server, and gives back what the attempt took.

use std::time::Instant;

use distlock_conformance::server::Redis;

use crate::support::{
    code, distlock, finish, redis_command, run_sh, signal, start_process, stderr, stdout,
    unique_name, TempDir, HANG,
};

/// With `min_replicas=1` and no replica, every acquire runs its script and
/// then blocks in `WAIT` for half the operation timeout (30 min here, far
/// beyond the hang guard): only the signal can end it. distlock exits
/// 128+SIGTERM, never runs the command, and the lock the script wrote is
/// released (a 10 min TTL cannot run out during the test).
#[test]
fn sigterm_ends_an_attempt_stuck_waiting_for_a_replica() {
    let server = start_process(Redis::default());
    let addr = server.addr().to_string();
    let stuck = format!("redis://{addr}/?min_replicas=1&operation_timeout_ms=3600000");
    let dir = TempDir::new("distlock-cli-stuck");
    let key = unique_name("stuck");
    let child = run_sh(
        &stuck,
        &key,
        &["--ttl", "10m", "--wait", "1h"],
        dir.path(),
        r#"touch "$DIR/ran""#,
    )
    .spawn()
    .expect("spawn");
    // The attempt is in flight once its connection is blocked in WAIT
    // (after the acquire script wrote the lock).
    let deadline = Instant::now() + HANG;
    while !redis_command(&addr, &["CLIENT", "LIST"]).contains(" cmd=wait ") {
        assert!(Instant::now() < deadline, "the acquire never reached WAIT");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    signal(child.id(), libc::SIGTERM);
    let output = finish(child);
    assert_eq!(code(&output), 128 + libc::SIGTERM, "{}", stderr(&output));
    assert!(!dir.file("ran").exists(), "the command never runs");
    let status = distlock()
        .args(["status", "--url", &format!("redis://{addr}"), &key])
        .output()
        .expect("run");
    assert_eq!(
        code(&status),
        0,
        "the lock the stuck attempt took is given back: {}{}",
        stdout(&status),
        stderr(&status)
    );
}

/// A server that accepts the connection and never answers: the first
/// connection would wait out its connect timeout (10 min here, beyond the
/// hang guard). SIGTERM ends it at once with 128+SIGTERM.
#[test]
fn sigterm_ends_a_connect_to_a_server_that_never_answers() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    let url = format!("redis://{addr}/?connect_timeout_ms=600000&operation_timeout_ms=600000");
    let dir = TempDir::new("distlock-cli-stuck");
    let child = run_sh(&url, "k", &[], dir.path(), r#"touch "$DIR/ran""#)
        .spawn()
        .expect("spawn");
    // distlock is connecting once the connection arrives (its signal
    // handlers are installed before).
    let (connection, _) = listener.accept().expect("accept");
    signal(child.id(), libc::SIGTERM);
    let output = finish(child);
    drop(connection);
    assert_eq!(code(&output), 128 + libc::SIGTERM, "{}", stderr(&output));
    assert!(!dir.file("ran").exists(), "the command never runs");
}
