//! Rust `tracing` events to Python's `logging`.
//!
//! The library reports acquire, skip, renewal failure, lost and release as
//! `tracing` events. This module is the process's `tracing` subscriber: an
//! event at or above the effective level of the Python logger `distlock`
//! (only warnings and errors from other crates: the drivers) becomes a
//! record on a logger named after the crate (`distlock.core`,
//! `distlock.redis`, ...; drivers under `distlock.driver.<crate>`).
//!
//! Records are handed to one thread of their own, which takes the GIL to
//! log them: the runtime threads that renew leases must never wait for the
//! GIL (a Python thread may hold it for a long time in C code), so an event
//! only costs formatting and a channel send. A full channel drops records
//! and the next one says how many.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Mutex, TryLockError};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};

/// Python's numeric level of the `distlock` logger (DEBUG 10 ... ERROR 40).
static LEVEL: AtomicU8 = AtomicU8::new(30);
/// Set at interpreter exit: no thread may take the GIL after it.
static STOPPED: AtomicBool = AtomicBool::new(false);
/// The logging thread is inside Python.
static BUSY: AtomicBool = AtomicBool::new(false);
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// This process's channel to its logging thread (a forked child starts
/// its own: the parent's thread does not exist there).
static SINK: Mutex<Option<(u32, SyncSender<Line>)>> = Mutex::new(None);

const QUEUE: usize = 4096;

struct Line {
    logger: String,
    level: u8,
    message: String,
}

fn python_level(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        _ => 5,
    }
}

/// The Python logger of a `tracing` target (`distlock_core::guard` ->
/// `distlock.core`).
fn logger_name(target: &str) -> String {
    let krate = target.split("::").next().unwrap_or(target);
    match krate.strip_prefix("distlock") {
        // The facade, and this binding (crate `_distlock`).
        Some("") => "distlock".to_owned(),
        Some(rest) if rest.starts_with('_') => format!("distlock.{}", &rest[1..]),
        _ if krate == "_distlock" => "distlock".to_owned(),
        _ => format!("distlock.driver.{krate}"),
    }
}

fn ours(target: &str) -> bool {
    target.starts_with("distlock") || target.starts_with("_distlock")
}

/// Reads the effective level of the `distlock` logger again (Celery sets
/// up logging after the task modules are imported).
pub fn refresh(py: Python<'_>) -> PyResult<()> {
    let level: i64 = py
        .import("logging")?
        .call_method1("getLogger", ("distlock",))?
        .call_method0("getEffectiveLevel")?
        .extract()?;
    LEVEL.store(level.clamp(0, 255) as u8, Ordering::Relaxed);
    Ok(())
}

/// Installs the subscriber (once per process image; a forked child
/// inherits it).
pub fn install(py: Python<'_>) -> PyResult<()> {
    refresh(py)?;
    // Fails only if this extension already installed it.
    let _ = tracing::subscriber::set_global_default(ToPython);
    Ok(())
}

/// Stops the hand-over at interpreter exit: no record is logged after it,
/// and a record being logged now is finished first (bounded wait).
#[pyfunction]
pub fn _stop_logging(py: Python<'_>) {
    STOPPED.store(true, Ordering::SeqCst);
    py.detach(|| {
        let deadline = Instant::now() + Duration::from_secs(1);
        while BUSY.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// Reads the `distlock` logger's level again; the Celery helpers call it
/// once Celery has configured logging.
#[pyfunction]
pub fn _refresh_logging(py: Python<'_>) -> PyResult<()> {
    refresh(py)
}

fn send(line: Line) {
    let pid = std::process::id();
    // Never block (nor deadlock in a child forked while a thread held the
    // lock): a contended record is dropped and counted.
    let mut slot = match SINK.try_lock() {
        Ok(slot) => slot,
        Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(TryLockError::WouldBlock) => {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    if slot.as_ref().is_none_or(|(owner, _)| *owner != pid) {
        let (sender, receiver) = sync_channel(QUEUE);
        let started = std::thread::Builder::new()
            .name("distlock-log".to_owned())
            .spawn(move || forward(receiver));
        if started.is_err() {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        *slot = Some((pid, sender));
    }
    if let Some((_, sender)) = slot.as_ref() {
        match sender.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn forward(lines: Receiver<Line>) {
    while let Ok(mut line) = lines.recv() {
        BUSY.store(true, Ordering::SeqCst);
        if STOPPED.load(Ordering::SeqCst) {
            BUSY.store(false, Ordering::SeqCst);
            return;
        }
        let dropped = DROPPED.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            let _ = write!(
                line.message,
                " ({dropped} earlier distlock log records dropped)"
            );
        }
        Python::attach(|py| {
            let logged = py
                .import("logging")
                .and_then(|logging| logging.call_method1("getLogger", (line.logger.as_str(),)))
                .and_then(|logger| logger.call_method1("log", (line.level, line.message.as_str())));
            if let Err(error) = logged {
                error.write_unraisable(py, None);
            }
            let _ = refresh(py);
        });
        BUSY.store(false, Ordering::SeqCst);
    }
}

/// Formats an event: its message, then `name=value` for each field.
#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

/// The subscriber. Spans are not recorded: every event worth logging
/// carries its key and fencing token as fields.
struct ToPython;

impl ToPython {
    fn wanted(metadata: &Metadata<'_>) -> bool {
        let level = python_level(metadata.level());
        (ours(metadata.target()) || level >= 30) && level >= LEVEL.load(Ordering::Relaxed)
    }
}

impl Subscriber for ToPython {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if metadata.is_span() {
            Interest::never()
        } else {
            // The level can change at run time: ask every time.
            Interest::sometimes()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.is_event() && Self::wanted(metadata)
    }

    fn new_span(&self, _span: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _span: &Id, _values: &Record<'_>) {}

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        if STOPPED.load(Ordering::Relaxed) {
            return;
        }
        let metadata = event.metadata();
        let mut text = Text::default();
        event.record(&mut text);
        text.message.push_str(&text.fields);
        send(Line {
            logger: logger_name(metadata.target()),
            level: python_level(metadata.level()),
            message: text.message,
        });
    }

    fn enter(&self, _span: &Id) {}

    fn exit(&self, _span: &Id) {}
}
