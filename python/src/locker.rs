//! `Locker`: the client Python code holds, its acquisitions and schedules,
//! and what `inspect` reads.

use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::backend::{self, Acquire, Client, Held, Holding};
use crate::election::{self, LeaderWatch, Leadership, PyLeader};
use crate::errors::{invalid_input, to_py, LockHeld};
use crate::fire::FireOutcome;
use crate::guard::LockGuard;
use crate::{aio, call_with_lock, check, convert, runtime};

/// A connection to one lock server; create it with `distlock.connect(url)`.
#[pyclass(module = "distlock", frozen)]
pub(crate) struct Locker {
    pub(crate) url: String,
    /// The client and the process that opened it (a forked child reconnects).
    pub(crate) client: Mutex<(u32, Client)>,
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
pub(crate) fn acquire_options(
    ttl: &Bound<'_, PyAny>,
    wait: Option<&Bound<'_, PyAny>>,
    max_hold: Option<&Bound<'_, PyAny>>,
    hold_at_least: Option<&Bound<'_, PyAny>>,
    permits: Option<&Bound<'_, PyAny>>,
    holder: Option<&Bound<'_, PyAny>>,
    client: Option<&Client>,
) -> PyResult<Acquire> {
    let how = Acquire {
        ttl: convert::duration(ttl, "ttl")?,
        wait: convert::optional_duration(wait, "wait")?.unwrap_or(Duration::ZERO),
        max_hold: convert::optional_duration(max_hold, "max_hold")?,
        hold_at_least: convert::optional_duration(hold_at_least, "hold_at_least")?,
        permits: check::permits(permits)?,
        holder: check::optional_holder(holder, "holder")?,
    };
    check::acquire(&how, client.map(Client::max_ttl))?;
    Ok(how)
}

/// Checks lock options as `Locker.lock` would, without a server (the
/// Celery decorators call it when decorating).
#[pyfunction]
#[pyo3(signature = (ttl, wait=None, max_hold=None, hold_at_least=None))]
pub(crate) fn _check_lock_options(
    ttl: &Bound<'_, PyAny>,
    wait: Option<&Bound<'_, PyAny>>,
    max_hold: Option<&Bound<'_, PyAny>>,
    hold_at_least: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    acquire_options(ttl, wait, max_hold, hold_at_least, None, None, None).map(|_| ())
}

/// Checks a schedule as `Locker.run_once_per_fire` would (`job_name` may
/// be `None` when the name is not known yet).
#[pyfunction]
#[pyo3(signature = (period, ttl=None, job_name=None))]
pub(crate) fn _check_schedule(
    period: &Bound<'_, PyAny>,
    ttl: Option<&Bound<'_, PyAny>>,
    job_name: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    schedule(period, ttl, job_name).map(|_| ())
}

/// A checked schedule: job name, period, running lock TTL.
pub(crate) fn schedule(
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

pub(crate) async fn acquire(client: Client, key: String, how: Acquire) -> PyResult<LockGuard> {
    let held = match how.permits {
        None => format!("{key:?} is held by another owner"),
        Some(n) => format!("all {n} permits of {key:?} are held by other owners"),
    };
    let wait = how.wait;
    match client.acquire(&key, how).await.map_err(to_py)? {
        Some(guard) => Ok(LockGuard::new(Holding::Lock(guard))),
        None if wait.is_zero() => Err(LockHeld::new_err(format!(
            "lock held: {held}; skip this run, or pass wait= to wait for it"
        ))),
        None => Err(LockHeld::new_err(format!(
            "lock held: {held}, still after waiting {:?}",
            wait
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
    /// `holder` labels the lock for people reading who holds it
    /// (`inspect`).
    // One parameter per Python argument: the signature is the API.
    #[expect(clippy::too_many_arguments)]
    #[pyo3(signature = (key, ttl, wait=None, *, max_hold=None, hold_at_least=None, permits=None, holder=None))]
    fn lock(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        ttl: &Bound<'_, PyAny>,
        wait: Option<&Bound<'_, PyAny>>,
        max_hold: Option<&Bound<'_, PyAny>>,
        hold_at_least: Option<&Bound<'_, PyAny>>,
        permits: Option<&Bound<'_, PyAny>>,
        holder: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<LockGuard> {
        let request = self.request(py, key, ttl, wait, max_hold, hold_at_least, permits, holder)?;
        runtime::block_on(py, request.run())?
    }

    /// `lock` for asyncio: `guard = await locker.lock_async(...)` or
    /// `async with locker.lock_async(...) as guard:`.
    // One parameter per Python argument: the signature is the API.
    #[expect(clippy::too_many_arguments)]
    #[pyo3(signature = (key, ttl, wait=None, *, max_hold=None, hold_at_least=None, permits=None, holder=None))]
    fn lock_async<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        ttl: &Bound<'py, PyAny>,
        wait: Option<&Bound<'py, PyAny>>,
        max_hold: Option<&Bound<'py, PyAny>>,
        hold_at_least: Option<&Bound<'py, PyAny>>,
        permits: Option<&Bound<'py, PyAny>>,
        holder: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let request = self.request(py, key, ttl, wait, max_hold, hold_at_least, permits, holder)?;
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
            holder: holder.holder,
        }))
    }

    /// The live permits of the semaphore `key` (`lock(key, permits=N)`),
    /// oldest first: a list of `PermitInfo`, empty if none is held. An
    /// operator call, like `inspect`.
    fn inspect_permits(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Vec<PermitInfo>> {
        let key = check::key(key, "key")?;
        let client = self.client(py)?;
        let permits = runtime::block_on(py, async move { client.inspect_permits(&key).await })?
            .map_err(to_py)?;
        Ok(permits
            .into_iter()
            .map(|permit| PermitInfo {
                fencing_token: permit.holder.fencing_token,
                expires_in: permit.holder.expires_in.map(|left| left.as_secs_f64()),
                limit: permit.limit,
                holder: permit.holder.holder,
            })
            .collect())
    }

    /// Campaigns for leadership of the election `key` as `identity` (a
    /// label; `None`: this host's name and pid), with leases of `ttl`
    /// seconds renewed in the background; waits until this candidate leads
    /// (`timeout=None`: however long) and returns its `Leadership`. Raises
    /// `LockHeld` if another candidate still leads after `timeout`.
    #[pyo3(signature = (key, identity, ttl, timeout=None))]
    fn campaign(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        identity: Option<&Bound<'_, PyAny>>,
        ttl: &Bound<'_, PyAny>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Leadership> {
        let campaign = election::Campaign::new(self.client(py)?, key, identity, ttl, timeout)?;
        runtime::block_on(py, campaign.run())?
    }

    /// `campaign` for asyncio: `leadership = await locker.campaign_async(...)`
    /// or `async with locker.campaign_async(...) as leadership:`.
    #[pyo3(signature = (key, identity, ttl, timeout=None))]
    fn campaign_async<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        identity: Option<&Bound<'py, PyAny>>,
        ttl: &Bound<'py, PyAny>,
        timeout: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let campaign = election::Campaign::new(self.client(py)?, key, identity, ttl, timeout)?;
        let start = Bound::new(py, campaign)?.getattr("_start")?;
        aio(py)?.getattr("AsyncAcquire")?.call1((start,))
    }

    /// Who leads the election `key` now: `None` if nobody, else a
    /// `Leader`. Stale as soon as it arrives; `observe` follows changes.
    fn leader(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<PyLeader>> {
        let key = check::key(key, "key")?;
        let client = self.client(py)?;
        election::leader(py, client, key)
    }

    /// `leader` for asyncio: `leader = await locker.leader_async(key)`.
    fn leader_async<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let key = check::key(key, "key")?;
        let client = self.client(py)?;
        election::leader_async(py, client, key)
    }

    /// Follows who leads the election `key`: iterate the returned
    /// `LeaderWatch` (`for` or `async for`) for each change, `None` when
    /// vacant. It reads at least every `poll_interval` seconds.
    #[pyo3(signature = (key, poll_interval=None))]
    fn observe(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        poll_interval: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<LeaderWatch> {
        let key = check::key(key, "key")?;
        let poll = convert::optional_duration(poll_interval, "poll_interval")?;
        LeaderWatch::new(self.client(py)?, key, poll)
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
pub(crate) struct LockInfo {
    /// The holder's fencing token.
    fencing_token: u64,
    /// Seconds left on the holder's lease by the server's clock (renewal
    /// extends it), or `None` if the backend does not tell.
    expires_in: Option<f64>,
    /// The label the holder gave (`holder=`, a campaign's identity), or
    /// `None` if it gave none or the backend stores no labels.
    holder: Option<String>,
}

#[pymethods]
impl LockInfo {
    fn __repr__(&self) -> String {
        let mut repr = format!("LockInfo(fencing_token={}", self.fencing_token);
        if let Some(left) = self.expires_in {
            repr += &format!(", expires_in={left:.3}");
        }
        if let Some(holder) = &self.holder {
            repr += &format!(", holder={holder:?}");
        }
        repr + ")"
    }
}

/// One live permit of a semaphore, as `Locker.inspect_permits` read it.
#[pyclass(module = "distlock", frozen, get_all)]
pub(crate) struct PermitInfo {
    /// The permit's fencing token.
    fencing_token: u64,
    /// Seconds left on the permit's lease by the server's clock (renewal
    /// extends it), or `None` if the backend does not tell.
    expires_in: Option<f64>,
    /// The number of permits the semaphore was held under.
    limit: u32,
    /// The label the holder gave (`holder=`), or `None` if it gave none or
    /// the backend stores no permit labels.
    holder: Option<String>,
}

#[pymethods]
impl PermitInfo {
    fn __repr__(&self) -> String {
        let mut repr = format!(
            "PermitInfo(fencing_token={}, limit={}",
            self.fencing_token, self.limit
        );
        if let Some(left) = self.expires_in {
            repr += &format!(", expires_in={left:.3}");
        }
        if let Some(holder) = &self.holder {
            repr += &format!(", holder={holder:?}");
        }
        repr + ")"
    }
}

/// Aborts the task when the caller stops waiting for it (a signal).
pub(crate) struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The URL with its password replaced by `***`.
pub(crate) fn redact(url: &str) -> String {
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
pub(crate) struct LockRequest {
    client: Client,
    key: String,
    how: Acquire,
}

impl Locker {
    /// The checked request of `lock` and `lock_async`.
    #[expect(clippy::too_many_arguments)]
    fn request(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        ttl: &Bound<'_, PyAny>,
        wait: Option<&Bound<'_, PyAny>>,
        max_hold: Option<&Bound<'_, PyAny>>,
        hold_at_least: Option<&Bound<'_, PyAny>>,
        permits: Option<&Bound<'_, PyAny>>,
        holder: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<LockRequest> {
        let key = check::key(key, "key")?;
        let client = self.client(py)?;
        let how = acquire_options(
            ttl,
            wait,
            max_hold,
            hold_at_least,
            permits,
            holder,
            Some(&client),
        )?;
        Ok(LockRequest { client, key, how })
    }
}

impl LockRequest {
    fn run(&self) -> impl std::future::Future<Output = PyResult<LockGuard>> + Send + 'static {
        acquire(self.client.clone(), self.key.clone(), self.how.clone())
    }
}

#[pymethods]
impl LockRequest {
    fn _start(&self, done: Py<PyAny>) -> PyResult<TaskHandle> {
        Ok(TaskHandle(runtime::spawn_with_callback(self.run(), done)?))
    }
}

/// A running asyncio operation; `cancel()` drops it (cancel-safe).
#[pyclass(module = "distlock", frozen)]
pub(crate) struct TaskHandle(pub(crate) JoinHandle<()>);

#[pymethods]
impl TaskHandle {
    fn cancel(&self) {
        self.0.abort();
    }
}
