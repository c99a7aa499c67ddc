//! `FireOutcome`: how one `run_once_per_fire` call ended.

use pyo3::prelude::*;

use crate::backend::{self, ScheduledOutcome};
use crate::errors::lost_text;

/// How one `run_once_per_fire` call ended on this instance.
#[pyclass(module = "distlock", frozen, get_all)]
pub(crate) struct FireOutcome {
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
    pub(crate) fn from_outcome(
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
