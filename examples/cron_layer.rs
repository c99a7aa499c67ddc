//! The tower layer inside a real scheduler: two tokio-cron-scheduler
//! instances fire the same job every second; a `LockLayer` in front of the
//! job service makes sure only one run happens at a time.
//!
//!     cargo run --example cron_layer --features tower
//!     cargo run --example cron_layer --features tower,redis -- --url redis://127.0.0.1:6379

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::layer::{LockLayer, LockedResponse};
use distlock::{JobKey, LockOptions, Locker};
use tokio_cron_scheduler::{Job, JobScheduler};
use tower::{service_fn, ServiceBuilder, ServiceExt};

/// The job request: which report, for which day.
#[derive(Debug, Clone)]
struct Report {
    name: String,
    day: String,
}

const RUN_TAKES: Duration = Duration::from_millis(1500);
const RUN_FOR: Duration = Duration::from_secs(7);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let url = std::env::args()
        .skip_while(|a| a != "--url")
        .nth(1)
        .unwrap_or_else(|| "memory://cron".to_owned());
    println!("two schedulers, a job every second taking {RUN_TAKES:?}, lock at {url}\n");
    let started = Instant::now();
    let runs: Arc<Mutex<Vec<(Duration, Duration)>>> = Arc::default();

    let mut schedulers = Vec::new();
    for name in ["scheduler-A", "scheduler-B"].map(String::from) {
        let locker = Locker::new(distlock::connect(&url).await?);
        let runs = runs.clone();
        // The key comes from the request: job name plus its arguments.
        let service = ServiceBuilder::new()
            .layer(
                LockLayer::new(locker, |report: &Report| {
                    JobKey::new(report.name.as_str()).args(&report.day)?.key()
                })
                .options(LockOptions::new(Duration::from_secs(10))),
            )
            .service(service_fn(move |report: Report| {
                let runs = runs.clone();
                async move {
                    let start = started.elapsed();
                    tokio::time::sleep(RUN_TAKES).await;
                    let end = started.elapsed();
                    runs.lock().unwrap().push((start, end));
                    Ok::<_, std::convert::Infallible>(format!("{} for {}", report.name, report.day))
                }
            }));
        let scheduler = JobScheduler::new().await?;
        scheduler
            .add(Job::new_async("*/1 * * * * *", move |_id, _scheduler| {
                let service = service.clone();
                let name = name.clone();
                Box::pin(async move {
                    let request = Report {
                        name: "nightly-report".to_owned(),
                        day: "2026-11-30".to_owned(),
                    };
                    let at = started.elapsed().as_secs_f64();
                    match service.oneshot(request).await {
                        Ok(LockedResponse::Ran(what)) => println!("t={at:5.2}s {name}: ran {what}"),
                        Ok(LockedResponse::Skipped) => {
                            println!("t={at:5.2}s {name}: skipped, running elsewhere")
                        }
                        Err(e) => println!("t={at:5.2}s {name}: {e}"),
                    }
                })
            })?)
            .await?;
        scheduler.start().await?;
        schedulers.push(scheduler);
    }

    tokio::time::sleep(RUN_FOR).await;
    for mut scheduler in schedulers {
        scheduler.shutdown().await?;
    }
    tokio::time::sleep(RUN_TAKES).await; // let a last run finish

    let mut runs = runs.lock().unwrap().clone();
    runs.sort_by_key(|run| run.0);
    let overlaps = runs.windows(2).filter(|w| w[1].0 < w[0].1).count();
    println!("\nsummary: {} runs, {overlaps} overlapping", runs.len());
    if overlaps > 0 || runs.is_empty() {
        return Err("runs overlapped (or none ran)".into());
    }
    println!("no two runs overlapped.");
    Ok(())
}
