//! The problem distlock exists for: a scheduler fires a job every second on
//! four workers; a run takes 2.5 s; no two runs may overlap.
//!
//!     cargo run --example nightly_report
//!     cargo run --example nightly_report --features redis -- --url redis://127.0.0.1:6379
//!
//! Two copies started at once against the same server share the lock.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use distlock::{Fire, Locker, ScheduledJob, ScheduledOutcome, SkipReason};

const WORKERS: usize = 4;
const TICKS: u32 = 10;
const TICK: Duration = Duration::from_secs(1);
const REPORT_TAKES: Duration = Duration::from_millis(2500);

/// One finished run: when it started and ended (since program start) and
/// its fencing token.
#[derive(Debug, Clone, Copy)]
struct Run {
    start: Duration,
    end: Duration,
    token: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = url_from_args()?;
    println!("nightly_report: {WORKERS} workers, a tick every {TICK:?} for {TICKS} ticks, each run takes {REPORT_TAKES:?}, lock at {url}\n");
    let job = ScheduledJob::new("nightly-report", TICK)?.with_ttl(Duration::from_secs(3));
    let started = Instant::now();
    let runs = Arc::new(Mutex::new(Vec::<Run>::new()));
    let (ticker, _) = tokio::sync::broadcast::channel::<(u32, SystemTime)>(TICKS as usize);

    let mut workers = Vec::new();
    for worker in 1..=WORKERS {
        let locker = Locker::new(distlock::connect(&url).await?);
        let mut ticks = ticker.subscribe();
        let job = job.clone();
        let runs = runs.clone();
        workers.push(tokio::spawn(async move {
            let mut running = Vec::new();
            while let Ok((tick, fire_time)) = ticks.recv().await {
                let (locker, job, runs) = (locker.clone(), job.clone(), runs.clone());
                // A worker keeps receiving ticks while its report runs.
                running.push(tokio::spawn(async move {
                    let outcome = job
                        .run(&locker, Fire::At(fire_time), |ctx| async move {
                            let start = started.elapsed();
                            tokio::time::sleep(REPORT_TAKES).await;
                            Run { start, end: started.elapsed(), token: ctx.fencing_token.get() }
                        })
                        .await;
                    let at = started.elapsed().as_secs_f64();
                    match outcome {
                        Ok(ScheduledOutcome::Ran { output, .. }) => {
                            println!("t={at:5.2}s tick {tick:2}  worker-{worker}  RAN   report {:.2}s..{:.2}s, fencing token {}", output.start.as_secs_f64(), output.end.as_secs_f64(), output.token);
                            runs.lock().unwrap().push(output);
                        }
                        Ok(ScheduledOutcome::Skipped(SkipReason::FireAlreadyTaken)) => {
                            println!("t={at:5.2}s tick {tick:2}  worker-{worker}  skip  another worker took this tick")
                        }
                        Ok(ScheduledOutcome::Skipped(SkipReason::PreviousStillRunning)) => {
                            println!("t={at:5.2}s tick {tick:2}  worker-{worker}  skip  previous report still running")
                        }
                        Ok(ScheduledOutcome::Lost { reason, .. }) => {
                            println!("t={at:5.2}s tick {tick:2}  worker-{worker}  LOST  {reason}")
                        }
                        Err(e) => println!("t={at:5.2}s tick {tick:2}  worker-{worker}  error {e}"),
                    }
                }));
            }
            for run in running {
                let _ = run.await;
            }
        }));
    }

    let mut interval = tokio::time::interval(TICK);
    for tick in 1..=TICKS {
        interval.tick().await;
        let _ = ticker.send((tick, SystemTime::now()));
    }
    drop(ticker);
    for worker in workers {
        worker.await?;
    }

    let mut runs = runs.lock().unwrap().clone();
    runs.sort_by_key(|r| r.start);
    let overlaps = runs.windows(2).filter(|w| w[1].start < w[0].end).count();
    let tokens_grow = runs.windows(2).all(|w| w[1].token > w[0].token);
    let tokens: Vec<String> = runs.iter().map(|r| r.token.to_string()).collect();
    println!(
        "\nsummary: {TICKS} ticks x {WORKERS} workers, {} reports ran, {} overlapping, fencing tokens {} ({})",
        runs.len(),
        overlaps,
        tokens.join(" < "),
        if tokens_grow { "strictly increasing" } else { "NOT increasing" }
    );
    if overlaps > 0 || !tokens_grow || runs.is_empty() {
        return Err("two reports overlapped or tokens did not grow".into());
    }
    println!("no two reports overlapped.");
    Ok(())
}

fn url_from_args() -> Result<String, String> {
    let mut args = std::env::args().skip(1);
    let mut url = "memory://nightly".to_owned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--url" => url = args.next().ok_or("--url needs a value")?,
            "-h" | "--help" => {
                println!(
                    "usage: nightly_report [--url memory://|redis://...|etcd://...|postgres://...]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(url)
}
