//! `--id`, `elect` and `observe`: holder labels on `run`, leadership runs
//! of a command, and the observer's lines. Local checks on memory://; the
//! cross-process scenarios run against each real server from
//! [`crate::servers`].

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use crate::support::{
    code, distlock, elect_sh, finish, process_gone, run_sh, signal, stderr, stdout, unique_name,
    wait_for_file, TempDir, HANG,
};

/// Whether the backend at `url` stores holder labels: until it does,
/// `status` and `observe` show none, and these tests check only the rest.
fn stores_labels(url: &str) -> bool {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        distlock::connect(url)
            .await
            .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
            .capabilities()
            .holder_ids
    })
}

/// A running `distlock observe`: its stdout lines as they come.
struct Observer {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Observer {
    fn start(url: &str, key: &str) -> Self {
        let mut child = distlock()
            .args(["observe", "--url", url, "--poll-interval", "100ms", key])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn observe");
        let out = child.stdout.take().expect("stdout");
        let (send, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits (hang guard [`HANG`]) for a line that `wanted` accepts; the
    /// lines before it are kept in `seen` too.
    fn wait_for(&mut self, what: &str, wanted: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + HANG;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if wanted(&line) {
                        return line;
                    }
                }
                Err(_) => panic!("observe never printed {what}; it printed {:?}", self.seen),
            }
        }
    }

    /// SIGINT: observe exits 0; its stderr.
    fn stop(self) -> String {
        signal(self.child.id(), libc::SIGINT);
        let output = finish(self.child);
        assert_eq!(
            code(&output),
            0,
            "observe after SIGINT: {}",
            stderr(&output)
        );
        stderr(&output)
    }
}

/// `term=N leader=ID`: N and ID.
fn leader_of(line: &str) -> Option<(u64, &str)> {
    let rest = line.strip_prefix("term=")?;
    let (term, leader) = rest.split_once(" leader=")?;
    Some((term.parse().ok()?, leader))
}

#[test]
fn bad_ids_are_refused() {
    let dir = TempDir::new("distlock-cli-id");
    for bad in ["", "two\nlines", &"x".repeat(129)] {
        type Sh = fn(&str, &str, &[&str], &std::path::Path, &str) -> std::process::Command;
        let commands: [(&str, Sh); 2] = [("run", run_sh), ("elect", elect_sh)];
        for (name, command) in commands {
            let output = command(
                "memory://",
                "k",
                &["--id", bad],
                dir.path(),
                r#"touch "$DIR/ran""#,
            )
            .output()
            .expect("run");
            let err = stderr(&output);
            assert_eq!(code(&output), 64, "{name} --id {bad:?}: {err}");
            assert!(err.starts_with("distlock: bad --id "), "{err}");
            assert_eq!(err.lines().count(), 1, "one line: {err}");
        }
    }
    assert!(!dir.file("ran").exists(), "no command ran");
}

#[test]
fn elect_runs_the_command_as_leader_and_passes_its_code() {
    let dir = TempDir::new("distlock-cli-elect");
    let output = elect_sh(
        "memory://",
        "leader",
        &["--id", "A"],
        dir.path(),
        r#"echo "$DISTLOCK_FENCING_TOKEN $DISTLOCK_KEY" > "$DIR/t"; exit 3"#,
    )
    .output()
    .expect("elect");
    assert_eq!(code(&output), 3, "{}", stderr(&output));
    assert_eq!(stderr(&output), "", "a leadership run is silent");
    let text = std::fs::read_to_string(dir.file("t")).expect("token file");
    assert_eq!(text.trim(), "1 leader", "term and key in the environment");
}

#[test]
fn observe_documents_its_lines_and_ends_cleanly() {
    let output = distlock()
        .args(["observe", "--help"])
        .output()
        .expect("help");
    let text = stdout(&output);
    assert!(text.contains("term=<N> leader=<ID>"), "{text}");
    assert!(text.contains("`vacant`"), "{text}");
    let output = distlock().args(["elect", "--help"]).output().expect("help");
    assert!(stdout(&output).contains("--kill-grace"), "run's flags");

    // Nothing leads in a fresh memory:// server; SIGINT ends observing.
    let mut observer = Observer::start("memory://", "k");
    observer.wait_for("vacant", |line| line == "vacant");
    assert_eq!(observer.stop(), "", "nothing on stderr");
    // SIGTERM too.
    let mut observer = Observer::start("memory://", "k");
    observer.wait_for("vacant", |line| line == "vacant");
    signal(observer.child.id(), libc::SIGTERM);
    let output = finish(observer.child);
    assert_eq!(code(&output), 0, "{}", stderr(&output));

    // A bad URL or key ends it with the usual codes.
    let output = distlock()
        .args(["observe", "--url", "zookeeper://127.0.0.1:1", "k"])
        .output()
        .expect("observe");
    assert_eq!(code(&output), 78, "{}", stderr(&output));
    let output = distlock()
        .args(["observe", "--url", "memory://", ""])
        .output()
        .expect("observe");
    assert_eq!(code(&output), 64, "{}", stderr(&output));
}

