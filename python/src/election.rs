//! Leader election as Python sees it: `Locker.campaign` and its
//! `Leadership`, `Locker.leader` and its `Leader`, `Locker.observe` and its
//! `LeaderWatch`. A leadership is a lock labelled with the candidate's
//! identity (the Rust `Locker::campaign`), so its Python object is a
//! `LockGuard` underneath: the same renewal, lost signal, release and
//! cancel-safety.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::backend::{self, Acquire, Client, HolderId, Holding};
use crate::errors::{to_py, LockHeld};
use crate::guard::{self, LockGuard};
use crate::locker::TaskHandle;
use crate::{aio, check, convert, runtime};

/// A checked campaign: `Locker.campaign` runs it, `campaign_async`'s
/// awaitable starts it (each await anew).
#[pyclass(module = "distlock", frozen)]
pub(crate) struct Campaign {
    client: Client,
    key: String,
    identity: HolderId,
    ttl: Duration,
    timeout: Option<Duration>,
}

impl Campaign {
    pub(crate) fn new(
        client: Client,
        key: &Bound<'_, PyAny>,
        identity: Option<&Bound<'_, PyAny>>,
        ttl: &Bound<'_, PyAny>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let key = check::key(key, "key")?;
        let identity =
            check::optional_holder(identity, "identity")?.unwrap_or_else(HolderId::this_process);
        let ttl = convert::duration(ttl, "ttl")?;
        // A leadership's lease follows the lock rules (renewal every third,
        // the server's maximum).
        check::acquire(&Acquire::ttl_only(ttl), Some(client.max_ttl()))?;
        let timeout = convert::optional_duration(timeout, "timeout")?;
        Ok(Self {
            client,
            key,
            identity,
            ttl,
            timeout,
        })
    }

    /// Campaigns; the deadline counts from here, when the wait starts.
    pub(crate) fn run(
        &self,
    ) -> impl std::future::Future<Output = PyResult<Leadership>> + Send + 'static {
        let (client, key, identity, ttl, timeout) = (
            self.client.clone(),
            self.key.clone(),
            self.identity.clone(),
            self.ttl,
            self.timeout,
        );
        async move {
            // A timeout too long to count is no timeout.
            let deadline = timeout.and_then(|timeout| Instant::now().checked_add(timeout));
            match client
                .campaign(&key, &identity, ttl, deadline)
                .await
                .map_err(to_py)?
            {
                Some(leadership) => Ok(Leadership::new(leadership)),
                None => Err(LockHeld::new_err(format!(
                    "leadership held: another candidate still leads {key:?} after waiting {}",
                    check::seconds(timeout.unwrap_or_default())
                ))),
            }
        }
    }
}

#[pymethods]
impl Campaign {
    fn _start(&self, done: Py<PyAny>) -> PyResult<TaskHandle> {
        Ok(TaskHandle(runtime::spawn_with_callback(self.run(), done)?))
    }
}

/// This candidate leads: renews itself in the background, tells when
/// leadership is lost, resigns on `resign()` or at the end of a `with` /
/// `async with` block (or in the background when dropped).
#[pyclass(module = "distlock", frozen)]
pub(crate) struct Leadership {
    /// The leadership's lock.
    inner: LockGuard,
    identity: String,
}

impl Leadership {
    fn new(leadership: backend::Leadership) -> Self {
        let identity = leadership.identity().as_str().to_owned();
        Self {
            inner: LockGuard::new(Holding::Leadership(leadership)),
            identity,
        }
    }
}

#[pymethods]
impl Leadership {
    /// The election's key.
    #[getter]
    fn key(&self) -> &str {
        &self.inner.held.key
    }

    /// The term: strictly greater than every earlier leader's. Pass it to
    /// what the leader writes, so a deposed leader's late writes can be
    /// refused.
    #[getter]
    fn term(&self) -> u64 {
        self.inner.held.fencing_token
    }

    /// The label this candidate campaigned with.
    #[getter]
    fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether leadership is known or assumed lost.
    fn is_lost(&self) -> bool {
        self.inner.is_lost()
    }

    /// Why leadership was lost, or `None`.
    #[getter]
    fn lost_reason(&self) -> Option<String> {
        self.inner.lost_reason()
    }

    /// Raises `LockLost` if leadership is lost; call it before each write.
    fn raise_if_lost(&self) -> PyResult<()> {
        self.inner.raise_if_lost()
    }

    /// Blocks until leadership is lost or `timeout` seconds passed;
    /// returns `is_lost()`.
    #[pyo3(signature = (timeout=None))]
    fn wait_lost(&self, py: Python<'_>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        self.inner.wait_lost(py, timeout)
    }

    /// Steps down: releases the leadership's lock and wakes the next
    /// candidate. Raises `LockLost` if it was lost meanwhile; resigning
    /// twice does nothing.
    fn resign(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.release(py)
    }

    fn _release_start(&self, done: Py<PyAny>) -> PyResult<TaskHandle> {
        self.inner._release_start(done)
    }

    /// Resigns in the background (an abandoned asyncio campaign).
    fn _abandon(&self) {
        self.inner._abandon();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Resigns; if the block raised, its exception wins over a resign
    /// error.
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: &Bound<'_, PyAny>,
        exc: &Bound<'_, PyAny>,
        traceback: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.inner.__exit__(py, exc_type, exc, traceback)
    }

