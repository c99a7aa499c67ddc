//! `distlock._distlock`: the Python extension module of distlock.
//!
//! Every operation runs the Rust library (through the `backend` module) on a tokio
//! runtime of this process, with the GIL released while it waits on the
//! server. The asyncio glue and the Celery helpers are in the Python package
//! around this module (`python/distlock`).

use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

mod backend;
mod check;
mod convert;
mod errors;
mod log;
mod runtime;

use backend::{Acquire, Client, ErrorKind, Held, LockError as RustLockError, ScheduledOutcome};
use errors::{invalid_input, lost_text, to_py, LockHeld, LockLost};

/// Opens a lock client for `url` and returns its `Locker`.
#[pyfunction]
fn connect(py: Python<'_>, url: &Bound<'_, PyAny>) -> PyResult<Locker> {
    let url = check::string(url, "url", "a lock URL such as 'redis://127.0.0.1:6379'")?;
    // Logging may have been configured since the import.
    log::refresh(py)?;
    let client = runtime::block_on(py, backend::connect(&url))?.map_err(to_py)?;
    Ok(Locker {
        url,
        client: Mutex::new((std::process::id(), client)),
    })
}

/// The stable lock key of a job run, the same as Rust's `JobKey`.
#[pyfunction]
#[pyo3(signature = (name, args=None, kwargs=None, only=None))]
fn job_key(
    name: &Bound<'_, PyAny>,
    args: Option<&Bound<'_, PyAny>>,
    kwargs: Option<&Bound<'_, PyAny>>,
    only: Option<&Bound<'_, PyAny>>,
) -> PyResult<String> {
    let name = check::string(name, "name", "the job's name, such as 'tasks.send_invoice'")?;
    let only = match only.filter(|only| !only.is_none()) {
        None => None,
        Some(only) => Some(
            only.try_iter()
                .map_err(|_| invalid_input("only must be a list of argument names or indexes"))?
                .map(|item| {
                    let item = item?;
                    match item.extract::<usize>() {
                        Ok(index) => Ok(index.to_string()),
                        Err(_) => item.extract::<String>().map_err(|_| {
                            invalid_input("only must be a list of argument names or indexes")
                        }),
                    }
                })
                .collect::<PyResult<Vec<_>>>()?,
        ),
    };
    let value = convert::job_args(args, kwargs, only.as_deref())?;
    // The key is the name, or the name, ':' and 32 hex digits.
    let hashed = if value.is_some() { 33 } else { 0 };
    check::key_text(&name, "name")?;
    if name.len() + hashed > check::MAX_KEY_BYTES {
        return Err(invalid_input(format!(
            "name (the job name) is {} bytes in UTF-8; with the argument hash the key must stay within {} bytes, \
             so the name may have at most {}",
            name.len(),
            check::MAX_KEY_BYTES,
            check::MAX_KEY_BYTES - hashed
        )));
    }
    backend::job_key(&name, value, only).map_err(to_py)
}

/// The lock of the job running in this context (`run_once_per_fire`, the
/// Celery helpers), or `None`.
#[pyfunction]
fn current_lock(py: Python<'_>) -> PyResult<Py<PyAny>> {
    Ok(current_lock_var(py)?.call_method0("get")?.unbind())
}

fn current_lock_var(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static VAR: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    VAR.get_or_try_init(py, || {
        let kwargs = PyDict::new(py);
        kwargs.set_item("default", py.None())?;
        Ok::<_, PyErr>(
            py.import("contextvars")?
                .getattr("ContextVar")?
                .call(("distlock_current_lock",), Some(&kwargs))?
                .unbind(),
        )
    })
    .map(|var| var.bind(py))
}

/// Calls `func(*args, **kwargs)` with `lock` as the current lock.
fn call_with_lock(
    py: Python<'_>,
    lock: Py<LockGuard>,
    func: &Bound<'_, PyAny>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<Py<PyAny>> {
    let var = current_lock_var(py)?;
    let token = var.call_method1("set", (lock,))?;
    let result = func.call(args, kwargs).map(Bound::unbind);
    var.call_method1("reset", (token,))?;
    result
}

/// The asyncio helpers of the package (`distlock/_aio.py`).
fn aio(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("distlock._aio")
}

