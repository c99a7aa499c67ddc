//! Handoff: W waiters and one holder cycle through one key (a lock, then
//! the one permit of a semaphore of 1, and, at W = 1, a lock whose guard
//! does not renew it and a leadership: a standby campaigning while the
//! leader resigns), with the default options otherwise; how long from a release
//! (resign) returning to the next holder's acquire (campaign) returning,
//! and how much work each handoff costs the server and the clients.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::{
    HolderId, Leadership, LockClient, LockGuard, LockKey, LockOptions, Locker, Renewal,
};
use distlock_conformance::fault::Link;
use serde_json::json;
use tokio::sync::{mpsc, oneshot, watch};

use crate::baseline::Baseline;
use crate::plan::{warmup_handoffs, BenchResult, Plan, TTL};
use crate::probe::{self, Calls, Probe, ServerCount};
use crate::raw::Raw;
use crate::raw_handoff;
use crate::report::{round1, Row, Samples};
use crate::servers::{Backend, Server};

/// A call through the counting link that has not answered in this long
/// fails the run (each is one request; waiting happens between calls).
const LINK_TIMEOUT: Duration = Duration::from_secs(30);

/// The handoff rows for every W of the plan. `clients` are independent
/// clients (own connections), at least `max W + 1` of them.
///
/// Each W runs twice: once timed, the clients bare and the server counting
/// its own work (read while a holder holds the lock, between handoffs);
/// once untimed, the same clients behind one counting [`Link`], for the
/// client-side calls per handoff (and the server work of a backend whose
/// server cannot count it).
pub async fn rows(
    plan: &Plan,
    server: &Server,
    clients: &[LockClient],
    ping_p50: Option<f64>,
) -> BenchResult<Vec<Row>> {
    let backend = server.backend;
    let mut probe = Probe::new(backend, &server.url, server.port().unwrap_or(0)).await?;
    let mut rows = Vec::new();
    // The floor every W is compared with: the driver's own wake-up and
    // acquire write (one waiter; the server tells one waiter at any W).
    let raw = raw_handoff::samples(plan, server).await?;
    if let Some(raw) = &raw {
        let mut row = Row::new(backend, "raw_handoff", "W=1");
        row.p50_us = raw.pct(0.5);
        row.p99_us = raw.pct(0.99);
        row.round_trips = ping_p50.zip(row.p50_us).map(|(p, l)| l / p);
        row.note = Some(format!(
            "{} handoffs through the raw driver: the release tells the one waiter, which sends the acquire write alone; hold {:?}",
            raw.us.len(),
            plan.hold
        ));
        rows.push(row);
    }
    let raw_p50 = raw.as_ref().and_then(|r| r.pct(0.5));
    // Target 3's floor (the raw write and a round trip), a round before
    // the first W and one after each, so that it sees the same machine.
    let mut floor = match backend {
        Backend::Memory => None,
        _ => {
            let raw = Raw::connect(backend, &server.url, server.port().unwrap_or(0)).await?;
            let measured = Baseline::measure(&raw, plan.batch_1, 1).await?;
            Some((raw, measured))
        }
    };
    for &w in &plan.waiters {
        let mut kinds = vec![Through::Lock, Through::Permit];
        if w == 1 {
            kinds.extend([Through::PlainLock, Through::Leadership]);
        }
        for through in kinds {
            let mut w_rows =
                w_rows(plan, server, clients, &mut probe, ping_p50, w, through).await?;
            if let (Some(latency), Some(raw)) = (w_rows.first_mut(), raw_p50) {
                latency.ratio_vs_raw = latency.p50_us.map(|l| l / raw);
            }
            rows.extend(w_rows);
        }
        if let Some((raw, floor)) = floor.as_mut() {
            floor.add_round(raw, plan.batch_1).await?;
        }
        eprintln!("[{}] handoff W={w} done", backend.name());
    }
    if let Some((_, floor)) = &floor {
        judge_target(backend, floor, &mut rows);
    }
    if let Some(&most) = plan.waiters.iter().max() {
        judge_server_work(&mut rows, most);
    }
    Ok(rows)
}

