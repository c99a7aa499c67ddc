//! Servers for the benchmark: started by the conformance harness on free
//! loopback ports (PostgreSQL with `pg_stat_statements` loaded, so it counts
//! its own statements), pinned to a CPU after start, and read for their own
//! command counters.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use distlock_conformance::server::{Etcd, Postgres, Redis, ServerKind, ServerProcess};

/// A backend under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis,
    Etcd,
    Postgres,
}

impl Backend {
    pub const ALL: [Backend; 4] = [
        Backend::Memory,
        Backend::Redis,
        Backend::Etcd,
        Backend::Postgres,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
            Backend::Etcd => "etcd",
            Backend::Postgres => "postgres",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.name() == name)
    }

    fn kind(self) -> Option<Arc<dyn ServerKind>> {
        match self {
            Backend::Memory => None,
            Backend::Redis => Some(Arc::new(Redis::default())),
            Backend::Etcd => Some(Arc::new(Etcd)),
            Backend::Postgres => Some(Arc::new(PostgresWithStatements)),
        }
    }
}

/// The harness's PostgreSQL with `pg_stat_statements` preloaded: the server
/// counts every statement it runs, so nothing has to wrap the library
/// client to count them. The extension costs each statement, the library's
/// and the raw baseline's alike, a few microseconds.
struct PostgresWithStatements;

impl ServerKind for PostgresWithStatements {
    fn name(&self) -> &'static str {
        Postgres.name()
    }

    fn url_env_var(&self) -> &'static str {
        Postgres.url_env_var()
    }

    fn prepare(&self, dir: &Path) -> std::io::Result<()> {
        Postgres.prepare(dir)
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        let mut command = Postgres.command(dir, port);
        command.args(["-c", "shared_preload_libraries=pg_stat_statements"]);
        command
    }

    fn url(&self, addr: SocketAddr) -> String {
        Postgres.url(addr)
    }

    fn wait_ready(&self, dir: &Path, port: u16) -> std::io::Result<()> {
        Postgres.wait_ready(dir, port)
    }
}

/// A started server (none for memory).
pub struct Server {
    pub backend: Backend,
    pub process: Option<ServerProcess>,
    pub url: String,
    /// How the server was pinned, for the header.
    pub pinning: String,
    /// The CPU it was pinned to, if pinned.
    pub cpu: Option<usize>,
    /// The process(es) listening on the server's port.
    pub pids: Vec<u32>,
}

impl Server {
    pub fn start(backend: Backend, server_cpu: Option<usize>) -> Result<Self, String> {
        let Some(kind) = backend.kind() else {
            return Ok(Self {
                backend,
                process: None,
                url: "memory://bench".to_owned(),
                pinning: "in-process".to_owned(),
                cpu: None,
                pids: Vec::new(),
            });
        };
        let process = ServerProcess::start(kind)
            .map_err(|e| format!("cannot start the {} server: {e}", backend.name()))?;
        let url = process.url();
        let pinning = match server_cpu {
            Some(cpu) => pin_server(process.dir(), process.port(), cpu),
            None => "not pinned (fewer than 2 CPUs)".to_owned(),
        };
        let pids = listener_pids(process.port());
        Ok(Self {
            backend,
            process: Some(process),
            url,
            pinning,
            cpu: server_cpu,
            pids,
        })
    }

    /// CPU time (ns) used so far by the server's processes and their live
    /// children (PostgreSQL backends).
    pub fn cpu_ns(&self) -> Option<u64> {
        if self.pids.is_empty() {
            return None;
        }
        let mut pids = self.pids.clone();
        for (pid, (ppid, _)) in list_procs() {
            if self.pids.contains(&ppid) {
                pids.push(pid);
            }
        }
        Some(pids.iter().map(|p| proc_cpu_ns(*p)).sum())
    }

    pub fn port(&self) -> Option<u16> {
        self.process.as_ref().map(ServerProcess::port)
    }
}

/// Pins every process of the server to `cpu`, all threads (`taskset -a
/// -cp`): the process listening on `port` (found through /proc/net/tcp and
/// the socket inodes in /proc/*/fd), any process naming its directory `dir`
/// on its command line, and their children (PostgreSQL's background
/// workers). Backends PostgreSQL forks later inherit the postmaster's mask.
fn pin_server(dir: &Path, port: u16, cpu: usize) -> String {
    let needle = dir.to_string_lossy().into_owned();
    let procs = list_procs();
    let mut pids = listener_pids(port);
    for (pid, (_, cmdline)) in &procs {
        if cmdline.contains(&needle) && *pid != std::process::id() && !pids.contains(pid) {
            pids.push(*pid);
        }
    }
    let roots = pids.clone();
    for (pid, (ppid, _)) in &procs {
        if roots.contains(ppid) && !pids.contains(pid) {
            pids.push(*pid);
        }
    }
    if pids.is_empty() {
        return "NOT pinned (server process not found)".to_owned();
    }
    let mut ok = 0;
    for pid in &pids {
        if taskset_all(*pid, cpu) {
            ok += 1;
        }
    }
    format!("{ok}/{} server processes pinned to CPU {cpu}", pids.len())
}