/// A connection to one lock server; create it with `distlock.connect(url)`.
#[pyclass(module = "distlock", frozen)]
struct Locker {
    url: String,
    /// The client and the process that opened it (a forked child reconnects).
    client: Mutex<(u32, Client)>,
}

impl Locker {
    fn client(&self, py: Python<'_>) -> PyResult<Client> {
        let pid = std::process::id();
        {
            let slot = self.client.lock().unwrap_or_else(|e| e.into_inner());
            if slot.0 == pid {
                return Ok(slot.1.clone());
            }
        }
        // The parent's connections belong to a runtime that does not run
        // in this forked process: connect again (once).
        let client = runtime::block_on(py, backend::connect(&self.url))?.map_err(to_py)?;
        let mut slot = self.client.lock().unwrap_or_else(|e| e.into_inner());
        if slot.0 != pid {
            let stale = std::mem::replace(&mut *slot, (pid, client));
            std::mem::forget(stale);
        }
        Ok(slot.1.clone())
    }
}

/// The durations of one acquisition, checked (against the backend's
/// limits too when `client` is given).
fn acquire_options(
    ttl: &Bound<'_, PyAny>,
    wait: Option<&Bound<'_, PyAny>>,
    max_hold: Option<&Bound<'_, PyAny>>,
    hold_at_least: Option<&Bound<'_, PyAny>>,
    permits: Option<&Bound<'_, PyAny>>,
    client: Option<&Client>,
) -> PyResult<Acquire> {
    let how = Acquire {
        ttl: convert::duration(ttl, "ttl")?,
        wait: convert::optional_duration(wait, "wait")?.unwrap_or(Duration::ZERO),
        max_hold: convert::optional_duration(max_hold, "max_hold")?,
        hold_at_least: convert::optional_duration(hold_at_least, "hold_at_least")?,
        permits: check::permits(permits)?,
    };
    check::acquire(&how, client.map(Client::max_ttl))?;
    Ok(how)
}

/// Checks lock options as `Locker.lock` would, without a server (the
/// Celery decorators call it when decorating).
#[pyfunction]
#[pyo3(signature = (ttl, wait=None, max_hold=None, hold_at_least=None))]
fn _check_lock_options(
    ttl: &Bound<'_, PyAny>,
    wait: Option<&Bound<'_, PyAny>>,
    max_hold: Option<&Bound<'_, PyAny>>,
    hold_at_least: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    acquire_options(ttl, wait, max_hold, hold_at_least, None, None).map(|_| ())
}

/// Checks a schedule as `Locker.run_once_per_fire` would (`job_name` may
/// be `None` when the name is not known yet).
#[pyfunction]
#[pyo3(signature = (period, ttl=None, job_name=None))]
fn _check_schedule(
    period: &Bound<'_, PyAny>,
    ttl: Option<&Bound<'_, PyAny>>,
    job_name: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    schedule(period, ttl, job_name).map(|_| ())
}

/// A checked schedule: job name, period, running lock TTL.
fn schedule(
    period: &Bound<'_, PyAny>,
    ttl: Option<&Bound<'_, PyAny>>,
    job_name: Option<&Bound<'_, PyAny>>,
) -> PyResult<(String, Duration, Option<Duration>)> {
    let period = convert::duration(period, "period")?;
    let ttl = convert::optional_duration(ttl, "ttl")?;
    let job_name = match job_name {
        Some(name) => check::string(name, "job_name", "the job's name, such as 'nightly-report'")?,
        None => "job".to_owned(),
    };
    check::schedule(&job_name, period, ttl)?;
    Ok((job_name, period, ttl))
}

async fn acquire(client: Client, key: String, how: Acquire) -> PyResult<LockGuard> {
    let held = match how.permits {
        None => format!("{key:?} is held by another owner"),
        Some(n) => format!("all {n} permits of {key:?} are held by other owners"),
    };
    match client.acquire(&key, how).await.map_err(to_py)? {
        Some(guard) => Ok(LockGuard::new(guard)),
        None if how.wait.is_zero() => Err(LockHeld::new_err(format!(
            "lock held: {held}; skip this run, or pass wait= to wait for it"
        ))),
        None => Err(LockHeld::new_err(format!(
            "lock held: {held}, still after waiting {:?}",
            how.wait
        ))),
    }
}

