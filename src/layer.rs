//! A [`tower`](https://docs.rs/tower) layer that runs each request of a
//! service under a distributed lock whose key comes from the request — the
//! celery-once / celery-singleton pattern for any tower `Service`.
//!
//! [`LockLayer`] wraps a service in a [`LockService`]. For each call:
//!
//! 1. the key function derives a [`LockKey`] from the request (e.g. the job
//!    name plus a hash of its arguments with [`JobKey`](crate::JobKey));
//! 2. **inside the response future** (never in `poll_ready`), the lock is
//!    acquired, waiting up to [`LockOptions::with_wait`] (zero: skip at once); a
//!    lease granted so late that it is already inside its stop margin is
//!    released and the call fails with [`LockServiceError::Lock`]
//!    (`ErrorKind::Timeout`) without calling the inner service;
//! 3. if it is held elsewhere, the response is [`LockedResponse::Skipped`]
//!    and the inner service is not called;
//! 4. otherwise the inner service runs while the [`LockGuard`](crate::LockGuard) lives in the
//!    response future, renewing the lease. The lock is released when the
//!    inner future completes, and also when the response future is dropped
//!    (tower's concurrency-limit pattern: the permit lives in the future);
//! 5. if the lock is lost while the inner future runs (renewal refused, or
//!    the lease reached its stop moment, [`LockOptions::with_stop_margin`] before
//!    it may run out), the inner future is **dropped** — it stops at its
//!    current `.await` and is never polled again — and the call fails with
//!    [`LockServiceError::Lost`].
//!
//! Needs a tokio runtime (the guard renews on a background task).
//!
//! ```no_run
//! use std::time::Duration;
//! use distlock::layer::{LockLayer, LockedResponse};
//! use distlock::{JobKey, LockOptions, Locker};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//!
//! #[derive(Clone)]
//! struct Job { name: &'static str, customer: u32 }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let locker = Locker::new(distlock::connect("redis://127.0.0.1:6379").await?);
//! let service = ServiceBuilder::new()
//!     .layer(
//!         LockLayer::new(locker, |job: &Job| JobKey::new(job.name).args(&job.customer)?.key())
//!             .options(LockOptions::new(Duration::from_secs(30))), // skip if held
//!     )
//!     .service(service_fn(|job: Job| async move {
//!         Ok::<_, std::io::Error>(format!("invoiced customer {}", job.customer))
//!     }));
//! match service.oneshot(Job { name: "invoice", customer: 7 }).await? {
//!     LockedResponse::Ran(text) => println!("{text}"),
//!     LockedResponse::Skipped => println!("already running elsewhere"),
//! }
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tower_layer::Layer;
use tower_service::Service;

use crate::{LockError, LockKey, LockOptions, Locker, LostReason};

/// What a [`LockService`] call produced when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockedResponse<R> {
    /// The lock was acquired and the inner service answered.
    Ran(R),
    /// The lock was held elsewhere (after waiting, if a wait was set); the
    /// inner service was not called.
    Skipped,
}

impl<R> LockedResponse<R> {
    /// The inner response, if the call ran.
    pub fn ran(self) -> Option<R> {
        match self {
            LockedResponse::Ran(response) => Some(response),
            LockedResponse::Skipped => None,
        }
    }

    /// Whether the call was skipped because the lock was held.
    pub fn is_skipped(&self) -> bool {
        matches!(self, LockedResponse::Skipped)
    }
}

/// Why a [`LockService`] call failed.
#[derive(Debug)]
pub enum LockServiceError<E> {
    /// Deriving the key or acquiring the lock failed (bad key, server
    /// unavailable...). The inner service was not called.
    Lock(LockError),
    /// The lock was lost while the inner service ran; its future was dropped
    /// (stopped at its current await point) before completing.
    Lost(LostReason),
    /// The inner service failed (in `poll_ready` or in its response).
    Inner(E),
}

impl<E: fmt::Display> fmt::Display for LockServiceError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockServiceError::Lock(e) => write!(f, "lock error: {e}"),
            LockServiceError::Lost(reason) => {
                write!(
                    f,
                    "lock lost while the request ran; it was stopped: {reason}"
                )
            }
            LockServiceError::Inner(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl<E> std::error::Error for LockServiceError<E>
where
    E: std::error::Error + 'static,
{
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LockServiceError::Lock(e) => Some(e),
            LockServiceError::Lost(_) => None,
            LockServiceError::Inner(e) => Some(e),
        }
    }
}

