//! The exception hierarchy: `LockError` and one subclass per error kind.
//! Bad arguments are refused by the binding itself (`check`), in Python's
//! words; errors from the lock servers carry the Rust message, which names
//! the server and what to do.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use crate::backend::{ErrorKind, LockError as RustLockError, LostReason};

create_exception!(
    distlock,
    LockError,
    PyException,
    "Base class of every distlock error; each subclass is one kind of failure."
);
create_exception!(
    distlock,
    InvalidInput,
    LockError,
    "A bad argument (empty or oversized key, non-positive TTL, ...); retrying cannot help."
);
create_exception!(
    distlock,
    NotHeld,
    LockError,
    "The lock is no longer held: released, expired, or taken over."
);
create_exception!(
    distlock,
    LockLost,
    NotHeld,
    "The guard lost its lock (renewal refused, or the lease ran out) before it was released."
);
create_exception!(
    distlock,
    LockHeld,
    LockError,
    "Another owner holds the lock (after waiting up to `wait` seconds, if given)."
);
create_exception!(
    distlock,
    Unavailable,
    LockError,
    "The lock server could not be reached or refused the connection; retrying later may help."
);
create_exception!(
    distlock,
    Timeout,
    LockError,
    "A server operation did not finish within its timeout; whether it took effect is unknown."
);
create_exception!(
    distlock,
    Corrupted,
    LockError,
    "A value at a lock key was not written by distlock; it is reported, never overwritten."
);
create_exception!(
    distlock,
    ConfigError,
    LockError,
    "A bad lock URL or a backend this build does not include."
);
create_exception!(
    distlock,
    Unsupported,
    LockError,
    "The backend does not implement this optional operation."
);

/// The Python exception for a Rust error, with the Rust message.
pub fn to_py(error: RustLockError) -> PyErr {
    let mut message = error.to_string();
    if error.kind() == ErrorKind::Timeout && message.contains("too late to use") {
        // The Rust wording names the guard's stop margin and Rust durations.
        message = "timeout: the lock was granted too late to use: less than a third of its ttl was \
                   left when the server's answer arrived. It was released and nothing ran; the server \
                   or network is too slow for this ttl: retry, or use a longer ttl"
            .to_owned();
    }
    match error.kind() {
        ErrorKind::InvalidInput => InvalidInput::new_err(message),
        ErrorKind::NotHeld => NotHeld::new_err(message),
        ErrorKind::Unavailable => Unavailable::new_err(message),
        ErrorKind::Timeout => Timeout::new_err(message),
        ErrorKind::Corrupted => Corrupted::new_err(message),
        ErrorKind::Config => ConfigError::new_err(message),
        ErrorKind::Unsupported => Unsupported::new_err(message),
        _ => LockError::new_err(message),
    }
}

/// Why a lock was lost, worded for Python (the Rust wording names the
/// guard's stop margin, which Python does not expose).
pub fn lost_text(reason: &LostReason) -> String {
    match reason {
        LostReason::Refused => {
            "the server refused renewal (the lock was deleted or taken over)".to_owned()
        }
        LostReason::Expired => "its lease was about to run out and could not be renewed in time \
             (server unreachable or slow, or max_hold reached)"
            .to_owned(),
        other => other.to_string(),
    }
}

/// An `InvalidInput` for a bad argument, worded like the Rust errors.
pub fn invalid_input(message: impl std::fmt::Display) -> PyErr {
    InvalidInput::new_err(format!("invalid input: {message}"))
}

/// Adds the exception classes to the module.
pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    module.add("LockError", py.get_type::<LockError>())?;
    module.add("InvalidInput", py.get_type::<InvalidInput>())?;
    module.add("NotHeld", py.get_type::<NotHeld>())?;
    module.add("LockLost", py.get_type::<LockLost>())?;
    module.add("LockHeld", py.get_type::<LockHeld>())?;
    module.add("Unavailable", py.get_type::<Unavailable>())?;
    module.add("Timeout", py.get_type::<Timeout>())?;
    module.add("Corrupted", py.get_type::<Corrupted>())?;
    module.add("ConfigError", py.get_type::<ConfigError>())?;
    module.add("Unsupported", py.get_type::<Unsupported>())?;
    Ok(())
}