#[pymethods]
impl Locker {
    /// Takes the lock `key` for `ttl` seconds, renewed in the background
    /// until released. Raises `LockHeld` if another owner holds it (after
    /// waiting up to `wait` seconds, if given). Use it as a context manager.
    /// With `permits=N`, takes one of N permits of the semaphore `key`
    /// instead (at most N holders at once; its own name space).
    // One parameter per Python argument: the signature is the API.
    #[expect(clippy::too_many_arguments)]
    #[pyo3(signature = (key, ttl, wait=None, *, max_hold=None, hold_at_least=None, permits=None))]
    fn lock(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        ttl: &Bound<'_, PyAny>,
        wait: Option<&Bound<'_, PyAny>>,
        max_hold: Option<&Bound<'_, PyAny>>,
        hold_at_least: Option<&Bound<'_, PyAny>>,
        permits: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<LockGuard> {
        let key = check::key(key, "key")?;
        let client = self.client(py)?;
        let how = acquire_options(ttl, wait, max_hold, hold_at_least, permits, Some(&client))?;
        runtime::block_on(py, acquire(client, key, how))?
    }

    /// `lock` for asyncio: `guard = await locker.lock_async(...)` or
    /// `async with locker.lock_async(...) as guard:`.
    // One parameter per Python argument: the signature is the API.
    #[expect(clippy::too_many_arguments)]
    #[pyo3(signature = (key, ttl, wait=None, *, max_hold=None, hold_at_least=None, permits=None))]
    fn lock_async<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        ttl: &Bound<'py, PyAny>,
        wait: Option<&Bound<'py, PyAny>>,
        max_hold: Option<&Bound<'py, PyAny>>,
        hold_at_least: Option<&Bound<'py, PyAny>>,
        permits: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let key = check::key(key, "key")?;
        let client = self.client(py)?;
        let how = acquire_options(ttl, wait, max_hold, hold_at_least, permits, Some(&client))?;
        let request = LockRequest { client, key, how };
        let start = Bound::new(py, request)?.getattr("_start")?;
        aio(py)?.getattr("AsyncAcquire")?.call1((start,))
    }

    /// Runs `func(*args, **kwargs)` for the fire of `job_name` at
    /// `fire_time` unless another instance already ran that fire (or the
    /// previous run is still going). Returns a `FireOutcome`; exceptions of
    /// `func` propagate.
    #[pyo3(signature = (job_name, period, fire_time, func, *args, **kwargs))]
    #[allow(clippy::too_many_arguments)]
    fn run_once_per_fire(
        &self,
        py: Python<'_>,
        job_name: &Bound<'_, PyAny>,
        period: &Bound<'_, PyAny>,
        fire_time: Option<&Bound<'_, PyAny>>,
        func: &Bound<'_, PyAny>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<FireOutcome> {
        self.run_once_per_fire_with(py, job_name, period, fire_time, None, func, args, kwargs)
    }