/// Wraps services in a [`LockService`]: each request runs under the lock
/// `key_fn(&request)`.
///
/// The skip-or-wait policy is [`LockOptions::with_wait`]: zero (the default)
/// skips at once when the lock is held; a positive wait waits that long, then
/// skips. The default options are a 30 s TTL renewed every 10 s, no wait.
pub struct LockLayer<K> {
    locker: Locker,
    key_fn: Arc<K>,
    options: LockOptions,
}

impl<K> LockLayer<K> {
    /// A layer locking through `locker`, with the key of each request given
    /// by `key_fn` (an error fails the call with [`LockServiceError::Lock`]).
    pub fn new<Req>(locker: Locker, key_fn: K) -> Self
    where
        K: Fn(&Req) -> Result<LockKey, LockError>,
    {
        Self {
            locker,
            key_fn: Arc::new(key_fn),
            options: LockOptions::new(Duration::from_secs(30)),
        }
    }

    /// TTL, renewal, wait (skip-or-wait), max hold and hold-at-least for
    /// each call.
    pub fn options(mut self, options: LockOptions) -> Self {
        self.options = options;
        self
    }
}

impl<K> Clone for LockLayer<K> {
    fn clone(&self) -> Self {
        Self {
            locker: self.locker.clone(),
            key_fn: self.key_fn.clone(),
            options: self.options.clone(),
        }
    }
}

impl<K> fmt::Debug for LockLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockLayer")
            .field("locker", &self.locker)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S, K> Layer<S> for LockLayer<K> {
    type Service = LockService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService {
            inner,
            locker: self.locker.clone(),
            key_fn: self.key_fn.clone(),
            options: self.options.clone(),
        }
    }
}

/// A service that runs each request of `S` under a lock; see the
/// [module docs](self).
pub struct LockService<S, K> {
    inner: S,
    locker: Locker,
    key_fn: Arc<K>,
    options: LockOptions,
}

impl<S: Clone, K> Clone for LockService<S, K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            locker: self.locker.clone(),
            key_fn: self.key_fn.clone(),
            options: self.options.clone(),
        }
    }
}

impl<S: fmt::Debug, K> fmt::Debug for LockService<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .field("locker", &self.locker)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S, K> LockService<S, K> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// The response future of a [`LockService`].
pub type LockFuture<R, E> =
    Pin<Box<dyn Future<Output = Result<LockedResponse<R>, LockServiceError<E>>> + Send>>;

impl<S, K, Req> Service<Req> for LockService<S, K>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
    K: Fn(&Req) -> Result<LockKey, LockError> + Send + Sync + 'static,
    Req: Send + 'static,
{
    type Response = LockedResponse<S::Response>;
    type Error = LockServiceError<S::Error>;
    type Future = LockFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(LockServiceError::Inner)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        // Take the service that was driven to readiness, leave a clone
        // (tower's documented pattern for calling from a future).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let key = (self.key_fn)(&request);
        let locker = self.locker.clone();
        let options = self.options.clone();
        Box::pin(async move {
            let key = key.map_err(LockServiceError::Lock)?;
            // Cancel-safe: dropping this future while waiting leaves no lock.
            let guard = match locker.acquire(&key, &options).await {
                Ok(Some(guard)) => guard,
                Ok(None) => return Ok(LockedResponse::Skipped),
                Err(e) => return Err(LockServiceError::Lock(e)),
            };
            // Lost first: once it fired, the inner future is never polled again.
            let outcome = guard.while_held(inner.call(request)).await;
            match outcome {
                Ok(result) => {
                    // The distlock-core guard logs a failed release; the inner
                    // result stands either way.
                    let _ = guard.release().await;
                    result
                        .map(LockedResponse::Ran)
                        .map_err(LockServiceError::Inner)
                }
                Err(reason) => {
                    drop(guard);
                    Err(LockServiceError::Lost(reason))
                }
            }
        })
    }
}
