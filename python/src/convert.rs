//! Python values to the Rust types the API takes: durations, fire times,
//! and job arguments as JSON.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::{Map, Number, Value};

use crate::errors::invalid_input;

/// Seconds as an `int`, a `float` or a `datetime.timedelta`.
pub fn duration(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Duration> {
    let seconds = seconds(value, what, "a number of seconds or a datetime.timedelta")?;
    if seconds < 0.0 {
        return Err(invalid_input(format!(
            "{what} is negative ({seconds} s); give a positive number of seconds"
        )));
    }
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| invalid_input(format!("{what} of {seconds} s is too long")))
}

/// An optional duration (`None` stays `None`).
pub fn optional_duration(
    value: Option<&Bound<'_, PyAny>>,
    what: &str,
) -> PyResult<Option<Duration>> {
    value
        .filter(|value| !value.is_none())
        .map(|value| duration(value, what))
        .transpose()
}

/// A fire time: `None` (now), a `datetime` (naive ones are local time, as
/// `datetime.timestamp()` reads them) or seconds since the Unix epoch.
pub fn fire_time(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<SystemTime>> {
    let Some(value) = value.filter(|value| !value.is_none()) else {
        return Ok(None);
    };
    let seconds = if value.hasattr("timestamp")? {
        value.call_method0("timestamp")?.extract::<f64>()?
    } else {
        seconds(
            value,
            "fire_time",
            "a datetime, seconds since the Unix epoch or None",
        )?
    };
    if seconds < 0.0 {
        return Err(invalid_input(format!(
            "fire_time {seconds} is before 1970; give the time the scheduler fired"
        )));
    }
    let since_epoch = Duration::try_from_secs_f64(seconds)
        .map_err(|_| invalid_input(format!("fire_time {seconds} is out of range")))?;
    Ok(Some(UNIX_EPOCH + since_epoch))
}

fn seconds(value: &Bound<'_, PyAny>, what: &str, expected: &str) -> PyResult<f64> {
    let seconds = if value.is_instance_of::<PyBool>() {
        None
    } else if value.is_instance_of::<PyInt>() || value.is_instance_of::<PyFloat>() {
        Some(value.extract::<f64>()?)
    } else if value.hasattr("total_seconds")? {
        Some(value.call_method0("total_seconds")?.extract::<f64>()?)
    } else {
        None
    };
    match seconds {
        Some(seconds) if seconds.is_finite() => Ok(seconds),
        Some(seconds) => Err(invalid_input(format!(
            "{what} is {seconds}; give a finite number"
        ))),
        None => Err(invalid_input(format!(
            "{what} must be {expected}, not {}",
            type_name(value)
        ))),
    }
}

/// The JSON value of job arguments: an object with positional arguments
/// under their index ("0", "1", ...) and keyword arguments by name. With
/// `only`, other arguments are left out before conversion (so they need no
/// JSON form); the key is the same, as `JobKey::only` drops them anyway.
pub fn job_args(
    args: Option<&Bound<'_, PyAny>>,
    kwargs: Option<&Bound<'_, PyAny>>,
    only: Option<&[String]>,
) -> PyResult<Option<Value>> {
    let counted = |name: &str| only.is_none_or(|only| only.iter().any(|o| o == name));
    let args = args.filter(|a| !a.is_none());
    let kwargs = kwargs.filter(|k| !k.is_none());
    if args.is_none() && kwargs.is_none() {
        if let Some(name) = only.and_then(|only| only.first()) {
            return Err(invalid_input(format!(
                "only names '{name}', but no arguments were given"
            )));
        }
        return Ok(None);
    }
    let mut object = Map::new();
    // Every argument name given, for checking `only`.
    let mut given: Vec<String> = Vec::new();
    if let Some(args) = args {
        if !(args.is_instance_of::<PyList>() || args.is_instance_of::<PyTuple>()) {
            return Err(invalid_input(format!(
                "args must be a list or tuple, not {}",
                type_name(args)
            )));
        }
        for (index, item) in args.try_iter()?.enumerate() {
            let (name, item) = (index.to_string(), item?);
            if counted(&name) {
                object.insert(name.clone(), json(&item, 0)?);
            }
            given.push(name);
        }
    }
    if let Some(kwargs) = kwargs {
        let kwargs = kwargs.cast::<PyDict>().map_err(|_| {
            invalid_input(format!("kwargs must be a dict, not {}", type_name(kwargs)))
        })?;
        for (name, value) in kwargs.iter() {
            let name: String = name
                .extract()
                .map_err(|_| invalid_input("keyword argument names must be strings"))?;
            if name.parse::<usize>().is_ok() {
                return Err(invalid_input(format!(
                    "keyword argument {name:?} looks like a positional argument's index"
                )));
            }
            if counted(&name) {
                object.insert(name.clone(), json(&value, 0)?);
            }
            given.push(name);
        }
    }
    if let Some(only) = only {
        let unknown: Vec<String> = only
            .iter()
            .filter(|name| !given.contains(name))
            .map(|name| format!("'{name}'"))
            .collect();
        if !unknown.is_empty() {
            return Err(invalid_input(format!(
                "only names {}, which {} not among the arguments given ({}); list positional \
                 indexes (0, 1, ...) or keyword names of this call",
                unknown.join(", "),
                if unknown.len() == 1 { "is" } else { "are" },
                given.join(", ")
            )));
        }
    }
    Ok(Some(Value::Object(object)))
}

/// Nesting deeper than this is refused rather than risking the stack.
const MAX_DEPTH: usize = 64;

fn json(value: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(invalid_input(format!(
            "job arguments are nested deeper than {MAX_DEPTH} levels"
        )));
    }
    if value.is_none() {
        Ok(Value::Null)
    } else if let Ok(flag) = value.cast::<PyBool>() {
        Ok(Value::Bool(flag.is_true()))
    } else if value.is_instance_of::<PyInt>() {
        if let Ok(n) = value.extract::<i64>() {
            Ok(Value::from(n))
        } else if let Ok(n) = value.extract::<u64>() {
            Ok(Value::from(n))
        } else {
            Err(invalid_input(
                "an integer job argument is outside the 64-bit range; pass it as a string",
            ))
        }
    } else if value.is_instance_of::<PyFloat>() {
        let n = value.extract::<f64>()?;
        Number::from_f64(n)
            .map(Value::Number)
            .ok_or_else(|| invalid_input(format!("job argument {n} is not a finite number")))
    } else if value.is_instance_of::<PyString>() {
        Ok(Value::String(value.extract::<String>()?))
    } else if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        value
            .try_iter()?
            .map(|item| json(&item?, depth + 1))
            .collect::<PyResult<Vec<_>>>()
            .map(Value::Array)
    } else if let Ok(dict) = value.cast::<PyDict>() {
        let mut object = Map::new();
        for (name, item) in dict.iter() {
            let name: String = name.extract().map_err(|_| {
                invalid_input(format!(
                    "a dict in the job arguments has a key of type {}; only string keys map to JSON",
                    type_name(&name)
                ))
            })?;
            object.insert(name, json(&item, depth + 1)?);
        }
        Ok(Value::Object(object))
    } else {
        Err(invalid_input(format!(
            "a job argument of type {} has no JSON form; select JSON-compatible arguments with `only`/`key_args` or pass a str",
            type_name(value)
        )))
    }
}

/// The Python type name of `value`, for messages.
pub fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map(|name| name.to_string())
        .unwrap_or_else(|_| "?".to_owned())
}
