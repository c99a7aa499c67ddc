//! PostgreSQL, started from the installed server binaries: `initdb` once into
//! a temporary directory, then `postgres` in the foreground on a loopback
//! port.
//!
//! The binaries come from the newest `/usr/lib/postgresql/<version>/bin`
//! (Debian's layout), or from `PATH`. PostgreSQL refuses to run as root, so
//! when the tests run as root the data directory is given to the `postgres`
//! system user and the server runs as that user (set directly on the child,
//! so killing the child kills the server itself).
//!
//! Authentication: the superuser `postgres` (password `postgres`, carried in
//! the URL) is trusted on loopback TCP, so the suite's many short-lived
//! connections do not pay for SCRAM's key stretching (slow in debug builds);
//! every other role authenticates with SCRAM-SHA-256, which is what the
//! backend's password tests use (they create a role with a password).

use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{reap_when_process_exits, PidFile, ServerKind};

/// The superuser the harness creates.
pub const SUPERUSER: &str = "postgres";
/// The superuser's password.
pub const SUPERUSER_PASSWORD: &str = "postgres";

/// A PostgreSQL server (`initdb` + `postgres`), or the one named by
/// `DISTLOCK_POSTGRES_URL`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Postgres;

impl Postgres {
    /// The directory holding `initdb` and `postgres`: the newest
    /// `/usr/lib/postgresql/<version>/bin`, or `None` to use `PATH`.
    fn bin_dir() -> Option<PathBuf> {
        let entries = std::fs::read_dir("/usr/lib/postgresql").ok()?;
        entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let version: Vec<u32> = name
                    .split('.')
                    .map(|p| p.parse::<u32>())
                    .collect::<Result<_, _>>()
                    .ok()?;
                let bin = e.path().join("bin");
                (bin.join("initdb").is_file() && bin.join("postgres").is_file())
                    .then_some((version, bin))
            })
            .max()
            .map(|(_, bin)| bin)
    }

    pub(super) fn program(name: &str) -> PathBuf {
        match Self::bin_dir() {
            Some(dir) => dir.join(name),
            None => PathBuf::from(name),
        }
    }

    /// The unprivileged user to run as when we are root: `(uid, gid)`.
    fn run_as() -> io::Result<Option<(u32, u32)>> {
        // The owner of /proc/self is this process's effective user.
        let euid = std::fs::metadata("/proc/self")
            .map(|m| m.uid())
            .unwrap_or(1);
        if euid != 0 {
            return Ok(None);
        }
        let passwd = std::fs::read_to_string("/etc/passwd")?;
        for line in passwd.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() >= 4 && fields[0] == "postgres" {
                let uid = fields[2].parse().ok();
                let gid = fields[3].parse().ok();
                if let (Some(uid), Some(gid)) = (uid, gid) {
                    return Ok(Some((uid, gid)));
                }
            }
        }
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            "running as root, but there is no `postgres` system user to run PostgreSQL as; install the postgresql package (the README's test command does)",
        ))
    }

    pub(super) fn as_user(command: &mut Command) -> io::Result<()> {
        if let Some((uid, gid)) = Self::run_as()? {
            command.uid(uid).gid(gid).env("HOME", "/tmp");
        }
        Ok(())
    }

    pub(super) fn give(path: &Path, mode: u32) -> io::Result<()> {
        if let Some((uid, gid)) = Self::run_as()? {
            std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
    }
}

impl ServerKind for Postgres {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn url_env_var(&self) -> &'static str {
        "DISTLOCK_POSTGRES_URL"
    }

    fn prepare(&self, dir: &Path) -> io::Result<()> {
        Self::give(dir, 0o755)?;
        let pwfile = dir.join("pwfile");
        std::fs::write(&pwfile, format!("{SUPERUSER_PASSWORD}\n"))?;
        Self::give(&pwfile, 0o600)?;
        let program = Self::program("initdb");
        let mut command = Command::new(&program);
        command
            .arg("-D")
            .arg(dir.join("data"))
            .arg("-U")
            .arg(SUPERUSER)
            .arg(format!("--pwfile={}", pwfile.display()))
            .args([
                "-A",
                "scram-sha-256",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .current_dir(dir)
            .stdin(Stdio::null())
            .env("LC_ALL", "C");
        Self::as_user(&mut command)?;
        let output = command.output().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot run `{}`: {e}. Install the postgresql package (the README's test command does) or set DISTLOCK_POSTGRES_URL to an existing server",
                    program.display()
                ),
            )
        })?;
        if !output.status.success() {
            return Err(io::Error::other(format!(
                "`{}` failed ({}):\n{}{}",
                program.display(),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        // PostgreSQL does not exit when its parent dies.
        reap_when_process_exits(
            dir,
            Some(PidFile {
                path: "data/postmaster.pid",
                program: "postgres",
                graceful: Some("QUIT"),
            }),
        )?;
        // Replaces initdb's pg_hba.conf (the first matching line wins).
        std::fs::write(
            dir.join("data").join("pg_hba.conf"),
            format!(
                "local all all scram-sha-256\n\
                 host all {SUPERUSER} 127.0.0.1/32 trust\n\
                 host all all 127.0.0.1/32 scram-sha-256\n"
            ),
        )?;
        Ok(())
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        let mut command = Command::new(Self::program("postgres"));
        command
            .arg("-D")
            .arg(dir.join("data"))
            .arg("-p")
            .arg(port.to_string())
            .args(["-h", "127.0.0.1", "-k"])
            .arg(dir)
            // fsync and full-page writes off for speed: data still survives
            // a SIGKILL of the server (the OS keeps it), which is all the
            // fault cases do. synchronous_commit stays on, or commits of the
            // last moments before a kill would be lost.
            .args([
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=400",
                "-c",
                "shared_buffers=32MB",
            ])
            .current_dir(dir)
            .env("LC_ALL", "C");
        if let Err(e) = Self::as_user(&mut command) {
            // `command` cannot fail; make the spawn fail with the reason.
            tracing::error!("{e}");
            return Command::new(format!("/nonexistent/{e}"));
        }
        command
    }

    fn url(&self, addr: SocketAddr) -> String {
        format!("postgres://{SUPERUSER}:{SUPERUSER_PASSWORD}@{addr}/postgres")
    }

    fn wait_ready(&self, dir: &Path, port: u16) -> io::Result<()> {
        let _ = dir;
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut isready = Self::program("pg_isready");
        if !isready.is_file() {
            isready = PathBuf::from("pg_isready");
        }
        loop {
            let status = Command::new(&isready)
                .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-d", "postgres"])
                .args(["-U", SUPERUSER, "-t", "2"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            match status {
                Ok(s) if s.success() => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    // No pg_isready: the open port has to do.
                    return Ok(());
                }
                _ if Instant::now() >= deadline => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("postgres on port {port} did not accept connections in 60 s"),
                    ))
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}
