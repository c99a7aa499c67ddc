//! Cross-process scenarios against real Redis, etcd and PostgreSQL servers
//! started by the conformance harness on 127.0.0.1 (a server that cannot
//! be started fails the test).

use std::process::Stdio;
use std::time::{Duration, Instant};

use distlock_conformance::server::ServerKind;

use crate::support::{
    code, distlock, finish, process_gone, read_token, run_sh, signal, start, stderr, stdout,
    unique_name, wait_for_file, TempDir, HANG,
};

fn against(kind: impl ServerKind) {
    let server = start(kind);
    let url = server.url();
    two_concurrent_runs_exactly_one_runs(&url);
    fencing_tokens_increase_across_processes(&url);
    status_reports_held_and_free(&url);
    sigkill_of_holder_frees_key_after_ttl(&url);
    lost_lock_kills_the_command(&url);
    paused_holder_is_taken_over_and_its_command_stopped(&url);
    suspended_holder_keeps_renewing(&url);
    ten_processes_share_three_permits(&url);
    crate::election::observe_shows_a_killed_leader_replaced(&url);
    crate::election::status_shows_the_run_id(&url);
    status_shows_the_permits_ids(&url);
    drop(server);
}

#[cfg(feature = "redis")]
#[test]
fn redis() {
    against(distlock_conformance::server::Redis::default());
}

#[cfg(feature = "etcd")]
#[test]
fn etcd() {
    against(distlock_conformance::server::Etcd);
}

#[cfg(feature = "postgres")]
#[test]
fn postgres() {
    against(distlock_conformance::server::Postgres);
}