/// The processes holding a socket listening on 127.0.0.1:`port`.
fn listener_pids(port: u16) -> Vec<u32> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let local = format!("0100007F:{port:04X}");
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() > 9 && f[1] == local && f[3] == "0A").then(|| format!("socket:[{}]", f[9]))
        })
        .collect();
    let mut pids = Vec::new();
    if inodes.is_empty() {
        return pids;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .map(|l| inodes.iter().any(|i| l.as_os_str() == i.as_str()))
                .unwrap_or(false)
        });
        if holds && pid != std::process::id() {
            pids.push(pid);
        }
    }
    pids
}

/// pid -> (ppid, cmdline with spaces).
fn list_procs() -> BTreeMap<u32, (u32, String)> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // "pid (comm) state ppid ..."; comm may contain spaces.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        out.insert(pid, (ppid, cmdline));
    }
    out
}

/// `taskset -a -cp CPU PID`: every thread of `pid`.
pub fn taskset_all(pid: u32, cpu: usize) -> bool {
    Command::new("taskset")
        .args(["-a", "-cp", &cpu.to_string(), &pid.to_string()])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// CPU time in ns used by all live threads of process `pid` (sum of
/// /proc/PID/task/*/schedstat run times; precise, unlike utime/stime).
pub fn proc_cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// One CPU's time so far from `/proc/stat` (its `cpuN` line), in clock
/// ticks: (busy, total). Busy is user, nice, system, irq and softirq, so it
/// includes the kernel's work there (the network stack's receive path)
/// that no process's CPU time shows; total adds idle and iowait. Steal
/// (the hypervisor running something else) counts as neither, and guest
/// time is already in user.
pub fn cpu_ticks(cpu: usize) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let name = format!("cpu{cpu}");
    let line = stat
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&name))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let field = |i: usize| ticks.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal guest guest_nice
    let busy = field(0) + field(1) + field(2) + field(5) + field(6);
    Some((busy, busy + field(3) + field(4)))
}

/// The busy share of a CPU between two [`cpu_ticks`] readings.
pub fn busy_share(from: Option<(u64, u64)>, until: Option<(u64, u64)>) -> Option<f64> {
    let ((b0, t0), (b1, t1)) = from.zip(until)?;
    (t1 > t0).then(|| b1.saturating_sub(b0) as f64 / (t1 - t0) as f64)
}

/// `Cpus_allowed_list` of this process.
pub fn own_cpus() -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "?".to_owned())
}

/// VmRSS of this process in bytes.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|s| s.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// A plain HTTP/1.1 GET on 127.0.0.1:port; the body.
pub fn http_get(port: u16, path: &str) -> Result<String, String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| format!("GET {path}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("GET {path}: {e}"))?;
    let mut reply = Vec::new();
    stream
        .read_to_end(&mut reply)
        .map_err(|e| format!("GET {path}: {e}"))?;
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("GET {path}: no HTTP body"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!(
            "GET {path}: {}",
            head.lines().next().unwrap_or_default()
        ));
    }
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Ok(dechunk(body));
    }
    Ok(body.to_owned())
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

/// Parses `INFO commandstats` into command -> calls.
pub fn parse_commandstats(info: &str) -> BTreeMap<String, u64> {
    commandstats_field(info, "calls=")
}

/// Parses `INFO commandstats` into command -> `usec` (the server's time
/// running it; a script's includes the commands it ran).
pub fn parse_commandstats_usec(info: &str) -> BTreeMap<String, u64> {
    commandstats_field(info, "usec=")
}

/// One numeric field of each `cmdstat_<command>:` line.
fn commandstats_field(info: &str, field: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, fields)) = rest.split_once(':') else {
            continue;
        };
        let value = fields
            .split(',')
            .find_map(|f| f.strip_prefix(field))
            .and_then(|c| c.trim().parse().ok())
            .unwrap_or(0);
        out.insert(name.to_owned(), value);
    }
    out
}