    /// `run_once_per_fire` with the running lock's TTL (`None`: min(30 s,
    /// period)); `args` and `kwargs` are passed as they are, so `func` may
    /// take an argument called `ttl`.
    #[pyo3(signature = (job_name, period, fire_time, ttl, func, args, kwargs=None))]
    #[allow(clippy::too_many_arguments)]
    fn run_once_per_fire_with(
        &self,
        py: Python<'_>,
        job_name: &Bound<'_, PyAny>,
        period: &Bound<'_, PyAny>,
        fire_time: Option<&Bound<'_, PyAny>>,
        ttl: Option<&Bound<'_, PyAny>>,
        func: &Bound<'_, PyAny>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<FireOutcome> {
        let (job_name, period, ttl) = schedule(period, ttl, Some(job_name))?;
        let fire = convert::fire_time(fire_time)?;
        if !func.is_callable() {
            return Err(invalid_input("func is not callable"));
        }
        let client = self.client(py)?;
        type Reply = oneshot::Sender<PyResult<Py<PyAny>>>;
        let (start_tx, start_rx) = oneshot::channel::<(Held, Reply)>();
        let task = AbortOnDrop(runtime::handle()?.spawn(async move {
            client
                .run_once_per_fire(&job_name, period, ttl, fire, |held| async move {
                    let (reply_tx, reply_rx) = oneshot::channel();
                    start_tx.send((held, reply_tx)).ok()?;
                    reply_rx.await.ok()
                })
                .await
        }));
        enum Step<T> {
            Start(Held, Reply),
            Finished(T),
        }
        let mut task = task;
        let step = runtime::block_on(py, async {
            tokio::pin!(start_rx);
            tokio::select! {
                Ok((held, reply)) = &mut start_rx => Step::Start(held, reply),
                finished = &mut task.0 => Step::Finished(finished),
            }
        })?;
        let finished = match step {
            Step::Finished(finished) => finished,
            Step::Start(held, reply) => {
                let lock = Py::new(py, LockGuard::job(held))?;
                let _ = reply.send(call_with_lock(py, lock, func, args, kwargs));
                runtime::block_on(py, &mut task.0)?
            }
        };
        let outcome = finished
            .map_err(|e| {
                pyo3::exceptions::PyRuntimeError::new_err(format!("distlock task failed: {e}"))
            })?
            .map_err(to_py)?;
        FireOutcome::from_outcome(py, outcome)
    }

    /// Who holds `key`: `None` if nobody, else a `LockInfo`. An operator
    /// call (status pages, stuck locks): the answer is stale as soon as it
    /// arrives, so never decide whether to run a job by it.
    fn inspect(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<LockInfo>> {
        let key = check::key(key, "key")?;
        let client = self.client(py)?;
        let holder =
            runtime::block_on(py, async move { client.inspect(&key).await })?.map_err(to_py)?;
        Ok(holder.map(|holder| LockInfo {
            fencing_token: holder.fencing_token,
            expires_in: holder.expires_in.map(|left| left.as_secs_f64()),
        }))
    }

    /// Deletes the lock at `key` whoever holds it, waking its waiters;
    /// returns whether one was held. The holder learns at its next renewal
    /// that it lost the lock. An operator call, for stuck locks.
    fn force_release(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = check::key(key, "key")?;
        let client = self.client(py)?;
        runtime::block_on(py, async move { client.force_release(&key).await })?.map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!("Locker({:?})", redact(&self.url))
    }
}

/// Who holds a lock, as `Locker.inspect` read it.
#[pyclass(module = "distlock", frozen, get_all)]
struct LockInfo {
    /// The holder's fencing token.
    fencing_token: u64,
    /// Seconds left on the holder's lease by the server's clock (renewal
    /// extends it), or `None` if the backend does not tell.
    expires_in: Option<f64>,
}

#[pymethods]
impl LockInfo {
    fn __repr__(&self) -> String {
        match self.expires_in {
            Some(left) => format!(
                "LockInfo(fencing_token={}, expires_in={left:.3})",
                self.fencing_token
            ),
            None => format!("LockInfo(fencing_token={})", self.fencing_token),
        }
    }
}

/// Aborts the task when the caller stops waiting for it (a signal).
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The URL with its password replaced by `***`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            format!("{scheme}://{user}:***@{host}{tail}")
        }
        None => url.to_owned(),
    }
}

/// A validated `lock_async` request, started by the asyncio side.
#[pyclass(module = "distlock", frozen)]
struct LockRequest {
    client: Client,
    key: String,
    how: Acquire,
}

#[pymethods]
impl LockRequest {
    fn _start(&self, done: Py<PyAny>) -> PyResult<TaskHandle> {
        let future = acquire(self.client.clone(), self.key.clone(), self.how);
        Ok(TaskHandle(runtime::spawn_with_callback(future, done)?))
    }
}

/// A running asyncio operation; `cancel()` drops it (cancel-safe).
#[pyclass(module = "distlock", frozen)]
struct TaskHandle(JoinHandle<()>);

#[pymethods]
impl TaskHandle {
    fn cancel(&self) {
        self.0.abort();
    }
}

