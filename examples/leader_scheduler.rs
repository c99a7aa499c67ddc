//! Leader election for a scheduler: three instances campaign for one key;
//! the leader runs the schedule (a tick every 200 ms), the others stand by.
//! The first leader crashes after a few ticks and another instance takes
//! over once its lease runs out (the TTL); the second leader resigns after
//! its ticks, and the third takes over at once. An observer prints who
//! leads as it changes, and the timeline at the end.
//!
//!     cargo run --example leader_scheduler
//!     cargo run --example leader_scheduler --features redis -- --url redis://127.0.0.1:6379
//!
//! The crash is simulated as a process crash looks from the server: each
//! instance runs on a Tokio runtime of its own, with its own client
//! (connection); the crashing leader forgets its leadership (so nothing
//! resigns) and its runtime is shut down, which ends its renewal task and
//! its connection. The lock server only sees renewals stop.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::{HolderId, LockKey, LockOptions, Locker};
use tokio::sync::{mpsc, watch};

const INSTANCES: [&str; 3] = ["instance-a", "instance-b", "instance-c"];
const KEY: &str = "leader-scheduler";
const TICK: Duration = Duration::from_millis(200);
/// How long a crashed leader's lease outlives it: the takeover delay.
const TTL: Duration = Duration::from_secs(2);
/// The first leader crashes after this many ticks; the second resigns
/// after this many of its own; the schedule ends at `LAST_TICK`.
const CRASH_AFTER: u32 = 5;
const RESIGN_AFTER: u32 = 5;
const LAST_TICK: u32 = 15;

/// One tick of the schedule: its number, who ran it, in which term.
#[derive(Debug, Clone)]
struct Tick {
    n: u32,
    by: &'static str,
    term: u64,
}

/// What the instances share: the schedule's state (as a real scheduler
/// would keep it in a database) and the script of this demo.
struct Shared {
    started: Instant,
    /// The last tick number run.
    ticks: AtomicU32,
    log: Mutex<Vec<Tick>>,
    /// Whether the crash (then the resign) happened.
    crashed: AtomicBool,
    resigned: AtomicBool,
}

impl Shared {
    fn at(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = url_from_args()?;
    println!("leader_scheduler: {} instances campaign for {KEY:?}, the leader ticks every {TICK:?}, TTL {TTL:?}, server {url}\n", INSTANCES.len());
    let key = LockKey::new(KEY)?;
    let shared = Arc::new(Shared {
        started: Instant::now(),
        ticks: AtomicU32::new(0),
        log: Mutex::new(Vec::new()),
        crashed: AtomicBool::new(false),
        resigned: AtomicBool::new(false),
    });

    // The observer: its own client; prints and records each change.
    let observer = Locker::new(distlock::connect(&url).await?);
    let timeline = Arc::new(Mutex::new(Vec::<(f64, String)>::new()));
    let (stop_observing, mut observing) = watch::channel(false);
    let watcher = tokio::spawn({
        let (shared, timeline, key) = (shared.clone(), timeline.clone(), key.clone());
        async move {
            let mut watch = observer
                .observe(&key)
                .with_poll_interval(Duration::from_millis(100));
            loop {
                let changed = tokio::select! {
                    changed = watch.changed() => changed,
                    _ = observing.changed() => return,
                };
                let seen = match changed {
                    Ok(Some(leader)) => format!(
                        "{} leads (term {})",
                        leader.identity.map_or("-".to_owned(), |id| id.to_string()),
                        leader.term
                    ),
                    Ok(None) => "vacant".to_owned(),
                    Err(e) => format!("error: {e}"),
                };
                let at = shared.at();
                println!("t={at:5.2}s  observer    {seen}");
                timeline.lock().unwrap().push((at, seen));
            }
        }
    });

    // The instances, each on a runtime of its own (as if a process).
    let (stop, _) = watch::channel(false);
    let (crashes, mut crashed) = mpsc::unbounded_channel::<usize>();
    let mut runtimes = Vec::new();
    let mut instances = Vec::new();
    for (index, name) in INSTANCES.into_iter().enumerate() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let locker = Locker::new(runtime.spawn(connect(url.clone())).await??);
        let task = runtime.spawn(instance(
            index,
            name,
            locker,
            key.clone(),
            shared.clone(),
            stop.subscribe(),
            crashes.clone(),
        ));
        runtimes.push(Some(runtime));
        instances.push(task);
    }

