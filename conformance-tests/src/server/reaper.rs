//! Clean-up that outlives the test process: a small shell watchdog that
//! waits for this process to exit, then stops a server it left running and
//! removes its directory. Destructors are not enough: a server kept in a
//! `static` is never dropped, a test process may be killed, and
//! PostgreSQL and PgBouncer, unlike the other servers, do not exit when
//! their parent dies.

use std::io;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

/// A server process the watchdog stops, found by its pid file; it is
/// signalled only if that pid still runs a program of the expected name, so
/// a recycled pid is never hit.
#[derive(Debug, Clone, Copy)]
pub struct PidFile<'a> {
    /// The pid file, relative to the directory (the pid on its first line).
    pub path: &'a str,
    /// The program's name as in `/proc/<pid>/comm` (`postgres`).
    pub program: &'a str,
    /// The signal that asks for a clean stop (`QUIT`), SIGKILL two seconds
    /// later if the process still runs; `None`: SIGKILL at once.
    pub graceful: Option<&'a str>,
}

/// Once this process is gone, stops `server` (if given) and removes `dir`.
/// Does nothing for a path that cannot be quoted for the shell (one with a
/// `'`); destructors still clean up what they can.
pub fn reap_when_process_exits(dir: &Path, server: Option<PidFile<'_>>) -> io::Result<()> {
    let dir = dir.to_string_lossy();
    if dir.contains('\'') {
        return Ok(());
    }
    let mut script = format!(
        "while kill -0 {} 2>/dev/null; do sleep 1; done\n",
        std::process::id()
    );
    if let Some(PidFile {
        path,
        program,
        graceful,
    }) = server
    {
        let running = format!("[ \"$(cat /proc/$pid/comm 2>/dev/null)\" = {program} ]");
        let stop = match graceful {
            Some(signal) => format!(
                "kill -{signal} \"$pid\" 2>/dev/null\n sleep 2\n if {running}; then kill -KILL \"$pid\" 2>/dev/null; fi"
            ),
            None => "kill -KILL \"$pid\" 2>/dev/null".to_owned(),
        };
        script.push_str(&format!(
            "pid=$(head -n 1 '{dir}/{path}' 2>/dev/null)\n\
             if [ -n \"$pid\" ] && {running}; then\n {stop}\n fi\n"
        ));
    }
    script.push_str(&format!("rm -rf '{dir}'"));
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C to the test run must not stop it.
        .process_group(0)
        .spawn()
        .map(drop)
}