    fn __aenter__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        guard::aenter(slf.into_any())
    }

    fn __aexit__<'py>(
        slf: Bound<'py, Self>,
        exc_type: &Bound<'py, PyAny>,
        _exc: &Bound<'py, PyAny>,
        _traceback: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guard::aexit(slf.into_any(), exc_type)
    }

    fn __repr__(&self) -> String {
        format!(
            "Leadership(key={:?}, identity={:?}, term={}, {})",
            self.inner.held.key,
            self.identity,
            self.inner.held.fencing_token,
            match self.inner.state() {
                "released" => "resigned",
                state => state,
            }
        )
    }
}

/// Who leads an election, as the server said (`Locker.leader`,
/// `LeaderWatch`).
#[pyclass(module = "distlock", name = "Leader", frozen, eq, hash, get_all)]
#[derive(PartialEq, Eq, Hash)]
pub(crate) struct PyLeader {
    /// The leader's label, or `None` if the backend stores no labels.
    identity: Option<String>,
    /// The leadership's term (its lock's fencing token), greater than every
    /// earlier leader's.
    term: u64,
}

impl From<backend::Leader> for PyLeader {
    fn from(leader: backend::Leader) -> Self {
        Self {
            identity: leader.identity,
            term: leader.term,
        }
    }
}

#[pymethods]
impl PyLeader {
    fn __repr__(&self) -> String {
        match &self.identity {
            Some(identity) => format!("Leader(identity={identity:?}, term={})", self.term),
            None => format!("Leader(identity=None, term={})", self.term),
        }
    }
}

/// Who leads `key` now.
pub(crate) fn leader(py: Python<'_>, client: Client, key: String) -> PyResult<Option<PyLeader>> {
    let leader = runtime::block_on(py, async move { client.leader(&key).await })?;
    Ok(leader.map_err(to_py)?.map(PyLeader::from))
}

/// `leader` as an awaitable.
pub(crate) fn leader_async(
    py: Python<'_>,
    client: Client,
    key: String,
) -> PyResult<Bound<'_, PyAny>> {
    let start = Bound::new(py, LeaderRequest { client, key })?.getattr("_start")?;
    aio(py)?.getattr("run")?.call1((start,))
}

/// A `leader_async` read, started by the asyncio side.
#[pyclass(module = "distlock", frozen)]
pub(crate) struct LeaderRequest {
    client: Client,
    key: String,
}

#[pymethods]
impl LeaderRequest {
    fn _start(&self, done: Py<PyAny>) -> PyResult<TaskHandle> {
        let (client, key) = (self.client.clone(), self.key.clone());
        let read = async move {
            let leader = client.leader(&key).await.map_err(to_py)?;
            Ok(leader.map(PyLeader::from))
        };
        Ok(TaskHandle(runtime::spawn_with_callback(read, done)?))
    }
}

/// Follows who leads an election (`Locker.observe`): each step of `for` /
/// `async for` is the next change, a `Leader` or `None` (vacant).
#[pyclass(module = "distlock", frozen)]
pub(crate) struct LeaderWatch {
    key: String,
    /// Shared by the steps: a step's future must own what it reads, and
    /// one step runs at a time.
    watch: Arc<tokio::sync::Mutex<backend::LeaderWatch>>,
}

impl LeaderWatch {
    pub(crate) fn new(client: Client, key: String, poll: Option<Duration>) -> PyResult<Self> {
        let poll = poll.unwrap_or(distlock_core::DEFAULT_OBSERVE_POLL);
        let watch = client.observe(&key, poll).map_err(to_py)?;
        Ok(Self {
            key,
            watch: Arc::new(tokio::sync::Mutex::new(watch)),
        })
    }

    /// The next change (cancel-safe: a change read by a dropped step is
    /// answered by the next one).
    fn step(
        &self,
    ) -> impl std::future::Future<Output = PyResult<Option<PyLeader>>> + Send + 'static {
        let watch = Arc::clone(&self.watch);
        async move {
            let mut watch = watch.lock().await;
            let leader = backend::next_leader(&mut watch).await.map_err(to_py)?;
            Ok(leader.map(PyLeader::from))
        }
    }
}

#[pymethods]
impl LeaderWatch {
    /// The election's key.
    #[getter]
    fn key(&self) -> &str {
        &self.key
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Blocks (GIL released) until the next change; the first step
    /// answers at once. Never ends: stop iterating to stop observing.
    fn __next__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        // Not `Option`: pyo3 would end the iteration on a vacancy.
        match runtime::block_on(py, self.step())?? {
            Some(leader) => Ok(Py::new(py, leader)?.into_any()),
            None => Ok(py.None()),
        }
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// The next change, as an awaitable.
    fn __anext__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let start = slf.getattr("_next_start")?;
        aio(slf.py())?.getattr("run")?.call1((start,))
    }

    fn _next_start(&self, done: Py<PyAny>) -> PyResult<TaskHandle> {
        Ok(TaskHandle(runtime::spawn_with_callback(self.step(), done)?))
    }

    fn __repr__(&self) -> String {
        format!("LeaderWatch(key={:?})", self.key)
    }
}
