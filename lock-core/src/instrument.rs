//! Metrics, emitted once here for every backend through the `metrics`
//! crate (a no-op until the application installs a recorder). Every name,
//! description and unit lives in this module; an application calls
//! [`describe_metrics`] after installing its recorder so an exporter shows
//! each series' help text and unit.
//!
//! | metric | kind | unit | labels |
//! |---|---|---|---|
//! | `distlock_attempts_total` | counter | count | `backend` |
//! | `distlock_acquired_total` | counter | count | `backend` |
//! | `distlock_held_elsewhere_total` | counter | count | `backend` |
//! | `distlock_errors_total` | counter | count | `backend`, `op`, `kind` |
//! | `distlock_lost_total` | counter | count | `backend`, `reason` (`refused`, `expired`) |
//! | `distlock_renewals_total` | counter | count | `backend`, `outcome` (`ok`, `failed`) |
//! | `distlock_wait_seconds` | histogram | seconds | `backend`, `outcome` (`acquired`, `timed_out`, `error`) |
//! | `distlock_hold_seconds` | histogram | seconds | `backend` |
//! | `distlock_operation_seconds` | histogram | seconds | `backend`, `op` (`acquire`, `extend`, `release`, `acquire_permit`, `extend_permit`, `release_permit`) |
//! | `distlock_held_locks` | gauge | count | `backend` |
//!
//! - A renewal is one extend sent by a guard's keep-alive; it `failed` when
//!   the server refused it, the call failed, or the lease reached its stop
//!   moment first. A guard released meanwhile abandons it, uncounted.
//! - `distlock_operation_seconds` times each call into the backend, from
//!   send to answer (errors included; a call whose future was dropped is
//!   not recorded).
//! - `distlock_held_locks` counts live [`LockGuard`](crate::LockGuard)s
//!   (locks and semaphore permits) that still hold their lock: up when a
//!   guard is made, down exactly once when it is released, lost or
//!   dropped. Bare leases from [`LockClient`](crate::LockClient) are not
//!   counted: a lease has no end the library can see (it may simply
//!   expire).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use metrics::Unit;

use crate::{ErrorKind, LockError};

/// Metric names, for dashboards and tests.
pub mod names {
    /// Acquisition attempts (one atomic try each).
    pub const ATTEMPTS: &str = "distlock_attempts_total";
    /// Attempts that got the lock.
    pub const ACQUIRED: &str = "distlock_acquired_total";
    /// Attempts that found the lock held by someone else.
    pub const HELD_ELSEWHERE: &str = "distlock_held_elsewhere_total";
    /// Failed operations, by operation and error kind.
    pub const ERRORS: &str = "distlock_errors_total";
    /// Guards that lost their lock, by reason.
    pub const LOST: &str = "distlock_lost_total";
    /// Renewals sent by guards, by outcome.
    pub const RENEWALS: &str = "distlock_renewals_total";
    /// Time spent in a waiting acquire.
    pub const WAIT_SECONDS: &str = "distlock_wait_seconds";
    /// Time a guard held its lock, acquisition to release or loss.
    pub const HOLD_SECONDS: &str = "distlock_hold_seconds";
    /// Time of one call into the backend, by operation.
    pub const OPERATION_SECONDS: &str = "distlock_operation_seconds";
    /// Guards that hold their lock now.
    pub const HELD_LOCKS: &str = "distlock_held_locks";
}

