//! Argument checks worded for Python. Every argument the Rust API could
//! refuse is checked here first, naming the Python argument and its Python
//! type, so a Python user never sees a message written for Rust callers
//! (Rust type names, `Duration` formatting, options Python does not have).

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::backend::{Acquire, HolderId, MAX_HOLDER_BYTES, SCHEDULE_SUFFIX_BYTES};
use crate::convert::type_name;
use crate::errors::invalid_input;

/// The longest key any backend stores, in UTF-8 bytes.
pub const MAX_KEY_BYTES: usize = distlock::MAX_KEY_BYTES;

/// Seconds as Python users write them: `0.5 s`, `30 s`.
pub fn seconds(duration: Duration) -> String {
    format!("{} s", duration.as_secs_f64())
}

/// A `str` argument.
pub fn string(value: &Bound<'_, PyAny>, what: &str, example: &str) -> PyResult<String> {
    match value.cast::<PyString>() {
        Ok(text) => text.extract::<String>(),
        Err(_) => Err(invalid_input(format!(
            "{what} must be a str ({example}), not {}",
            type_name(value)
        ))),
    }
}

/// A semaphore's number of permits: an `int` from 1 to 2^32 - 1 (`None`:
/// the lock itself).
pub fn permits(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u32>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    // bool is an int subclass in Python, and never meant as a count here.
    if value.is_instance_of::<pyo3::types::PyBool>()
        || !value.is_instance_of::<pyo3::types::PyInt>()
    {
        return Err(invalid_input(format!(
            "permits must be an int (how many holders at once), not {}",
            type_name(value)
        )));
    }
    match value.extract::<i64>() {
        Ok(n) if n >= 1 => u32::try_from(n).map(Some).map_err(|_| {
            invalid_input(format!("permits of {n} is above the limit of {}", u32::MAX))
        }),
        Ok(n) => Err(invalid_input(format!(
            "permits of {n} can never let anything run; give at least 1, or leave it None for the lock itself"
        ))),
        Err(_) => Err(invalid_input(format!(
            "permits is above the limit of {}",
            u32::MAX
        ))),
    }
}

/// A holder label (`holder=`, `identity=`): a non-empty `str` of at most
/// 128 UTF-8 bytes without control characters, so it prints on one line.
/// For people reading who holds a lock; never proof of ownership.
pub fn holder(value: &Bound<'_, PyAny>, what: &str) -> PyResult<HolderId> {
    let label = string(
        value,
        what,
        "a label for people, such as a host name and pid or a pod name",
    )?;
    if label.is_empty() {
        return Err(invalid_input(format!(
            "{what} is empty; name the holder (a host name and pid, a pod name), or leave it None"
        )));
    }
    if label.len() > MAX_HOLDER_BYTES {
        return Err(invalid_input(format!(
            "{what} is {} bytes in UTF-8, the limit is {MAX_HOLDER_BYTES}; use a shorter label",
            label.len()
        )));
    }
    if let Some(c) = label.chars().find(|c| c.is_control()) {
        // Written as Python's repr() writes it.
        let shown = match c {
            '\n' => "\\n".to_owned(),
            '\r' => "\\r".to_owned(),
            '\t' => "\\t".to_owned(),
            c if u32::from(c) < 0x100 => format!("\\x{:02x}", u32::from(c)),
            c => format!("\\u{:04x}", u32::from(c)),
        };
        return Err(invalid_input(format!(
            "{what} contains the control character '{shown}'; a label must print on one line, \
             use printable characters only"
        )));
    }
    // The same rules as the Rust type's, so this cannot fail; its error
    // stays typed all the same.
    HolderId::new(label).map_err(crate::errors::to_py)
}

/// An optional holder label (`None` stays `None`).
pub fn optional_holder(value: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<HolderId>> {
    value
        .filter(|value| !value.is_none())
        .map(|value| holder(value, what))
        .transpose()
}

/// A lock key: a non-empty `str` of at most 512 UTF-8 bytes without NUL.
pub fn key(value: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    let key = string(value, what, "the lock's name, such as 'nightly-report'")?;
    key_text(&key, what)?;
    Ok(key)
}

/// The checks of [`key`] on a string.
pub fn key_text(key: &str, what: &str) -> PyResult<()> {
    if key.is_empty() {
        return Err(invalid_input(format!(
            "{what} is empty; give the lock a non-empty name"
        )));
    }
    if key.contains('\0') {
        return Err(invalid_input(format!(
            "{what} contains a NUL character ('\\0'), which no lock server can store"
        )));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(invalid_input(format!(
            "{what} is {} bytes in UTF-8, the limit is {MAX_KEY_BYTES}; use a shorter name, or \
             distlock.job_key(name, args), which hashes the long parts",
            key.len()
        )));
    }
    Ok(())
}

/// The durations of one acquisition; `max_ttl` is the backend's limit when
/// the client is known.
pub fn acquire(how: &Acquire, max_ttl: Option<Duration>) -> PyResult<()> {
    if how.ttl.is_zero() {
        return Err(invalid_input(
            "ttl is 0; give the lock a positive time to live in seconds (it is renewed while held)",
        ));
    }
    if how.max_hold.is_some_and(|max| max.is_zero()) {
        return Err(invalid_input(
            "max_hold is 0; leave it None for no limit, or give the longest time in seconds a job may hold the lock",
        ));
    }
    if !how.is_valid() {
        // Renewal every third of the lease and a stop a third of the lease
        // before it may expire leave no time below about 6 ms.
        return Err(match how.max_hold.filter(|max| *max < how.ttl) {
            Some(max) => invalid_input(format!(
                "max_hold of {} is too short to hold a lock at all; give at least 0.01 s",
                seconds(max)
            )),
            None => invalid_input(format!(
                "ttl of {} is too short: the lock is renewed every third of its ttl and given up a third \
                 of its ttl before it could expire; give at least 0.01 s (seconds in practice)",
                seconds(how.ttl)
            )),
        });
    }
    if let Some(max_ttl) = max_ttl {
        if how.ttl > max_ttl {
            return Err(invalid_input(format!(
                "ttl of {} is above this lock server's maximum of {}; use a shorter ttl (the lock is renewed while held)",
                seconds(how.ttl),
                seconds(max_ttl)
            )));
        }
        if let Some(min) = how.hold_at_least.filter(|min| *min > max_ttl) {
            return Err(invalid_input(format!(
                "hold_at_least of {} is above this lock server's maximum of {}; use a shorter hold_at_least",
                seconds(min),
                seconds(max_ttl)
            )));
        }
    }
    Ok(())
}

/// A schedule: its job name, period and running lock's TTL.
pub fn schedule(job_name: &str, period: Duration, ttl: Option<Duration>) -> PyResult<()> {
    if period.is_zero() {
        return Err(invalid_input(
            "period is 0; give the schedule's period in seconds (how often the scheduler fires the job)",
        ));
    }
    key_text(job_name, "job_name")?;
    let limit = MAX_KEY_BYTES - SCHEDULE_SUFFIX_BYTES;
    if job_name.len() > limit {
        return Err(invalid_input(format!(
            "job_name is {} bytes in UTF-8; with the fire number appended the limit is {limit}",
            job_name.len()
        )));
    }
    if let Some(ttl) = ttl {
        acquire(&Acquire::ttl_only(ttl), None)?;
    }
    Ok(())
}
