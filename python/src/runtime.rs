//! The tokio runtime behind every call, one per process.
//!
//! Celery's prefork pool forks worker processes from a parent that may have
//! used distlock already; a forked child has the parent's memory but none of
//! its threads, so the parent's runtime is dead there. Each process therefore
//! builds its own runtime on first use, and the parent's is leaked in the
//! child (dropping it would wait for threads that do not exist).

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::BoundObject;
use tokio::runtime::{Handle, Runtime};
use tokio::task::JoinHandle;

/// How often a blocking wait looks for Ctrl-C (and other signal handlers).
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

static RUNTIME: Mutex<Option<(u32, &'static Runtime)>> = Mutex::new(None);

/// This process's runtime.
pub fn handle() -> PyResult<Handle> {
    let pid = std::process::id();
    let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((owner, runtime)) = *slot {
        if owner == pid {
            return Ok(runtime.handle().clone());
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("distlock")
        .enable_all()
        .build()
        .map_err(|e| {
            pyo3::exceptions::PyRuntimeError::new_err(format!(
                "distlock could not start its runtime: {e}"
            ))
        })?;
    let runtime: &'static Runtime = Box::leak(Box::new(runtime));
    *slot = Some((pid, runtime));
    Ok(runtime.handle().clone())
}

/// Runs `future` to completion with the GIL released, so other Python
/// threads run while this one waits on the server. A pending signal (Ctrl-C)
/// stops the wait: the future is dropped (every distlock future is
/// cancel-safe) and the signal handler's exception is raised.
pub fn block_on<F>(py: Python<'_>, future: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    if Handle::try_current().is_ok() {
        // Only reachable from a callback running on a runtime thread.
        return Err(pyo3::exceptions::PyRuntimeError::new_err(
            "a blocking distlock call was made on distlock's own runtime thread; use the async API there",
        ));
    }
    let handle = handle()?;
    py.detach(|| {
        handle.block_on(async {
            tokio::pin!(future);
            // The first check one period from now: an interval's immediate
            // first tick only fires when the time driver next turns (about
            // 1 ms), which would cost every short call that much.
            let mut ticks =
                tokio::time::interval_at(tokio::time::Instant::now() + SIGNAL_CHECK, SIGNAL_CHECK);
            loop {
                tokio::select! {
                    output = &mut future => return Ok(output),
                    _ = ticks.tick() => Python::attach(|py| py.check_signals())?,
                }
            }
        })
    })
}

/// Runs `future` on the runtime and hands its result to `done(ok, value)`
/// (called on a runtime thread, holding the GIL): `(True, value)` or
/// `(False, exception)`. The asyncio side of the package turns this into an
/// awaitable. Abort the returned task to cancel.
pub fn spawn_with_callback<F, T>(future: F, done: Py<PyAny>) -> PyResult<JoinHandle<()>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    Ok(handle()?.spawn(async move {
        let result = future.await;
        // Waiting for the GIL must not hold up a runtime worker (renewals).
        let callback = tokio::task::spawn_blocking(move || {
            Python::attach(|py| {
                let (ok, value) = match result.and_then(|value| {
                    value
                        .into_pyobject(py)
                        .map(|bound| bound.into_any().unbind())
                        .map_err(Into::into)
                }) {
                    Ok(value) => (true, value),
                    Err(error) => (false, error.into_value(py).into_any()),
                };
                if let Err(error) = done.call1(py, (ok, value)) {
                    error.write_unraisable(py, None);
                }
            })
        });
        let _ = callback.await;
    }))
}
