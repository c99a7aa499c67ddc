//! The tower layer over the memory backend: skip, wait, release on
//! completion, release on drop, lost lock, per-request keys.
#![cfg(feature = "tower")]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use distlock::layer::{LockLayer, LockServiceError, LockedResponse};
use distlock::{
    ErrorKind, JobKey, LockError, LockKey, LockOptions, Locker, LostReason, MemoryLock,
};
use distlock_conformance::{Call, ObservedLock};
use tokio::sync::mpsc;
use tower::{service_fn, Layer, Service, ServiceExt};

#[derive(Debug, Clone)]
struct Job {
    name: &'static str,
    customer: u32,
}

fn job_key(job: &Job) -> Result<LockKey, LockError> {
    JobKey::new(job.name).args(&job.customer)?.key()
}

/// Sets its flag when dropped: proves an inner future was stopped.
struct DropFlag(Arc<AtomicBool>);
impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// An inner service that counts calls and answers `name:customer`.
fn counting(
    calls: Arc<AtomicUsize>,
) -> impl Service<Job, Response = String, Error = std::io::Error, Future: Send> + Clone + Send + 'static
{
    service_fn(move |job: Job| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(format!("{}:{}", job.name, job.customer))
        }
    })
}

/// An inner service that reports it started, then never finishes (until
/// dropped, which sets the flag).
fn hanging(
    started: mpsc::UnboundedSender<()>,
    dropped: Arc<AtomicBool>,
) -> impl Service<Job, Response = String, Error = std::io::Error, Future: Send> + Clone + Send + 'static
{
    service_fn(move |_job: Job| {
        let started = started.clone();
        let flag = DropFlag(dropped.clone());
        async move {
            let _flag = flag;
            let _ = started.send(());
            std::future::pending::<()>().await;
            Ok::<_, std::io::Error>(String::new())
        }
    })
}

fn job() -> Job {
    Job {
        name: "invoice",
        customer: 7,
    }
}