/// Target 2: a lock handoff's server work at the largest W (`most`) at
/// most 1.5x W = 1's (judged on the largest W's row).
fn judge_server_work(rows: &mut [Row], most: usize) {
    let at = |w: usize| {
        let param = format!("W={w}");
        rows.iter()
            .position(|r| r.scenario == "server_work_per_handoff" && r.param == param)
    };
    let (Some(one), Some(many)) = (at(1), at(most)) else {
        return;
    };
    let (Some(one_work), Some(many_work)) = (rows[one].round_trips, rows[many].round_trips) else {
        return;
    };
    if one != many {
        rows[many].judge(
            "server_work_at_most_1_5x_one_waiter",
            many_work <= 1.5 * one_work,
            format_args!(
                "2, {many_work:.2} <= 1.5 x {one_work:.2} (W = 1) = {:.2}",
                1.5 * one_work
            ),
        );
    }
}

/// Target 3: a lock handoff's p50 at most the raw acquire write plus one
/// round trip (`floor`, measured between the W rows). Adds the floor's
/// row, and the verdict to each lock handoff row's note and JSON.
fn judge_target(backend: Backend, floor: &Baseline, rows: &mut Vec<Row>) {
    let Some(target) = floor.write_plus_round_trip() else {
        return;
    };
    for row in rows.iter_mut().filter(|r| r.scenario == "handoff") {
        let Some(p50) = row.p50_us else { continue };
        row.judge(
            "handoff_within_write_plus_round_trip",
            p50 <= target,
            format_args!(
                "3, p50 {p50:.1} <= {target:.1} µs (raw write + 1 round trip, measured between the W rows)"
            ),
        );
        row.extra.push(("handoff_target_us", json!(round1(target))));
    }
    let mut row = floor.row(backend, "handoff_floor");
    row.note = Some(format!(
        "raw acquire write alone, {} samples; round trip p50 {:.1} µs; in rounds before and between the handoff rows' W; target 3 = write p50 + round trip p50 = {target:.1} µs",
        floor.acquire.us.len(),
        floor.ping_p50().unwrap_or(0.0),
    ));
    rows.push(row);
}

/// What the holders hand off.
#[derive(Debug, Clone, Copy)]
enum Through {
    /// A lock, with the default options (its guard renews it).
    Lock,
    /// A lock whose guard does not renew it ([`Renewal::Off`]): on etcd it
    /// takes a lease of its own, granted at each acquisition.
    PlainLock,
    /// The one permit of a semaphore of limit 1.
    Permit,
    /// Leadership of an election: the leader resigns, a standby that is
    /// campaigning leads.
    Leadership,
}

/// What a worker holds: a guard, or a leadership.
enum Held {
    Guard(LockGuard),
    Leader(Leadership),
}

impl Held {
    async fn acquire(
        locker: &Locker,
        key: &LockKey,
        options: &LockOptions,
        through: Through,
        identity: &HolderId,
    ) -> Result<Held, String> {
        match through {
            Through::Leadership => locker
                .campaign(key, identity, options)
                .await
                .map(Held::Leader)
                .map_err(|e| format!("handoff campaign: {e}")),
            _ => locker
                .acquire(key, options)
                .await
                .map_err(|e| format!("handoff acquire: {e}"))?
                .map(Held::Guard)
                .ok_or_else(|| "handoff acquire timed out".to_owned()),
        }
    }

    async fn release(self) -> Result<(), String> {
        match self {
            Held::Guard(guard) => guard.release().await,
            Held::Leader(leadership) => leadership.resign().await,
        }
        .map_err(|e| format!("handoff release: {e}"))
    }
}

impl Through {
    /// The scenario names of its latency, client-call and server-work rows.
    fn scenarios(self) -> [&'static str; 3] {
        match self {
            Through::Lock => [
                "handoff",
                "client_calls_per_handoff",
                "server_work_per_handoff",
            ],
            Through::PlainLock => [
                "plain_handoff",
                "plain_calls_per_handoff",
                "plain_server_per_handoff",
            ],
            Through::Permit => [
                "permit_handoff",
                "permit_calls_per_handoff",
                "permit_server_per_handoff",
            ],
            Through::Leadership => [
                "election_handover",
                "election_calls_per_handover",
                "election_server_per_handover",
            ],
        }
    }

