//! `distlock._distlock`: the Python extension module of distlock.
//!
//! Every operation runs the Rust library (through the `backend` module) on a tokio
//! runtime of this process, with the GIL released while it waits on the
//! server. The asyncio glue and the Celery helpers are in the Python package
//! around this module (`python/distlock`).

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};

mod backend;
mod check;
mod convert;
mod election;
mod errors;
mod fire;
mod guard;
mod locker;
mod log;
mod runtime;

use election::{LeaderWatch, Leadership, PyLeader};
use fire::FireOutcome;
use guard::LockGuard;
use locker::{_check_lock_options, _check_schedule, LockInfo, Locker, PermitInfo};

use errors::{invalid_input, to_py};

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
    module.add_class::<PermitInfo>()?;
    module.add_class::<LockGuard>()?;
    module.add_class::<FireOutcome>()?;
    module.add_class::<Leadership>()?;
    module.add_class::<PyLeader>()?;
    module.add_class::<LeaderWatch>()?;
    module.add("_current_lock", current_lock_var(module.py())?)?;
    errors::register(module)?;
    Ok(())
}