/// Describes every distlock series (help text and unit) to the installed
/// recorder, so an exporter shows them (Prometheus: `# HELP`, and the unit
/// where it is configured to). Call it once, after installing the recorder:
/// descriptions sent before go to the no-op recorder and are lost. Calling
/// it again is harmless.
///
/// ```
/// # use std::sync::{Arc, Mutex};
/// # use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
/// # #[derive(Default)]
/// # struct Descriptions(Mutex<Vec<(String, Option<Unit>)>>);
/// # impl Descriptions {
/// #     fn add(&self, name: KeyName, unit: Option<Unit>) {
/// #         self.0.lock().unwrap().push((name.as_str().to_owned(), unit));
/// #     }
/// # }
/// # impl Recorder for Descriptions {
/// #     fn describe_counter(&self, name: KeyName, unit: Option<Unit>, _: SharedString) { self.add(name, unit) }
/// #     fn describe_gauge(&self, name: KeyName, unit: Option<Unit>, _: SharedString) { self.add(name, unit) }
/// #     fn describe_histogram(&self, name: KeyName, unit: Option<Unit>, _: SharedString) { self.add(name, unit) }
/// #     fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter { Counter::noop() }
/// #     fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge { Gauge::noop() }
/// #     fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram { Histogram::noop() }
/// # }
/// # let recorder = Descriptions::default();
/// # metrics::with_local_recorder(&recorder, || {
/// // After installing a recorder, e.g.
/// // metrics_exporter_prometheus::PrometheusBuilder::new().install()?;
/// distlock_core::describe_metrics();
/// # });
/// # let described = recorder.0.lock().unwrap();
/// # use distlock_core::instrument::names;
/// # assert!(described.contains(&(names::OPERATION_SECONDS.to_owned(), Some(Unit::Seconds))));
/// # assert!(described.contains(&(names::HELD_LOCKS.to_owned(), Some(Unit::Count))));
/// # assert_eq!(described.len(), 10);
/// ```
pub fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        names::ATTEMPTS,
        Unit::Count,
        "Lock acquisition attempts (one atomic try each), by backend."
    );
    describe_counter!(
        names::ACQUIRED,
        Unit::Count,
        "Acquisition attempts that got the lock or permit."
    );
    describe_counter!(
        names::HELD_ELSEWHERE,
        Unit::Count,
        "Acquisition attempts that found the lock (or every permit) held by someone else."
    );
    describe_counter!(
        names::ERRORS,
        Unit::Count,
        "Failed lock operations, by operation (op) and error kind."
    );
    describe_counter!(
        names::LOST,
        Unit::Count,
        "Guards that lost their lock, by reason (refused: the server refused renewal; expired: the lease reached its stop moment unrenewed)."
    );
    describe_counter!(
        names::RENEWALS,
        Unit::Count,
        "Renewals sent by lock guards, by outcome (ok, failed)."
    );
    describe_histogram!(
        names::WAIT_SECONDS,
        Unit::Seconds,
        "Time spent in a waiting acquire, by outcome (acquired, timed_out, error)."
    );
    describe_histogram!(
        names::HOLD_SECONDS,
        Unit::Seconds,
        "Time a guard held its lock, from the acquire request to its release or loss."
    );
    describe_histogram!(
        names::OPERATION_SECONDS,
        Unit::Seconds,
        "Time of one call into the lock backend, from send to answer, by operation (op)."
    );
    describe_gauge!(
        names::HELD_LOCKS,
        Unit::Count,
        "Lock guards (locks and semaphore permits) that hold their lock now."
    );
}

pub(crate) fn attempt(backend: &'static str, acquired: bool) {
    metrics::counter!(names::ATTEMPTS, "backend" => backend).increment(1);
    if acquired {
        metrics::counter!(names::ACQUIRED, "backend" => backend).increment(1);
    } else {
        metrics::counter!(names::HELD_ELSEWHERE, "backend" => backend).increment(1);
    }
}

pub(crate) fn error(backend: &'static str, op: &'static str, error: &LockError) {
    metrics::counter!(names::ERRORS, "backend" => backend, "op" => op, "kind" => kind_label(error.kind()))
        .increment(1);
}

pub(crate) fn lost(backend: &'static str, reason: &'static str) {
    metrics::counter!(names::LOST, "backend" => backend, "reason" => reason).increment(1);
}

pub(crate) fn renewal(backend: &'static str, ok: bool) {
    let outcome = if ok { "ok" } else { "failed" };
    metrics::counter!(names::RENEWALS, "backend" => backend, "outcome" => outcome).increment(1);
}

pub(crate) fn waited(backend: &'static str, outcome: &'static str, waited: Duration) {
    metrics::histogram!(names::WAIT_SECONDS, "backend" => backend, "outcome" => outcome)
        .record(waited.as_secs_f64());
}

pub(crate) fn operation(backend: &'static str, op: &'static str, took: Duration) {
    metrics::histogram!(names::OPERATION_SECONDS, "backend" => backend, "op" => op)
        .record(took.as_secs_f64());
}