/// A held lock: renews itself in the background, tells when it is lost,
/// releases on `release()` or at the end of a `with` / `async with` block.
#[pyclass(module = "distlock", frozen)]
struct LockGuard {
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
    fn new(guard: backend::LockGuard) -> Self {
        Self {
            held: Held::of(&guard),
            guard: Mutex::new(Some(guard)),
            owned: true,
            pid: std::process::id(),
        }
    }

    fn job(held: Held) -> Self {
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
fn drop_in_runtime(guard: backend::LockGuard) {
    match runtime::handle() {
        Ok(handle) => {
            let _context = handle.enter();
            drop(guard);
        }
        // No runtime: the lock expires after its TTL.
        Err(_) => drop(guard),
    }
}

/// How one `run_once_per_fire` call ended on this instance.
#[pyclass(module = "distlock", frozen, get_all)]
struct FireOutcome {
    /// Whether `func` ran here.
    ran: bool,
    /// What `func` returned (`None` if it did not run).
    value: Py<PyAny>,
    /// Why the fire was skipped: `"fire_already_taken"` or
    /// `"previous_still_running"`; `None` if it ran.
    skipped: Option<&'static str>,
    /// Why the lock was lost while `func` ran, or `None`.
    lost: Option<String>,
    /// The fencing token of the run, or `None`.
    fencing_token: Option<u64>,
    /// How long `func` ran, in seconds, or `None`.
    duration: Option<f64>,
}

impl FireOutcome {
    fn from_outcome(
        py: Python<'_>,
        outcome: ScheduledOutcome<Option<PyResult<Py<PyAny>>>>,
    ) -> PyResult<Self> {
        let skipped = |reason| Self {
            ran: false,
            value: py.None(),
            skipped: Some(reason),
            lost: None,
            fencing_token: None,
            duration: None,
        };
        let gone = || pyo3::exceptions::PyRuntimeError::new_err("the job's result was lost");
        Ok(match outcome {
            ScheduledOutcome::Ran {
                output,
                duration,
                fencing_token,
            } => Self {
                ran: true,
                value: output.ok_or_else(gone)??,
                skipped: None,
                lost: None,
                fencing_token: Some(fencing_token.get()),
                duration: Some(duration.as_secs_f64()),
            },
            ScheduledOutcome::Skipped(backend::SkipReason::FireAlreadyTaken) => {
                skipped("fire_already_taken")
            }
            ScheduledOutcome::Skipped(_) => skipped("previous_still_running"),
            ScheduledOutcome::Lost {
                output,
                fencing_token,
                reason,
            } => Self {
                ran: true,
                value: output.flatten().ok_or_else(gone)??,
                skipped: None,
                lost: Some(lost_text(&reason)),
                fencing_token: Some(fencing_token.get()),
                duration: None,
            },
        })
    }
}

#[pymethods]
impl FireOutcome {
    fn __repr__(&self) -> String {
        match (self.skipped, &self.lost) {
            (Some(reason), _) => format!("FireOutcome(skipped={reason:?})"),
            (None, Some(lost)) => format!(
                "FireOutcome(ran=True, lost={lost:?}, fencing_token={})",
                self.fencing_token.unwrap_or_default()
            ),
            (None, None) => format!(
                "FireOutcome(ran=True, fencing_token={}, duration={:.3})",
                self.fencing_token.unwrap_or_default(),
                self.duration.unwrap_or_default()
            ),
        }
    }
}

#[pymodule]
fn _distlock(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(connect, module)?)?;
    module.add_function(wrap_pyfunction!(job_key, module)?)?;
    module.add_function(wrap_pyfunction!(current_lock, module)?)?;
    module.add_function(wrap_pyfunction!(_check_lock_options, module)?)?;
    module.add_function(wrap_pyfunction!(_check_schedule, module)?)?;
    module.add_function(wrap_pyfunction!(log::_stop_logging, module)?)?;
    module.add_function(wrap_pyfunction!(log::_refresh_logging, module)?)?;
    log::install(module.py())?;
    module.add_class::<Locker>()?;
    module.add_class::<LockInfo>()?;
    module.add_class::<LockGuard>()?;
    module.add_class::<FireOutcome>()?;
    module.add("_current_lock", current_lock_var(module.py())?)?;
    errors::register(module)?;
    Ok(())
}
