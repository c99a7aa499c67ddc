//! The redis server: `redis-server` on a loopback port, persistence off.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use super::ServerKind;

/// A `redis-server` started by the harness (Debian package `redis-server`),
/// listening on 127.0.0.1 only, with RDB snapshots and the AOF turned off
/// and its working directory in the harness's temp dir.
///
/// ```no_run
/// use std::sync::Arc;
/// use distlock_conformance::server::{Redis, ServerProcess};
/// let server = ServerProcess::start(Arc::new(Redis::with_password("s3cret")))?;
/// assert!(server.url().starts_with("redis://:s3cret@127.0.0.1:"));
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Redis {
    password: Option<String>,
}

impl Redis {
    /// A server that requires `password` (`--requirepass`); its
    /// [`url`](ServerKind::url) carries the password as `redis://:PASSWORD@…`.
    /// The password is put into the URL as given, so keep it URL-safe.
    pub fn with_password(password: impl Into<String>) -> Self {
        Self {
            password: Some(password.into()),
        }
    }

    /// The password the server requires, if any.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }
}

impl ServerKind for Redis {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn url_env_var(&self) -> &'static str {
        "DISTLOCK_REDIS_URL"
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        let mut command = Command::new("redis-server");
        command
            .arg("--port")
            .arg(port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--save")
            .arg("")
            .arg("--appendonly")
            .arg("no")
            .arg("--dir")
            .arg(dir);
        if let Some(password) = &self.password {
            command.arg("--requirepass").arg(password);
        }
        command
    }

    fn url(&self, addr: SocketAddr) -> String {
        match &self.password {
            Some(password) => format!("redis://:{password}@{addr}"),
            None => format!("redis://{addr}"),
        }
    }
}