/// One guard's share of the held-locks gauge and its hold time. Counted in
/// when made; counted out exactly once, at the first [`end`](Self::end) or
/// when dropped — so a guard released, lost, dropped, or dropped while its
/// release was in flight, never leaves the gauge high or counts out twice.
#[derive(Debug)]
pub(crate) struct Holding {
    backend: &'static str,
    since: Instant,
    ended: AtomicBool,
}

impl Holding {
    /// A hold that began at `since` (the lease's conservative start).
    pub(crate) fn start(backend: &'static str, since: Instant) -> Self {
        metrics::gauge!(names::HELD_LOCKS, "backend" => backend).increment(1.0);
        Self {
            backend,
            since,
            ended: AtomicBool::new(false),
        }
    }

    /// The guard no longer holds its lock; only the first call counts.
    pub(crate) fn end(&self) {
        if !self.ended.swap(true, Ordering::AcqRel) {
            metrics::gauge!(names::HELD_LOCKS, "backend" => self.backend).decrement(1.0);
            metrics::histogram!(names::HOLD_SECONDS, "backend" => self.backend)
                .record(self.since.elapsed().as_secs_f64());
        }
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.end();
    }
}

fn kind_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidInput => "invalid_input",
        ErrorKind::NotHeld => "not_held",
        ErrorKind::Unavailable => "unavailable",
        ErrorKind::Timeout => "timeout",
        ErrorKind::Corrupted => "corrupted",
        ErrorKind::Config => "config",
        ErrorKind::Unsupported => "unsupported",
    }
}

#[cfg(test)]
mod tests {
    //! The metrics a guard's life emits, read back from a small in-test
    //! recorder (the `metrics` crate ships none) installed for one thread:
    //! a current-thread runtime keeps every task of a test on it.

    use std::collections::HashMap;
    use std::future::Future;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use metrics::{
        Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString,
        Unit,
    };

    use super::names;
    use crate::{ErrorKind, LockClient, LockKey, LockOptions, Locker, MemoryLock, Renewal};

    /// Every series by `name{label=value,...}` (labels sorted).
    #[derive(Default)]
    struct TestRecorder {
        counters: Mutex<HashMap<String, Arc<AtomicU64>>>,
        gauges: Mutex<HashMap<String, Arc<AtomicU64>>>,
        histograms: Mutex<HashMap<String, Arc<Samples>>>,
    }

    #[derive(Default)]
    struct Samples(Mutex<Vec<f64>>);

    impl HistogramFn for Samples {
        fn record(&self, value: f64) {
            self.0.lock().unwrap().push(value);
        }
    }

    fn series(name: &str, labels: &[(&str, &str)]) -> String {
        let mut labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        format!("{name}{{{}}}", labels.join(","))
    }

    fn key_series(key: &Key) -> String {
        let labels: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
        series(key.name(), &labels)
    }

    fn entry<T: Default>(map: &Mutex<HashMap<String, Arc<T>>>, key: &Key) -> Arc<T> {
        map.lock()
            .unwrap()
            .entry(key_series(key))
            .or_default()
            .clone()
    }