fn two_concurrent_runs_exactly_one_runs(url: &str) {
    let dir = TempDir::new("distlock-cli-test");
    let key = unique_name("concurrent");
    let script = r#"touch "$DIR/ran.$$"; while [ ! -e "$DIR/go" ]; do sleep 0.05; done"#;
    let mut a = Some(
        run_sh(url, &key, &[], dir.path(), script)
            .spawn()
            .expect("spawn a"),
    );
    let mut b = Some(
        run_sh(url, &key, &[], dir.path(), script)
            .spawn()
            .expect("spawn b"),
    );
    // The loser exits on its own; the winner waits for `go`.
    let deadline = Instant::now() + HANG;
    let (loser, winner) = loop {
        assert!(Instant::now() < deadline, "neither run exited");
        if a.as_mut()
            .and_then(|c| c.try_wait().expect("try_wait"))
            .is_some()
        {
            break (a.take(), b.take());
        }
        if b.as_mut()
            .and_then(|c| c.try_wait().expect("try_wait"))
            .is_some()
        {
            break (b.take(), a.take());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let loser = finish(loser.expect("loser"));
    assert_eq!(code(&loser), 75, "{}", stderr(&loser));
    let err = stderr(&loser);
    assert!(err.contains("is held"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    std::fs::write(dir.file("go"), "").expect("go");
    let winner = finish(winner.expect("winner"));
    assert_eq!(code(&winner), 0, "{}", stderr(&winner));
    let ran = std::fs::read_dir(dir.path())
        .expect("read dir")
        .filter(|e| {
            e.as_ref()
                .map(|e| e.file_name().to_string_lossy().starts_with("ran."))
                .unwrap_or(false)
        })
        .count();
    assert_eq!(ran, 1, "exactly one command ran");

    // A custom conflict code.
    let holder = run_sh(
        url,
        &key,
        &[],
        dir.path(),
        r#"touch "$DIR/held"; while [ ! -e "$DIR/go2" ]; do sleep 0.05; done"#,
    )
    .spawn()
    .expect("spawn holder");
    wait_for_file(&dir.file("held"));
    let other = finish(
        run_sh(
            url,
            &key,
            &["--conflict-exit-code", "0"],
            dir.path(),
            "exit 3",
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&other), 0, "{}", stderr(&other));
    std::fs::write(dir.file("go2"), "").expect("go2");
    assert_eq!(code(&finish(holder)), 0);
}

fn fencing_tokens_increase_across_processes(url: &str) {
    let dir = TempDir::new("distlock-cli-test");
    let key = unique_name("fencing");
    let script = r#"echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/token"; exit 5"#;
    let first = finish(
        run_sh(url, &key, &[], dir.path(), script)
            .spawn()
            .expect("spawn"),
    );
    assert_eq!(code(&first), 5, "{}", stderr(&first));
    let t1 = read_token(&dir.file("token"));
    let second = finish(
        run_sh(url, &key, &[], dir.path(), script)
            .spawn()
            .expect("spawn"),
    );
    assert_eq!(code(&second), 5, "{}", stderr(&second));
    let t2 = read_token(&dir.file("token"));
    assert!(t2 > t1, "fencing token went from {t1} to {t2}");
    let died = finish(
        run_sh(url, &key, &[], dir.path(), "kill -TERM $$")
            .spawn()
            .expect("spawn"),
    );
    assert_eq!(code(&died), 128 + libc::SIGTERM, "{}", stderr(&died));
}

/// `status --json KEY` (or `inspect KEY`), parsed; checks the exit code
/// that goes with it (0 free, 75 held).
fn status_json(url: &str, key: &str, inspect: bool) -> serde_json::Map<String, serde_json::Value> {
    let mut command = distlock();
    if inspect {
        command.args(["inspect", "--url", url, key]);
    } else {
        command.args(["status", "--json", "--url", url, key]);
    }
    let output = command.output().expect("run");
    let text = stdout(&output);
    let object = match serde_json::from_str(text.trim_end()) {
        Ok(serde_json::Value::Object(object)) => object,
        other => panic!(
            "status --json printed {text:?} ({other:?}); {}",
            stderr(&output)
        ),
    };
    let held = object["held"].as_bool().expect("held is a boolean");
    assert_eq!(code(&output), if held { 75 } else { 0 }, "{text}");
    assert_eq!(object["key"], key, "{text}");
    assert!(object["backend"].is_string(), "{text}");
    assert_eq!(text.lines().count(), 1, "one line: {text}");
    object
}

fn status_reports_held_and_free(url: &str) {
    let dir = TempDir::new("distlock-cli-test");
    let key = unique_name("status");
    let output = distlock()
        .args(["status", "--url", url, &key])
        .output()
        .expect("run");
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(stdout(&output).contains("free"), "{}", stdout(&output));
    for inspect in [false, true] {
        let free = status_json(url, &key, inspect);
        assert_eq!(free["held"], false);
        assert!(free["fencing_token"].is_null(), "{free:?}");
        assert!(free["expires_in_ms"].is_null(), "{free:?}");
    }

    let holder = run_sh(
        url,
        &key,
        &["--ttl", "2s"],
        dir.path(),
        r#"echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/t"; touch "$DIR/held"; while [ ! -e "$DIR/go" ]; do sleep 0.05; done"#,
    )
    .spawn()
    .expect("spawn");
    wait_for_file(&dir.file("held"));
    let token = read_token(&dir.file("t"));
    let output = distlock()
        .args(["status", "--url", url, &key])
        .output()
        .expect("run");
    assert_eq!(code(&output), 75, "{}", stderr(&output));
    assert!(stdout(&output).contains("held"), "{}", stdout(&output));
    assert!(
        stdout(&output).contains(&format!("fencing token {token}")),
        "{}",
        stdout(&output)
    );
    for inspect in [false, true] {
        let held = status_json(url, &key, inspect);
        assert_eq!(held["held"], true, "{held:?}");
        assert_eq!(held["fencing_token"].as_u64(), Some(token), "{held:?}");
        // Time left by the server's clock: at most the 2 s TTL (renewal
        // may have moved it on), or unknown.
        let left = &held["expires_in_ms"];
        assert!(
            left.is_null() || left.as_u64().is_some_and(|ms| ms <= 2000),
            "{held:?}"
        );
    }
    let output = distlock()
        .args(["release", "--url", url, "--force", &key])
        .output()
        .expect("run");
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(stdout(&output).contains("released"), "{}", stdout(&output));
    // The holder learns at its next renewal: it stops its command and says
    // why.
    let held = finish(holder);
    assert_eq!(
        code(&held),
        70,
        "holder after a force release: {}",
        stderr(&held)
    );
    let refused = distlock::LostReason::Refused.to_string();
    assert!(
        stderr(&held)
            .lines()
            .any(|line| line.starts_with("distlock: lost lock") && line.contains(&refused)),
        "the lost line gives the reason ({refused}): {}",
        stderr(&held)
    );
    let output = distlock()
        .args(["status", "--url", url, &key])
        .output()
        .expect("run");
    assert_eq!(
        code(&output),
        0,
        "released after the command: {}",
        stdout(&output)
    );
}

fn sigkill_of_holder_frees_key_after_ttl(url: &str) {
    let dir = TempDir::new("distlock-cli-test");
    let key = unique_name("sigkill");
    let mut holder = run_sh(
        url,
        &key,
        &["--ttl", "1s"],
        dir.path(),
        r#"echo $$ > "$DIR/pid"; touch "$DIR/started"; exec sleep 60"#,
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .expect("spawn");
    wait_for_file(&dir.file("started"));
    let output = distlock()
        .args(["status", "--url", url, &key])
        .output()
        .expect("run");
    assert_eq!(
        code(&output),
        75,
        "held before the kill: {}",
        stdout(&output)
    );
    holder.kill().expect("SIGKILL the holder");
    holder.wait().expect("reap");
    // Its watchdog kills the orphaned command; nobody renews the lease.
    let pid: u32 = std::fs::read_to_string(dir.file("pid"))
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid");
    let deadline = Instant::now() + HANG;
    while !process_gone(pid) {
        assert!(
            Instant::now() < deadline,
            "the command outlived its killed distlock"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let next = finish(
        run_sh(
            url,
            &key,
            &["--wait", "60s"],
            dir.path(),
            r#"touch "$DIR/next""#,
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&next), 0, "{}", stderr(&next));
    assert!(dir.file("next").exists());
}

fn lost_lock_kills_the_command(url: &str) {
    let dir = TempDir::new("distlock-cli-test");
    let key = unique_name("lost");
    let output = finish(
        run_sh(
            url,
            &key,
            &["--ttl", "1s", "--max-hold", "1s", "--kill-grace", "200ms"],
            dir.path(),
            r#"trap '' TERM; touch "$DIR/started"; while :; do sleep 0.05; done"#,
        )
        .spawn()
        .expect("spawn"),
    );
    assert_eq!(code(&output), 70, "{}", stderr(&output));
    let err = stderr(&output);
    assert!(err.contains("lost lock"), "{err}");
    assert!(err.contains("SIGKILL"), "{err}");
    assert!(dir.file("started").exists());
}

/// The holder's command: its pid in `$DIR/a.pid`, its fencing token in
/// `$DIR/t1`, a line in `$DIR/a.log` every 50 ms until `$DIR/go` exists;
/// SIGTERM leaves `$DIR/terminated`.
const HOLDER: &str = r#"echo $$ > "$DIR/a.pid"; echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/t1"; trap 'touch "$DIR/terminated"; exit 1' TERM; while [ ! -e "$DIR/go" ]; do echo x >> "$DIR/a.log"; sleep 0.05; done"#;

/// The next holder's command: first of all, it records in `$DIR/overlap`
/// whether the holder's command still runs (its process exists and is not
/// a zombie), and how many lines the holder had logged; then its own
/// fencing token in `$DIR/t2`.
const NEXT: &str = r#"A=$(cat "$DIR/a.pid"); s=$(cat "/proc/$A/stat" 2>/dev/null); state=${s##*") "}; state=${state%% *}
case "$state" in ""|Z|X) ;; *) echo "the first command ($A) was still running (state $state)" > "$DIR/overlap" ;; esac
wc -l < "$DIR/a.log" > "$DIR/a.lines"
echo "$DISTLOCK_FENCING_TOKEN" > "$DIR/t2""#;

/// Checks what [`NEXT`] found: it ran with the holder's command dead, and
/// the holder logged nothing after that.
fn assert_no_overlap(dir: &TempDir) {
    if let Ok(overlap) = std::fs::read_to_string(dir.file("overlap")) {
        panic!("two holders: the next command started while {overlap}");
    }
    let seen: usize = std::fs::read_to_string(dir.file("a.lines"))
        .expect("the next command ran")
        .trim()
        .parse()
        .expect("a line count");
    let logged = std::fs::read_to_string(dir.file("a.log"))
        .expect("the holder's log")
        .lines()
        .count();
    assert_eq!(
        logged, seen,
        "the first command went on logging after the next one started"
    );
    assert!(read_token(&dir.file("t2")) > read_token(&dir.file("t1")));
}

/// SIGSTOP (which cannot be caught) freezes distlock, not its command: the
/// watchdog stops the command at the stop moment by itself, so the next
/// holder (who gets the key once the unrenewed lease expired) never runs
/// beside it.
fn paused_holder_is_taken_over_and_its_command_stopped(url: &str) {
    let dir = TempDir::new("distlock-cli-test");
    let key = unique_name("takeover");
    let holder = run_sh(url, &key, &["--ttl", "3s"], dir.path(), HOLDER)
        .spawn()
        .expect("spawn");
    wait_for_file(&dir.file("t1"));
    // A stopped distlock cannot renew: its lease runs out and another
    // process takes the key.
    signal(holder.id(), libc::SIGSTOP);
    let next = finish(
        run_sh(url, &key, &["--wait", "60s"], dir.path(), NEXT)
            .spawn()
            .expect("spawn"),
    );
    assert_eq!(code(&next), 0, "{}", stderr(&next));
    signal(holder.id(), libc::SIGCONT);
    // Resumed, the old holder finds its lease gone and says so.
    let output = finish(holder);
    assert_eq!(code(&output), 70, "{}", stderr(&output));
    assert!(stderr(&output).contains("lost lock"), "{}", stderr(&output));
    assert!(dir.file("terminated").exists(), "the command got SIGTERM");
    assert_no_overlap(&dir);
}

/// SIGTSTP (Ctrl-Z) does not stop distlock while its command runs (it
/// says so and keeps renewing); whatever happens, the next holder's
/// command never runs beside the first.
fn suspended_holder_keeps_renewing(url: &str) {
    use std::os::unix::process::CommandExt;
    let dir = TempDir::new("distlock-cli-test");
    let key = unique_name("suspend");
    // A group of its own, with its parent (this test) outside it: the
    // group is not orphaned, so the kernel does not discard SIGTSTP.
    let holder = run_sh(url, &key, &["--ttl", "3s"], dir.path(), HOLDER)
        .process_group(0)
        .spawn()
        .expect("spawn");
    wait_for_file(&dir.file("t1"));
    signal(holder.id(), libc::SIGTSTP);
    // Twice the TTL: had the holder stopped, its lease would be gone.
    let next = finish(
        run_sh(url, &key, &["--wait", "6s"], dir.path(), NEXT)
            .spawn()
            .expect("spawn"),
    );
    std::fs::write(dir.file("go"), "").expect("go");
    // In case it did stop.
    signal(holder.id(), libc::SIGCONT);
    let output = finish(holder);
    if let Ok(overlap) = std::fs::read_to_string(dir.file("overlap")) {
        panic!("two holders: the next command started while {overlap}");
    }
    match (code(&output), code(&next)) {
        // The holder kept its lock; the next run gave up.
        (0, 75) => assert!(!dir.file("t2").exists()),
        // The holder lost its lock anyway (a starved machine): its command
        // was stopped before the next one ran.
        (70, 0) => assert_no_overlap(&dir),
        (holder_code, next_code) => panic!(
            "holder exited {holder_code}: {}\nnext exited {next_code}: {}",
            stderr(&output),
            stderr(&next)
        ),
    }
    assert!(
        stderr(&output).contains("ignoring SIGTSTP"),
        "{}",
        stderr(&output)
    );
}

/// `--permits 3` on one key from 10 processes, 5 runs each: all 50 run
/// (each waits its turn), never more than 3 at once, and 3 at once is
/// reached. Each run marks itself present, counts who is present, and
/// stays 0.3 s.
fn ten_processes_share_three_permits(url: &str) {
    let dir = TempDir::new("distlock-cli-test");
    let key = unique_name("permits");
    let script = r#"touch "$DIR/in.$$"; ls "$DIR" | grep -c '^in\.' >> "$DIR/counts"; sleep 0.3; rm "$DIR/in.$$""#;
    let workers: Vec<_> = (0..10)
        .map(|worker| {
            let (url, key, dir) = (url.to_owned(), key.clone(), dir.path().to_owned());
            std::thread::spawn(move || {
                (0..5)
                    .map(|run| {
                        let output = finish(
                            run_sh(
                                &url,
                                &key,
                                &["--permits", "3", "--wait", "60s"],
                                &dir,
                                script,
                            )
                            .spawn()
                            .expect("spawn"),
                        );
                        (worker, run, code(&output), stderr(&output))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for worker in workers {
        for (worker, run, code, err) in worker.join().expect("worker thread") {
            assert_eq!(code, 0, "worker {worker} run {run}: {err}");
        }
    }
    let counts: Vec<u32> = std::fs::read_to_string(dir.file("counts"))
        .expect("counts")
        .lines()
        .map(|line| line.trim().parse().expect("a count"))
        .collect();
    assert_eq!(counts.len(), 50, "every run ran: {counts:?}");
    let most = counts.iter().copied().max().unwrap_or(0);
    assert!(most <= 3, "{most} runs at once under 3 permits: {counts:?}");
    assert_eq!(most, 3, "3 permits were never all in use: {counts:?}");
}

/// A value distlock did not write at the lock key: a configuration error
/// (78), not the lock-lost code (70); the value is left alone and the
/// command never runs.
#[cfg(feature = "redis")]
#[test]
fn foreign_data_at_the_key_is_a_configuration_error() {
    let server = crate::support::start_process(distlock_conformance::server::Redis::default());
    let addr = server.addr().to_string();
    let key = unique_name("foreign");
    let redis_key = format!("distlock:{{{key}}}:lock");
    crate::support::redis_command(&addr, &["SET", &redis_key, "someone else's value"]);
    let dir = TempDir::new("distlock-cli-test");
    let output = finish(
        run_sh(&server.url(), &key, &[], dir.path(), r#"touch "$DIR/ran""#)
            .spawn()
            .expect("spawn"),
    );
    assert_eq!(code(&output), 78, "{}", stderr(&output));
    assert!(!dir.file("ran").exists(), "the command never runs");
    assert_eq!(
        crate::support::redis_command(&addr, &["GET", &redis_key]),
        "someone else's value"
    );
}

/// `status --semaphore` lists the permits of running `distlock run
/// --permits` with their `--id` (by default `<host>:<pid>` of that
/// distlock), oldest first; exit 75 while all are held, 0 once one is
/// free.
fn status_shows_the_permits_ids(url: &str) {
    let key = unique_name("permit-ids");
    let script = r#"touch "$DIR/held"; while [ ! -e "$DIR/go" ]; do sleep 0.05; done"#;
    let (first_dir, second_dir) = (
        TempDir::new("distlock-cli-permit-a"),
        TempDir::new("distlock-cli-permit-b"),
    );
    let flags = ["--ttl", "5s", "--permits", "2"];
    let first = run_sh(
        url,
        &key,
        &[&flags[..], &["--id", "job 7, host-a"]].concat(),
        first_dir.path(),
        script,
    )
    .spawn()
    .expect("spawn");
    wait_for_file(&first_dir.file("held"));
    let second = run_sh(url, &key, &flags, second_dir.path(), script)
        .spawn()
        .expect("spawn");
    wait_for_file(&second_dir.file("held"));
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    let default_id = format!("{host}:{}", second.id());

    let output = distlock()
        .args(["status", "--semaphore", "--url", url, &key])
        .output()
        .expect("status");
    assert_eq!(code(&output), 75, "{}", stderr(&output));
    let text = stdout(&output);
    assert!(
        text.starts_with(&format!("{key}: semaphore, 2 of 2 permits held")),
        "{text}"
    );
    assert!(text.contains("holder \"job 7, host-a\""), "{text}");
    assert!(text.contains(&format!("holder {default_id:?}")), "{text}");
    let output = distlock()
        .args(["status", "--semaphore", "--json", "--url", url, &key])
        .output()
        .expect("status");
    let object: serde_json::Value =
        serde_json::from_str(stdout(&output).trim()).expect("one JSON object");
    assert_eq!(object["limit"], 2, "{object}");
    assert_eq!(object["permits"][0]["holder"], "job 7, host-a", "{object}");
    assert_eq!(
        object["permits"][1]["holder"],
        default_id.as_str(),
        "{object}"
    );

    std::fs::write(first_dir.file("go"), "").expect("go");
    let done = finish(first);
    assert_eq!(code(&done), 0, "{}", stderr(&done));
    let output = distlock()
        .args(["status", "--semaphore", "--json", "--url", url, &key])
        .output()
        .expect("status");
    assert_eq!(code(&output), 0, "a permit is free: {}", stderr(&output));
    let object: serde_json::Value =
        serde_json::from_str(stdout(&output).trim()).expect("one JSON object");
    assert_eq!(object["held"], 1, "{object}");
    assert_eq!(
        object["permits"][0]["holder"],
        default_id.as_str(),
        "{object}"
    );
    std::fs::write(second_dir.file("go"), "").expect("go");
    let done = finish(second);
    assert_eq!(code(&done), 0, "{}", stderr(&done));
}