    fn options(self) -> LockOptions {
        // The default renewal: no guard is held for a third of the TTL, so
        // none renews inside a run.
        let options = LockOptions::new(TTL).with_wait(Duration::from_secs(120));
        match self {
            Through::Lock | Through::Leadership => options,
            Through::PlainLock => options.with_renewal(Renewal::Off),
            Through::Permit => options.with_permits(1),
        }
    }
}

/// The three rows of one W for `through`: timed with bare clients, then
/// counted through a [`Link`] untimed.
async fn w_rows(
    plan: &Plan,
    server: &Server,
    clients: &[LockClient],
    counter: &mut Probe,
    ping_p50: Option<f64>,
    w: usize,
    through: Through,
) -> BenchResult<Vec<Row>> {
    let backend = server.backend;
    let [latency_name, calls_name, server_name] = through.scenarios();
    let mut rows = Vec::new();
    let timed = handoff(plan, &clients[..=w], Some(counter), None, w, through).await?;
    let link = Link::new();
    let linked: Vec<LockClient> = clients[..=w]
        .iter()
        .map(|c| link.wrap(c.clone(), LINK_TIMEOUT))
        .collect();
    let counted = handoff(plan, &linked, None, Some(&link), w, through).await?;

    let mut row = Row::new(backend, latency_name, format!("W={w}"));
    row.p50_us = timed.latency.pct(0.5);
    row.p99_us = timed.latency.pct(0.99);
    row.round_trips = ping_p50.zip(row.p50_us).map(|(p, l)| l / p);
    row.note = Some(format!(
        "{} handoffs ({} acquired before the release returned: 0), hold {:?}, p99 {}",
        timed.latency.us.len(),
        timed.early,
        plan.hold,
        ping_p50
            .zip(row.p99_us)
            .map(|(p, l)| format!("{:.1} round trips", l / p))
            .unwrap_or_else(|| "-".to_owned())
    ));
    rows.push(row);

    let n = counted.handoffs as f64;
    let calls = counted.calls;
    let mut row = Row::new(backend, calls_name, format!("W={w}"));
    row.round_trips = Some(calls.ops() as f64 / n);
    row.note = Some(format!(
        "try_acquire {:.2}, release {:.2}, extend {:.2}, watch {:.2} per handoff (counted at the client through a conformance Link, in an untimed pass)",
        calls.try_acquire as f64 / n,
        calls.release as f64 / n,
        calls.extend as f64 / n,
        calls.watch as f64 / n
    ));
    rows.push(row);

    let mut row = Row::new(backend, server_name, format!("W={w}"));
    let n = timed.handoffs as f64;
    match timed.server.total {
        Some(total) => {
            row.round_trips = Some(total as f64 / n);
            row.note = Some(format!(
                "{}: {}",
                probe::source(backend, &timed.server, n),
                timed.server.top(n, 6)
            ));
        }
        None => {
            row.round_trips = Some(calls.ops() as f64 / counted.handoffs as f64);
            row.note = Some(
                match backend {
                    Backend::Memory => "backend calls counted at the client (in-process)",
                    _ => "lock calls counted at the client (the server has no counters)",
                }
                .to_owned(),
            );
        }
    }
    rows.push(row);
    Ok(rows)
}

struct HandoffOutcome {
    latency: Samples,
    /// Handoffs acquired before the release returned (counted as 0).
    early: usize,
    handoffs: usize,
    calls: Calls,
    server: ServerCount,
}

#[derive(Default)]
struct HandoffState {
    /// When the release of the holder of acquisition k returned, until
    /// acquisition k + 1 (the handoff it starts) returns.
    released_at: HashMap<usize, Instant>,
    /// Handoffs k -> k + 1 whose acquisition returned before the release
    /// did (the wake-up outran the release's own reply): the release, once
    /// it returns, records a handoff of 0. Pairing by number keeps such a
    /// handoff from being measured against the next cycle's release.
    acquired_first: HashSet<usize>,
    /// How many measured handoffs were acquired before the release returned.
    early: usize,
    acquisitions: usize,
    latency: Samples,
    calls_at_start: Option<Calls>,
    calls_at_end: Option<Calls>,
}