    impl Recorder for TestRecorder {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(entry(&self.counters, key))
        }

        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::from_arc(entry(&self.gauges, key))
        }

        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(entry(&self.histograms, key))
        }
    }

    impl TestRecorder {
        fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
            let counters = self.counters.lock().unwrap();
            counters
                .get(&series(name, labels))
                .map_or(0, |c| c.load(Ordering::SeqCst))
        }

        fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
            let gauges = self.gauges.lock().unwrap();
            gauges
                .get(&series(name, labels))
                .map_or(0.0, |g| f64::from_bits(g.load(Ordering::SeqCst)))
        }

        fn samples(&self, name: &str, labels: &[(&str, &str)]) -> usize {
            let histograms = self.histograms.lock().unwrap();
            histograms
                .get(&series(name, labels))
                .map_or(0, |h| h.0.lock().unwrap().len())
        }

        /// Runs `test` on a current-thread runtime with this recorder.
        fn run<F: Future<Output = ()>>(&self, test: F) {
            let runtime = crate::tests::current_thread_runtime();
            metrics::with_local_recorder(self, || runtime.block_on(test));
        }
    }

    const MEMORY: (&str, &str) = ("backend", "memory");

    fn key(name: &str) -> LockKey {
        LockKey::new(name).unwrap()
    }

    /// Renews every 20 ms; the 30 s TTL keeps a starved test from losing
    /// the lock by the clock.
    fn renewing() -> LockOptions {
        LockOptions::new(Duration::from_secs(30))
            .with_renewal(Renewal::Every(Duration::from_millis(20)))
    }

    /// A guard on the free key `name`, renewing every 20 ms.
    async fn take(locker: &Locker, name: &str) -> crate::LockGuard {
        let guard = locker.try_lock(&key(name), &renewing()).await.unwrap();
        guard.expect("a fresh key is free")
    }

    #[test]
    fn held_locks_counts_each_guard_out_exactly_once() {
        let recorder = TestRecorder::default();
        let held = || recorder.gauge(names::HELD_LOCKS, &[MEMORY]);
        recorder.run(async {
            let locker = Locker::new(MemoryLock::new());
            let released = take(&locker, "released").await;
            let dropped = take(&locker, "dropped").await;
            assert_eq!(held(), 2.0);

            released.release().await.unwrap();
            assert_eq!(held(), 1.0);
            drop(dropped);
            locker.client().idle().await;
            assert_eq!(held(), 0.0);

            // Lost: its renewal is refused once an operator deletes the lock;
            // the release after that fails and must not count out again.
            let lost = take(&locker, "lost").await;
            assert_eq!(held(), 1.0);
            assert!(locker.client().force_release(&key("lost")).await.unwrap());
            lost.lost().await;
            assert_eq!(held(), 0.0);
            let error = lost.release().await.unwrap_err();
            assert_eq!(error.kind(), ErrorKind::NotHeld);
            assert_eq!(held(), 0.0);

            // A release future dropped before it ran: the guard inside it
            // is dropped and released in the background.
            let cancelled = take(&locker, "cancelled").await;
            assert_eq!(held(), 1.0);
            drop(cancelled.release());
            locker.client().idle().await;
            assert_eq!(held(), 0.0);
        });
        assert_eq!(recorder.samples(names::HOLD_SECONDS, &[MEMORY]), 4);
        assert_eq!(
            recorder.counter(names::LOST, &[MEMORY, ("reason", "refused")]),
            1
        );
        assert_eq!(
            recorder.counter(names::RENEWALS, &[MEMORY, ("outcome", "failed")]),
            1
        );
    }

    #[test]
    fn renewals_and_backend_calls_are_counted() {
        let recorder = TestRecorder::default();
        let op = |op| recorder.samples(names::OPERATION_SECONDS, &[MEMORY, ("op", op)]);
        recorder.run(async {
            let locker = Locker::new(MemoryLock::new());
            let guard = take(&locker, "renewed").await;
            // Waits for the keep-alive (every 20 ms), however slow the
            // machine; the bound only keeps a broken renewal from hanging.
            for _ in 0..6000 {
                if recorder.counter(names::RENEWALS, &[MEMORY, ("outcome", "ok")]) > 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            guard.release().await.unwrap();

            let client = LockClient::new(MemoryLock::new());
            let ttl = Duration::from_secs(30);
            let permit = client
                .try_acquire_permit(&key("pool"), 2, ttl)
                .await
                .unwrap();
            let permit = permit.lease().unwrap();
            let permit = client.extend(&permit, ttl).await.unwrap();
            client.release(&permit).await.unwrap();
        });
        assert!(recorder.counter(names::RENEWALS, &[MEMORY, ("outcome", "ok")]) > 0);
        assert_eq!(
            recorder.counter(names::RENEWALS, &[MEMORY, ("outcome", "failed")]),
            0
        );
        assert_eq!(op("acquire"), 1);
        assert!(op("extend") > 0);
        assert_eq!(op("release"), 1);
        assert_eq!(op("acquire_permit"), 1);
        assert_eq!(op("extend_permit"), 1);
        assert_eq!(op("release_permit"), 1);
        assert_eq!(recorder.gauge(names::HELD_LOCKS, &[MEMORY]), 0.0);
    }
}