    // The crash: the leader has forgotten its leadership; its runtime goes,
    // with its renewal task and its connection.
    let crashed_index = crashed.recv().await.ok_or("no instance crashed")?;
    if let Some(runtime) = runtimes[crashed_index].take() {
        runtime.shutdown_background();
    }
    // The schedule ends at LAST_TICK (bounded, well within a minute).
    let deadline = Instant::now() + Duration::from_secs(60);
    while shared.ticks.load(Ordering::SeqCst) < LAST_TICK {
        if Instant::now() > deadline {
            return Err("the schedule stalled: nobody took over".into());
        }
        tokio::time::sleep(TICK / 4).await;
    }
    let _ = stop.send(true);
    for (index, task) in instances.into_iter().enumerate() {
        if index != crashed_index {
            task.await??;
        }
    }
    // Let the observer see the last leader resign.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = stop_observing.send(true);
    watcher.await?;
    for runtime in runtimes.into_iter().flatten() {
        runtime.shutdown_background();
    }

    let log = shared.log.lock().unwrap().clone();
    println!("\ntimeline (observer):");
    for (at, seen) in timeline.lock().unwrap().iter() {
        println!("  t={at:5.2}s  {seen}");
    }
    let terms_grow = log.windows(2).all(|w| w[1].term >= w[0].term);
    let mut leaders: Vec<(&str, u64)> = log.iter().map(|t| (t.by, t.term)).collect();
    leaders.dedup();
    let described: Vec<String> = leaders
        .iter()
        .map(|(by, term)| format!("{by} (term {term})"))
        .collect();
    println!(
        "\nsummary: {} ticks, leaders in turn: {}; terms {}",
        log.len(),
        described.join(" -> "),
        if terms_grow {
            "never went back"
        } else {
            "WENT BACK"
        }
    );
    let numbers_in_order = log.iter().zip(1..).all(|(tick, n)| tick.n == n);
    if !terms_grow || !numbers_in_order || leaders.len() < 3 {
        return Err("the schedule did not pass from leader to leader in order".into());
    }
    println!("every tick ran once, by the leader of its time.");
    Ok(())
}

/// `distlock::connect`, spawned on the instance's own runtime so its
/// connection lives (and dies) there.
async fn connect(url: String) -> Result<distlock::LockClient, distlock::LockError> {
    distlock::connect(&url).await
}

/// One instance: campaign, tick while leading, campaign again after a
/// resign; ends when `stop` says so.
async fn instance(
    index: usize,
    name: &'static str,
    locker: Locker,
    key: LockKey,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    crashes: mpsc::UnboundedSender<usize>,
) -> Result<(), distlock::LockError> {
    let identity = HolderId::new(name)?;
    let options = LockOptions::new(TTL);
    loop {
        let leadership = tokio::select! {
            leadership = locker.campaign(&key, &identity, &options) => leadership?,
            _ = stop.changed() => return Ok(()),
        };
        let term = leadership.term();
        println!("t={:5.2}s  {name}  LEADS   term {term}", shared.at());
        let mut mine = 0;
        let mut interval = tokio::time::interval(TICK);
        // The schedule, dropped the moment leadership is lost.
        let outcome = leadership
            .while_leading(async {
                loop {
                    tokio::select! {
                        _ = interval.tick() => {}
                        _ = stop.changed() => return "stop",
                    }
                    let n = shared.ticks.fetch_add(1, Ordering::SeqCst) + 1;
                    if n > LAST_TICK {
                        return "stop";
                    }
                    mine += 1;
                    println!(
                        "t={:5.2}s  {name}  tick {n} by {name} (term {term})",
                        shared.at()
                    );
                    shared.log.lock().unwrap().push(Tick {
                        n,
                        by: name,
                        term: term.get(),
                    });
                    if mine == CRASH_AFTER && !shared.crashed.swap(true, Ordering::SeqCst) {
                        return "crash";
                    }
                    if mine == RESIGN_AFTER
                        && shared.crashed.load(Ordering::SeqCst)
                        && !shared.resigned.swap(true, Ordering::SeqCst)
                    {
                        return "resign";
                    }
                }
            })
            .await;
        match outcome {
            Ok("crash") => {
                println!(
                    "t={:5.2}s  {name}  CRASH   stops renewing without resigning; the others wait out the TTL",
                    shared.at()
                );
                // No resign, no release: the server sees renewals stop.
                std::mem::forget(leadership);
                let _ = crashes.send(index);
                return std::future::pending().await;
            }
            Ok("resign") => {
                println!("t={:5.2}s  {name}  RESIGNS term {term}", shared.at());
                leadership.resign().await?;
                // Stand by again (the others are ahead in line).
            }
            Ok(_) => {
                leadership.resign().await?;
                return Ok(());
            }
            Err(reason) => {
                println!(
                    "t={:5.2}s  {name}  LOST    term {term}: {reason}",
                    shared.at()
                );
            }
        }
    }
}

fn url_from_args() -> Result<String, String> {
    let mut args = std::env::args().skip(1);
    let mut url = "memory://leader-scheduler".to_owned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--url" => url = args.next().ok_or("--url needs a value")?,
            "-h" | "--help" => {
                println!(
                    "usage: leader_scheduler [--url memory://|redis://...|etcd://...|postgres://...]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(url)
}
