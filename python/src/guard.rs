//! `LockGuard`: a held lock as Python sees it (renewal in the background,
//! the lost signal, release at the end of a `with` block or on drop).

use std::sync::Mutex;

use pyo3::prelude::*;

use crate::backend::{self, ErrorKind, Held, LockError as RustLockError};
use crate::errors::{invalid_input, lost_text, to_py, LockLost};
use crate::locker::TaskHandle;
use crate::{aio, convert, runtime};

/// A held lock: renews itself in the background, tells when it is lost,
/// releases on `release()` or at the end of a `with` / `async with` block.
#[pyclass(module = "distlock", frozen)]
pub(crate) struct LockGuard {
    held: Held,
    /// `None` once released, and for a job's lock (its runner releases it).
    guard: Mutex<Option<backend::LockGuard>>,
    /// Whether `release()` is this object's to call.
    owned: bool,
    /// The process that acquired it: a forked child must not release the
    /// parent's lock.
    pid: u32,
}

impl LockGuard {
    pub(crate) fn new(guard: backend::LockGuard) -> Self {
        Self {
            held: Held::of(&guard),
            guard: Mutex::new(Some(guard)),
            owned: true,
            pid: std::process::id(),
        }
    }

    pub(crate) fn job(held: Held) -> Self {
        Self {
            held,
            guard: Mutex::new(None),
            owned: false,
            pid: std::process::id(),
        }
    }

    fn take(&self) -> PyResult<Option<backend::LockGuard>> {
        if !self.owned {
            return Err(invalid_input(
                "this is a job's lock; the job runner releases it when the job returns",
            ));
        }
        Ok(self.guard.lock().unwrap_or_else(|e| e.into_inner()).take())
    }

    fn lost_error(held: &Held) -> PyErr {
        let reason = backend::lost_reason(&held.lost)
            .map(|reason| lost_text(&reason))
            .unwrap_or_else(|| "the server no longer knows this owner".to_owned());
        LockLost::new_err(format!(
            "lock lost: {:?} (fencing token {}) was lost: {reason}; another owner may have run meanwhile",
            held.key, held.fencing_token
        ))
    }

    /// What a release reports: a lost lock is `LockLost`.
    fn released(held: &Held, result: Result<(), RustLockError>) -> PyResult<()> {
        match result {
            Ok(()) if !held.lost.is_lost() => Ok(()),
            Ok(()) => Err(Self::lost_error(held)),
            Err(e) if e.kind() == ErrorKind::NotHeld => Err(Self::lost_error(held)),
            Err(e) => Err(to_py(e)),
        }
    }
}

#[pymethods]
impl LockGuard {
    /// The key held.
    #[getter]
    fn key(&self) -> &str {
        &self.held.key
    }

    /// The fencing token of this acquisition: strictly greater than every
    /// earlier one for this key. Pass it to the resource you protect.
    #[getter]
    fn fencing_token(&self) -> u64 {
        self.held.fencing_token
    }

    /// Whether the lock is known or assumed lost.
    fn is_lost(&self) -> bool {
        self.held.lost.is_lost()
    }

    /// Why the lock was lost, or `None`.
    #[getter]
    fn lost_reason(&self) -> Option<String> {
        backend::lost_reason(&self.held.lost).map(|reason| lost_text(&reason))
    }

    /// Raises `LockLost` if the lock is lost; call it before each write.
    fn raise_if_lost(&self) -> PyResult<()> {
        if self.held.lost.is_lost() {
            return Err(Self::lost_error(&self.held));
        }
        Ok(())
    }

    /// Blocks until the lock is lost or `timeout` seconds passed (`None`:
    /// no limit); returns `is_lost()`.
    #[pyo3(signature = (timeout=None))]
    fn wait_lost(&self, py: Python<'_>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let timeout = convert::optional_duration(timeout, "timeout")?;
        let lost = self.held.lost.clone();
        runtime::block_on(py, async move {
            match timeout {
                Some(limit) => {
                    let _ = tokio::time::timeout(limit, lost.wait()).await;
                }
                None => {
                    lost.wait().await;
                }
            }
        })?;
        Ok(self.held.lost.is_lost())
    }

    /// Stops renewal and releases the lock. Raises `LockLost` if it was lost
    /// meanwhile. Releasing twice does nothing.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        match self.take()? {
            Some(guard) => {
                Self::released(&self.held, runtime::block_on(py, backend::release(guard))?)
            }
            None => Ok(()),
        }
    }

    fn _release_start(&self, done: Py<PyAny>) -> PyResult<TaskHandle> {
        let guard = self.take()?;
        let held = self.held.clone();
        let future = async move {
            match guard {
                Some(guard) => Self::released(&held, backend::release(guard).await),
                None => Ok(()),
            }
        };
        Ok(TaskHandle(runtime::spawn_with_callback(future, done)?))
    }

    /// Releases in the background (an abandoned asyncio acquisition).
    fn _abandon(&self) {
        if let Ok(Some(guard)) = self.take() {
            drop_in_runtime(guard);
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Releases; if the block raised, its exception wins over a release
    /// error.
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _traceback: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let released = self.release(py);
        if exc_type.is_none() {
            released?;
        }
        Ok(false)
    }

    fn __aenter__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        aio(slf.py())?.getattr("ready")?.call1((slf,))
    }

    fn __aexit__<'py>(
        slf: Bound<'py, Self>,
        exc_type: &Bound<'py, PyAny>,
        _exc: &Bound<'py, PyAny>,
        _traceback: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        aio(slf.py())?.getattr("release")?.call1((slf, exc_type))
    }

    fn __repr__(&self) -> String {
        let state = if self.held.lost.is_lost() {
            "lost"
        } else if self.owned
            && self
                .guard
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_none()
        {
            "released"
        } else {
            "held"
        };
        format!(
            "LockGuard(key={:?}, fencing_token={}, {state})",
            self.held.key, self.held.fencing_token
        )
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let guard = self
            .guard
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(guard) = guard {
            if self.pid == std::process::id() {
                drop_in_runtime(guard);
            } else {
                // The parent process holds this lock; leave it alone.
                std::mem::forget(guard);
            }
        }
    }
}

/// Drops a guard where its background release can run.
pub(crate) fn drop_in_runtime(guard: backend::LockGuard) {
    match runtime::handle() {
        Ok(handle) => {
            let _context = handle.enter();
            drop(guard);
        }
        // No runtime: the lock expires after its TTL.
        Err(_) => drop(guard),
    }
}