/// An observer sees leader A, A killed (SIGKILL of its distlock, which takes
/// its command along), then B in a later term, in that order; then B's
/// leadership force-released (B stops its command and exits 70) and the
/// vacancy.
pub fn observe_shows_a_killed_leader_replaced(url: &str) {
    let labels = stores_labels(url);
    let dir = TempDir::new("distlock-cli-observe");
    let key = unique_name("observed");
    let mut observer = Observer::start(url, &key);
    observer.wait_for("vacant (a new key)", |line| line == "vacant");

    let mut a = elect_sh(
        url,
        &key,
        &["--id", "A", "--ttl", "1s"],
        dir.path(),
        r#"echo $$ > "$DIR/a.pid"; touch "$DIR/a.started"; exec sleep 600"#,
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .expect("spawn A");
    let a_leader = if labels { "A" } else { "-" };
    let line = observer.wait_for("A's line", |line| {
        leader_of(line).is_some_and(|(_, leader)| leader == a_leader)
    });
    let (t1, _) = leader_of(&line).expect("parsed");
    // Not a.pid itself: it exists (empty) before the shell writes to it.
    wait_for_file(&dir.file("a.started"));
    a.kill().expect("SIGKILL A");
    a.wait().expect("reap A");
    // Its watchdog kills the command at once.
    let a_command: u32 = std::fs::read_to_string(dir.file("a.pid"))
        .expect("pid")
        .trim()
        .parse()
        .expect("pid");
    let deadline = Instant::now() + HANG;
    while !process_gone(a_command) {
        assert!(
            Instant::now() < deadline,
            "A's command outlived its distlock"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let b = elect_sh(
        url,
        &key,
        &["--id", "B", "--ttl", "1s"],
        dir.path(),
        r#"touch "$DIR/b"; exec sleep 600"#,
    )
    .stdout(Stdio::null())
    .spawn()
    .expect("spawn B");
    let b_leader = if labels { "B" } else { "-" };
    let line = observer.wait_for("B's line", |line| {
        leader_of(line).is_some_and(|(term, leader)| term > t1 && leader == b_leader)
    });
    let (t2, _) = leader_of(&line).expect("parsed");
    // In order: vacant, A in t1, then at most a vacancy before B in t2.
    let a_line = format!("term={t1} leader={a_leader}");
    let b_line = format!("term={t2} leader={b_leader}");
    let seen: Vec<&str> = observer.seen.iter().map(String::as_str).collect();
    assert!(
        seen == ["vacant", &a_line, &b_line] || seen == ["vacant", &a_line, "vacant", &b_line],
        "{seen:?}"
    );

    // B loses its leadership (forced release): its command is stopped as
    // `run`'s would be, it exits 70 saying why, and the observer sees the
    // vacancy.
    wait_for_file(&dir.file("b"));
    let output = distlock()
        .args(["release", "--force", "--url", url, &key])
        .output()
        .expect("release");
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let output = finish(b);
    assert_eq!(code(&output), 70, "{}", stderr(&output));
    let err = stderr(&output);
    assert!(
        err.lines().any(|line| line.starts_with(&format!(
            "distlock: lost leadership of {key:?} (term {t2}) while `sh -c"
        ))),
        "{err}"
    );
    observer.wait_for("vacant after B lost", |line| line == "vacant");
    let err = observer.stop();
    assert_eq!(err, "", "no errors while observing");
}

/// `status` shows the `--id` of a running `distlock run` (and by default
/// `<host>:<pid>` of that distlock), on backends that store labels.
pub fn status_shows_the_run_id(url: &str) {
    let labels = stores_labels(url);
    let dir = TempDir::new("distlock-cli-id");
    let key = unique_name("labelled");
    let script = r#"touch "$DIR/held"; while [ ! -e "$DIR/go" ]; do sleep 0.05; done"#;
    for id in [Some("job 7, host-a"), None] {
        let _ = std::fs::remove_file(dir.file("held"));
        let _ = std::fs::remove_file(dir.file("go"));
        let mut flags = vec!["--ttl", "5s"];
        if let Some(id) = id {
            flags.extend(["--id", id]);
        }
        let holder = run_sh(url, &key, &flags, dir.path(), script)
            .spawn()
            .expect("spawn");
        wait_for_file(&dir.file("held"));
        let expected = match id {
            Some(id) => id.to_owned(),
            None => {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_owned())
                    .unwrap_or_default();
                format!("{host}:{}", holder.id())
            }
        };
        let output = distlock()
            .args(["status", "--url", url, &key])
            .output()
            .expect("status");
        assert_eq!(code(&output), 75, "{}", stderr(&output));
        let text = stdout(&output);
        let output = distlock()
            .args(["status", "--json", "--url", url, &key])
            .output()
            .expect("status");
        let object: serde_json::Value =
            serde_json::from_str(stdout(&output).trim()).expect("one JSON object");
        if labels {
            assert!(text.contains(&format!("holder {expected:?}")), "{text}");
            assert_eq!(object["holder"], expected.as_str(), "{object}");
        } else {
            assert!(!text.contains("holder \""), "{text}");
            assert!(object["holder"].is_null(), "{object}");
        }
        std::fs::write(dir.file("go"), "").expect("go");
        let done = finish(holder);
        assert_eq!(code(&done), 0, "{}", stderr(&done));
    }
}
