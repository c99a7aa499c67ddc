//! distlock's metrics on a Prometheus scrape endpoint, with tracing logs.
//!
//!     cargo run --example metrics_exporter
//!     cargo run --example metrics_exporter -- --port 9187 --seconds 60
//!     DISTLOCK_METRICS_PORT=9187 cargo run --example metrics_exporter
//!     cargo run --example metrics_exporter --features redis -- --url redis://127.0.0.1:6379
//!
//! It installs the Prometheus exporter (HTTP on 127.0.0.1, port from
//! `--port`, else `DISTLOCK_METRICS_PORT`, else any free port, printed at
//! start), describes distlock's series, takes and releases a few locks (a
//! contended one, a renewed one, one lost to an operator's force-release, a
//! semaphore permit) and keeps one held while it serves, until Ctrl-C or
//! `--seconds` run out. Then: `curl http://127.0.0.1:PORT/metrics`.
//! `RUST_LOG=distlock_core=debug` shows the library's tracing events.

use std::error::Error;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use distlock::{LockGuard, LockKey, LockOptions, Locker, Renewal, RunOptions};
use metrics_exporter_prometheus::PrometheusBuilder;
use tracing_subscriber::EnvFilter;

/// What the example's functions fail with (`Send`, so a test can spawn it).
pub type BoxError = Box<dyn Error + Send + Sync>;

/// The environment variable with the port to serve on.
pub const PORT_VAR: &str = "DISTLOCK_METRICS_PORT";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let args = Args::parse()?;
    let seconds = args.seconds;
    let stop = async move {
        let deadline = async {
            match seconds {
                Some(s) => tokio::time::sleep(Duration::from_secs(s)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => println!("Ctrl-C: stopping"),
            () = deadline => println!("{} s are up: stopping", seconds.unwrap_or_default()),
        }
    };
    let ready = |addr: SocketAddr| {
        println!(
            "metrics on http://{addr}/metrics (locks at {}); Ctrl-C stops",
            args.url
        );
    };
    run(&args.url, args.port, ready, stop).await
}

/// The command line.
struct Args {
    url: String,
    port: u16,
    seconds: Option<u64>,
}

impl Args {
    fn parse() -> Result<Self, BoxError> {
        let port = match std::env::var(PORT_VAR) {
            Ok(port) => port
                .parse()
                .map_err(|e| format!("{PORT_VAR}={port:?}: {e}"))?,
            Err(_) => 0,
        };
        let mut parsed = Args {
            url: "memory://metrics-example".to_owned(),
            port,
            seconds: None,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = || args.next().ok_or(format!("{arg} needs a value"));
            match arg.as_str() {
                "--url" => parsed.url = value()?,
                "--port" => parsed.port = value()?.parse()?,
                "--seconds" => parsed.seconds = Some(value()?.parse()?),
                "-h" | "--help" => {
                    println!("usage: metrics_exporter [--url memory://|redis://...|etcd://...|postgres://...] [--port N] [--seconds N]");
                    std::process::exit(0);
                }
                other => return Err(format!("unknown argument {other:?}; try --help").into()),
            }
        }
        Ok(parsed)
    }
}

/// Serves the metrics on 127.0.0.1:`port` (0: any free port), takes some
/// locks at `url`, calls `ready` with the scrape address, and serves (one
/// lock held) until `stop` completes; then releases and returns.
pub async fn run(
    url: &str,
    port: u16,
    ready: impl FnOnce(SocketAddr),
    stop: impl Future<Output = ()>,
) -> Result<(), BoxError> {
    let addr = install_exporter(port)?;
    // After the recorder: descriptions sent before it are lost.
    distlock_core::describe_metrics();
    let locker = Locker::new(distlock::connect(url).await?);
    let held = take_locks(&locker).await?;
    ready(addr);
    stop.await;
    held.release().await?;
    // Background give-backs (a dropped guard's release) finish before exit.
    let _ = tokio::time::timeout(Duration::from_secs(5), locker.client().idle()).await;
    Ok(())
}

/// Installs the Prometheus recorder with its HTTP listener on 127.0.0.1.
fn install_exporter(port: u16) -> Result<SocketAddr, BoxError> {
    // The exporter binds inside `install` and does not say which port it
    // got, so port 0 is resolved here first (another process could take it
    // in between; `install` then fails, it does not serve elsewhere).
    let addr = TcpListener::bind((Ipv4Addr::LOCALHOST, port))?.local_addr()?;
    PrometheusBuilder::new()
        .with_http_listener(addr)
        // Unit and `_total` suffixes where a name lacks them: distlock's
        // names have theirs, so they are served as `names` spells them.
        .with_recommended_naming(true)
        .install()?;
    Ok(addr)
}

/// Exercises every series once; returns a guard to hold while serving.
async fn take_locks(locker: &Locker) -> Result<LockGuard, BoxError> {
    // One key space per run: a crashed earlier run's locks cannot block it.
    let key = |name: &str| LockKey::new(format!("metrics-example/{}/{name}", std::process::id()));
    let options = LockOptions::new(Duration::from_secs(10));

    // Three runs of a job; then a waiting acquire gives up on a held lock.
    let report = key("report")?;
    for _ in 0..3 {
        let run = RunOptions::new(options.clone());
        let outcome = locker.run_exclusive(&report, &run, |_| async {}).await?;
        tracing::info!(?outcome, "report job");
    }
    let holder = locker.try_lock(&report, &options).await?;
    let holder = holder.ok_or("the report lock is held by someone else")?;
    let waited = options.clone().with_wait(Duration::from_millis(200));
    if locker.acquire(&report, &waited).await?.is_none() {
        tracing::info!("report lock held, as expected: waited and gave up");
    }
    holder.release().await?;

    // A guard renewing every 50 ms, released after its first renewal.
    let renewing = options
        .clone()
        .with_renewal(Renewal::Every(Duration::from_millis(50)));
    let guard = locker.try_lock(&key("renewed")?, &renewing).await?;
    let guard = guard.ok_or("the renewed lock is held by someone else")?;
    let first = guard.lease();
    let give_up = Instant::now() + Duration::from_secs(5);
    while guard.lease() == first && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    guard.release().await?;

    // An operator deletes a held lock: the guard's next renewal is refused.
    let lost = locker.try_lock(&key("lost")?, &renewing).await?;
    let lost = lost.ok_or("the lost lock is held by someone else")?;
    match locker.client().force_release(&key("lost")?).await {
        Ok(_) => {
            let reason = tokio::time::timeout(Duration::from_secs(5), lost.lost()).await;
            tracing::info!(?reason, "guard lost its lock");
            if let Err(e) = lost.release().await {
                tracing::info!(error = %e, "releasing a lost lock fails, as expected");
            }
        }
        Err(e) => {
            tracing::info!(error = %e, "no force-release on this backend; releasing instead");
            lost.release().await?;
        }
    }

    // A permit of a semaphore of two, where the backend has semaphores.
    match locker
        .try_lock(&key("pool")?, &options.clone().with_permits(2))
        .await
    {
        Ok(Some(permit)) => permit.release().await?,
        Ok(None) => tracing::info!("both permits held elsewhere"),
        Err(e) => tracing::info!(error = %e, "no semaphores on this backend"),
    }

    let leader = locker.try_lock(&key("leader")?, &options).await?;
    Ok(leader.ok_or("the leader lock is held by someone else")?)
}
