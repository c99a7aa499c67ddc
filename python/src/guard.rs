//! `LockGuard`: a held lock as Python sees it (renewal in the background,
//! the lost signal, release at the end of a `with` block or on drop). A
//! `Leadership` (`election`) is one of these underneath.

use std::sync::Mutex;

use pyo3::prelude::*;

use crate::backend::{self, ErrorKind, Held, Holding, LockError as RustLockError};
use crate::errors::{invalid_input, lost_text, to_py, LockLost};
use crate::locker::TaskHandle;
use crate::{aio, convert, runtime};

/// A held lock: renews itself in the background, tells when it is lost,
/// releases on `release()` or at the end of a `with` / `async with` block.
#[pyclass(module = "distlock", frozen)]
pub(crate) struct LockGuard {
    pub(crate) held: Held,
    /// `None` once released, and for a job's lock (its runner releases it).
    guard: Mutex<Option<Holding>>,
    /// Whether it holds a leadership (messages say so).
    leading: bool,
    /// Whether `release()` is this object's to call.
    owned: bool,
    /// The process that acquired it: a forked child must not release the
    /// parent's lock.
    pid: u32,
}

impl LockGuard {
    pub(crate) fn new(holding: Holding) -> Self {
        Self {
            held: Held::of(&holding),
            leading: matches!(holding, Holding::Leadership(_)),
            guard: Mutex::new(Some(holding)),
            owned: true,
            pid: std::process::id(),
        }
    }

    pub(crate) fn job(held: Held) -> Self {
        Self {
            held,
            guard: Mutex::new(None),
            leading: false,
            owned: false,
            pid: std::process::id(),
        }
    }

    fn take(&self) -> PyResult<Option<Holding>> {
        if !self.owned {
            return Err(invalid_input(
                "this is a job's lock; the job runner releases it when the job returns",
            ));
        }
        Ok(self.guard.lock().unwrap_or_else(|e| e.into_inner()).take())
    }

    fn lost_error(held: &Held, leading: bool) -> PyErr {
        let reason = backend::lost_reason(&held.lost)
            .map(|reason| lost_text(&reason))
            .unwrap_or_else(|| "the server no longer knows this owner".to_owned());
        if leading {
            return LockLost::new_err(format!(
                "leadership lost: {:?} (term {}) was lost: {reason}; another candidate may have led meanwhile",
                held.key, held.fencing_token
            ));
        }
        LockLost::new_err(format!(
            "lock lost: {:?} (fencing token {}) was lost: {reason}; another owner may have run meanwhile",
            held.key, held.fencing_token
        ))
    }

    /// What a release reports: a lost lock is `LockLost`.
    fn released(held: &Held, leading: bool, result: Result<(), RustLockError>) -> PyResult<()> {
        match result {
            Ok(()) if !held.lost.is_lost() => Ok(()),
            Ok(()) => Err(Self::lost_error(held, leading)),
            Err(e) if e.kind() == ErrorKind::NotHeld => Err(Self::lost_error(held, leading)),
            Err(e) => Err(to_py(e)),
        }
    }

    /// `"lost"`, `"released"` or `"held"`, for `__repr__`.
    pub(crate) fn state(&self) -> &'static str {
        if self.held.lost.is_lost() {
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
    pub(crate) fn is_lost(&self) -> bool {
        self.held.lost.is_lost()
    }

    /// Why the lock was lost, or `None`.
    #[getter]
    pub(crate) fn lost_reason(&self) -> Option<String> {
        backend::lost_reason(&self.held.lost).map(|reason| lost_text(&reason))
    }

    /// Raises `LockLost` if the lock is lost; call it before each write.
    pub(crate) fn raise_if_lost(&self) -> PyResult<()> {
        if self.held.lost.is_lost() {
            return Err(Self::lost_error(&self.held, self.leading));
        }
        Ok(())
    }

    /// Blocks until the lock is lost or `timeout` seconds passed (`None`:
    /// no limit); returns `is_lost()`.
    #[pyo3(signature = (timeout=None))]
    pub(crate) fn wait_lost(
        &self,
        py: Python<'_>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
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
    pub(crate) fn release(&self, py: Python<'_>) -> PyResult<()> {
        match self.take()? {
            Some(guard) => Self::released(
                &self.held,
                self.leading,
                runtime::block_on(py, backend::release(guard))?,
            ),
            None => Ok(()),
        }
    }

    pub(crate) fn _release_start(&self, done: Py<PyAny>) -> PyResult<TaskHandle> {
        let guard = self.take()?;
        let held = self.held.clone();
        let leading = self.leading;
        let future = async move {
            match guard {
                Some(guard) => Self::released(&held, leading, backend::release(guard).await),
                None => Ok(()),
            }
        };
        Ok(TaskHandle(runtime::spawn_with_callback(future, done)?))
    }

    /// Releases in the background (an abandoned asyncio acquisition).
    pub(crate) fn _abandon(&self) {
        if let Ok(Some(guard)) = self.take() {
            drop_in_runtime(guard);
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Releases; if the block raised, its exception wins over a release
    /// error.
    pub(crate) fn __exit__(
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
        aenter(slf.into_any())
    }

    fn __aexit__<'py>(
        slf: Bound<'py, Self>,
        exc_type: &Bound<'py, PyAny>,
        _exc: &Bound<'py, PyAny>,
        _traceback: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        aexit(slf.into_any(), exc_type)
    }

    fn __repr__(&self) -> String {
        format!(
            "LockGuard(key={:?}, fencing_token={}, {})",
            self.held.key,
            self.held.fencing_token,
            self.state()
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

/// `async with` on a guard or a leadership: it is held already.
pub(crate) fn aenter(held: Bound<'_, PyAny>) -> PyResult<Bound<'_, PyAny>> {
    aio(held.py())?.getattr("ready")?.call1((held,))
}

/// The end of `async with`: releases (resigns); the block's exception
/// wins over a release error.
pub(crate) fn aexit<'py>(
    held: Bound<'py, PyAny>,
    exc_type: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    aio(held.py())?.getattr("release")?.call1((held, exc_type))
}

/// Drops a guard where its background release can run.
pub(crate) fn drop_in_runtime(guard: Holding) {
    match runtime::handle() {
        Ok(handle) => {
            let _context = handle.enter();
            drop(guard);
        }
        // No runtime: the lock expires after its TTL.
        Err(_) => drop(guard),
    }
}