/// W waiters (each its own client, so its own connections) and one holder
/// cycle through one key (`through`: its lock, or its semaphore of 1).
/// After releasing, a worker waits until someone else acquired before it
/// queues again, so every handoff goes to a waiter that was already
/// waiting, and a holder always has W waiters behind it (each cycle's
/// work includes the refused attempt of the worker that queues again). The counters (`probe`, `link`) are read at the
/// first and the last measured acquisition, by the acquirer, while it holds
/// the lock.
async fn handoff(
    plan: &Plan,
    clients: &[LockClient],
    probe: Option<&mut Probe>,
    link: Option<&Link>,
    w: usize,
    through: Through,
) -> BenchResult<HandoffOutcome> {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let key = LockKey::new(format!("handoff-{run}-w{w}")).map_err(|e| e.to_string())?;
    let options = through.options();
    let state = Arc::new(Mutex::new(HandoffState::default()));
    let (gen_tx, gen_rx) = watch::channel(0usize);
    let gen_tx = Arc::new(gen_tx);
    let warmup = warmup_handoffs(w);
    let target = warmup + plan.handoffs;
    let (probe_tx, mut probe_rx) = mpsc::channel::<oneshot::Sender<()>>(2);
    let mut handles = Vec::new();
    for (n, c) in clients.iter().enumerate() {
        let identity = HolderId::new(format!("worker-{n}")).map_err(|e| e.to_string())?;
        let locker = Locker::new(c.clone());
        let key = key.clone();
        let options = options.clone();
        let state = state.clone();
        let gen_tx = gen_tx.clone();
        let mut gen_rx = gen_rx.clone();
        let link = link.cloned();
        let probe_tx = probe_tx.clone();
        let hold = plan.hold;
        handles.push(tokio::spawn(async move {
            loop {
                let held = Held::acquire(&locker, &key, &options, through, &identity).await?;
                let now = Instant::now();
                let n = {
                    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                    s.acquisitions += 1;
                    let n = s.acquisitions;
                    let measure = n > warmup + 1 && n <= target + 1;
                    match s.released_at.remove(&(n - 1)) {
                        Some(r) if measure => s.latency.push(now.saturating_duration_since(r)),
                        Some(_) => {}
                        None => {
                            s.acquired_first.insert(n - 1);
                        }
                    }
                    if let Some(link) = &link {
                        if n == warmup + 1 {
                            s.calls_at_start = Some(Calls::of(link));
                        }
                        if n == target + 1 {
                            s.calls_at_end = Some(Calls::of(link));
                        }
                    }
                    n
                };
                // Whoever released before this acquisition may queue again.
                gen_tx.send_replace(n);
                if n == warmup + 1 || n == target + 1 {
                    let (tx, rx) = oneshot::channel();
                    let _ = probe_tx.send(tx).await;
                    let _ = rx.await;
                }
                let done = n > target;
                if !done {
                    tokio::time::sleep(hold).await;
                }
                held.release().await?;
                {
                    let now = Instant::now();
                    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                    if s.acquired_first.remove(&n) {
                        // The next holder already has it: a handoff of 0
                        // after this release returned.
                        if n + 1 > warmup + 1 && n < target + 1 {
                            s.latency.push(Duration::ZERO);
                            s.early += 1;
                        }
                    } else {
                        s.released_at.insert(n, now);
                    }
                }
                if done {
                    return Ok::<(), String>(());
                }
                // Queue again only once someone else took the lock, so the
                // next release finds this worker waiting (at W = 1 too).
                let mine = n;
                loop {
                    if *gen_rx.borrow_and_update() > mine {
                        break;
                    }
                    if gen_rx.changed().await.is_err() {
                        break;
                    }
                }
            }
        }));
    }
    drop(probe_tx);
    let mut counts = Vec::new();
    let mut probe = probe;
    while let Some(reply) = probe_rx.recv().await {
        if let Some(probe) = probe.as_deref_mut() {
            counts.push(probe.count().await?);
        }
        let _ = reply.send(());
    }
    for h in handles {
        h.await.map_err(|e| e.to_string())??;
    }
    let s = std::mem::take(&mut *state.lock().unwrap_or_else(|e| e.into_inner()));
    let calls = match (s.calls_at_start, s.calls_at_end) {
        (Some(a), Some(b)) => b.since(&a),
        _ => Calls::default(),
    };
    let server = match counts.as_slice() {
        [a, b] => b.since(a),
        _ => ServerCount::default(),
    };
    Ok(HandoffOutcome {
        handoffs: plan.handoffs,
        early: s.early,
        latency: s.latency,
        calls,
        server,
    })
}