#[tokio::test]
async fn runs_when_free_and_releases_on_completion() {
    let server = MemoryLock::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = LockLayer::new(Locker::new(server.client()), job_key);
    let response = layer
        .layer(counting(calls.clone()))
        .oneshot(job())
        .await
        .unwrap();
    assert_eq!(response, LockedResponse::Ran("invoice:7".to_owned()));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Released before the response resolved: free right away, no waiting.
    let other = Locker::new(server.client());
    let key = job_key(&job()).unwrap();
    let guard = other
        .try_lock(&key, &LockOptions::new(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(guard.is_some(), "the layer released the lock on completion");
    assert_eq!(server.held_count(), 1);
}

#[tokio::test]
async fn skips_when_held() {
    let server = MemoryLock::new();
    let key = job_key(&job()).unwrap();
    let holder = Locker::new(server.client())
        .try_lock(&key, &LockOptions::new(Duration::from_secs(30)))
        .await
        .unwrap()
        .expect("free");
    let calls = Arc::new(AtomicUsize::new(0));
    let service =
        LockLayer::new(Locker::new(server.client()), job_key).layer(counting(calls.clone()));
    let response = service.clone().oneshot(job()).await.unwrap();
    assert!(response.is_skipped());
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "inner not called when skipped"
    );
    // Another key (other arguments) is not blocked.
    let response = service
        .oneshot(Job {
            name: "invoice",
            customer: 8,
        })
        .await
        .unwrap();
    assert_eq!(response.ran().as_deref(), Some("invoice:8"));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    holder.release().await.unwrap();
}

#[tokio::test]
async fn waits_when_asked_then_runs() {
    let server = MemoryLock::new();
    let key = job_key(&job()).unwrap();
    let holder = Locker::new(server.client())
        .try_lock(&key, &LockOptions::new(Duration::from_secs(30)))
        .await
        .unwrap()
        .expect("free");
    let calls = Arc::new(AtomicUsize::new(0));
    let service = LockLayer::new(Locker::new(server.client()), job_key)
        .options(LockOptions::new(Duration::from_secs(30)).with_wait(Duration::from_secs(60)))
        .layer(counting(calls.clone()));
    let call = tokio::spawn(service.oneshot(job()));
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    // The lock is still held, so the call cannot have run.
    assert!(!call.is_finished());
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    holder.release().await.unwrap();
    let response = call.await.unwrap().unwrap();
    assert_eq!(response, LockedResponse::Ran("invoice:7".to_owned()));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn wait_runs_out_then_skips() {
    let server = MemoryLock::new();
    let key = job_key(&job()).unwrap();
    let holder = Locker::new(server.client())
        .try_lock(&key, &LockOptions::new(Duration::from_secs(30)))
        .await
        .unwrap()
        .expect("free");
    let calls = Arc::new(AtomicUsize::new(0));
    let response = LockLayer::new(Locker::new(server.client()), job_key)
        .options(LockOptions::new(Duration::from_secs(30)).with_wait(Duration::from_millis(100)))
        .layer(counting(calls.clone()))
        .oneshot(job())
        .await
        .unwrap();
    assert!(response.is_skipped());
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    holder.release().await.unwrap();
}

#[tokio::test]
async fn releases_when_the_response_future_is_dropped() {
    let server = MemoryLock::new();
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let dropped = Arc::new(AtomicBool::new(false));
    let service = LockLayer::new(Locker::new(server.client()), job_key)
        .layer(hanging(started_tx, dropped.clone()));
    let call = tokio::spawn(service.oneshot(job()));
    started.recv().await.expect("inner started");
    assert_eq!(server.held_count(), 1);
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    assert!(dropped.load(Ordering::SeqCst), "inner future dropped");
    // The guard released in the background; a waiter gets the lock.
    let key = job_key(&job()).unwrap();
    let guard = Locker::new(server.client())
        .acquire(
            &key,
            &LockOptions::new(Duration::from_secs(5)).with_wait(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    assert!(guard.is_some(), "released after the drop");
}

#[tokio::test]
async fn lost_lock_stops_the_inner_future() {
    let server = MemoryLock::new();
    let recording = Arc::new(ObservedLock::new(server.client()));
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let dropped = Arc::new(AtomicBool::new(false));
    let service = LockLayer::new(Locker::new(recording.clone()), job_key)
        // Renews every 100 ms, so the loss is noticed at the next renewal.
        .options(LockOptions::new(Duration::from_millis(300)))
        .layer(hanging(started_tx, dropped.clone()));
    let call = tokio::spawn(service.oneshot(job()));
    started.recv().await.expect("inner started");
    // Behind the guard's back: release its lease through the raw backend,
    // and let another client take the key.
    let lease = recording.last_granted().expect("a lease");
    recording.release_behind(&lease).await.unwrap();
    let key = job_key(&job()).unwrap();
    let thief = Locker::new(server.client())
        .try_lock(&key, &LockOptions::new(Duration::from_secs(30)))
        .await
        .unwrap()
        .expect("taken over");
    assert!(thief.fencing_token() > lease.fencing_token());
    let error = call.await.unwrap().unwrap_err();
    match error {
        LockServiceError::Lost(reason) => assert_eq!(reason, LostReason::Refused),
        other => panic!("expected Lost, got {other:?}"),
    }
    assert!(dropped.load(Ordering::SeqCst), "inner future stopped");
    // The thief's lock is untouched.
    assert!(!thief.is_lost());
    thief.release().await.unwrap();
}

#[tokio::test]
async fn key_errors_fail_the_call_without_running() {
    let server = MemoryLock::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let error = LockLayer::new(Locker::new(server.client()), |_: &Job| LockKey::new(""))
        .layer(counting(calls.clone()))
        .oneshot(job())
        .await
        .unwrap_err();
    match &error {
        LockServiceError::Lock(e) => assert_eq!(e.kind(), ErrorKind::InvalidInput),
        other => panic!("expected a lock error, got {other:?}"),
    }
    assert!(error.to_string().contains("lock error"));
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn inner_errors_pass_through_and_release() {
    let server = MemoryLock::new();
    let service =
        service_fn(|_: Job| async { Err::<String, _>(std::io::Error::other("report failed")) });
    let error = LockLayer::new(Locker::new(server.client()), job_key)
        .layer(service)
        .oneshot(job())
        .await
        .unwrap_err();
    assert!(matches!(error, LockServiceError::Inner(ref e) if e.to_string() == "report failed"));
    assert_eq!(server.held_count(), 0);
}

#[tokio::test]
async fn expired_grant_is_never_handed_to_the_inner_service() {
    let server = MemoryLock::new();
    let slow = Arc::new(ObservedLock::new(server.client()));
    let calls = Arc::new(AtomicUsize::new(0));
    let ttl = Duration::from_millis(200);
    let service = LockLayer::new(Locker::new(slow.clone()), job_key)
        .options(LockOptions::new(ttl))
        .layer(counting(calls.clone()));
    // The server grants the lock; its reply is held until the lease ran out
    // and another client took the key.
    slow.hold_replies(Call::Acquire);
    let call = tokio::spawn(service.oneshot(job()));
    slow.until_waiting(Call::Acquire, 1).await;
    let key = job_key(&job()).unwrap();
    let thief = Locker::new(server.client())
        .acquire(
            &key,
            &LockOptions::new(Duration::from_secs(30)).with_wait(Duration::from_secs(60)),
        )
        .await
        .unwrap()
        .expect("the held grant expires");
    slow.open(Call::Acquire);
    let result = call.await.unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "the inner service ran on an expired lease: {result:?}"
    );
    match result {
        Err(LockServiceError::Lock(e)) => assert_eq!(e.kind(), ErrorKind::Timeout, "{e}"),
        other => panic!("expected a Timeout lock error, got {other:?}"),
    }
    assert!(!thief.is_lost());
    thief.release().await.unwrap();
}
